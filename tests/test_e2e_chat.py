"""/v1/chat/completions end to end: gunicorn → Redis/RQ → worker process → pub/sub, with the openai SDK."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from openai import OpenAI
from tokenizers import Tokenizer

from scripts import localstack, real_models

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "what is your hobby?"}]


def chat(client, **kwargs):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model="demo", messages=MESSAGES, **kwargs)


def stream_text(client, **kwargs) -> tuple[str, list]:  # type: ignore[no-untyped-def]
    chunks = list(chat(client, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_non_stream_returns_chat_completion_with_usage(openai_client) -> None:
    completion = chat(openai_client, max_tokens=8, temperature=0)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "demo"
    choice = completion.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_tokens_reached_gives_length_and_matching_usage(openai_client) -> None:
    completion = chat(openai_client, max_tokens=12, temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12


def test_stream_has_role_chunk_deltas_and_one_finish_chunk(openai_client) -> None:
    text, chunks = stream_text(openai_client, max_tokens=10, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-1].choices[0].finish_reason == finishes[0]
    assert len({c.id for c in chunks}) == 1
    assert text


def test_greedy_stream_text_equals_non_stream_text(openai_client) -> None:
    completion = chat(openai_client, max_tokens=24, temperature=0)
    text, _ = stream_text(openai_client, max_tokens=24, temperature=0)
    assert text == completion.choices[0].message.content


def test_same_seed_gives_same_text_and_other_seed_differs(openai_client) -> None:
    first = chat(openai_client, max_tokens=24, temperature=1.0, seed=42).choices[0].message.content
    second = chat(openai_client, max_tokens=24, temperature=1.0, seed=42).choices[0].message.content
    other = chat(openai_client, max_tokens=24, temperature=1.0, seed=43).choices[0].message.content
    assert first == second
    assert first != other


def test_seeded_stream_equals_seeded_non_stream(openai_client) -> None:
    completion = chat(openai_client, max_tokens=16, seed=7, extra_body={"top_k": 20})
    text, _ = stream_text(openai_client, max_tokens=16, seed=7, extra_body={"top_k": 20})
    assert text == completion.choices[0].message.content


def test_stream_include_usage_sends_usage_chunk_with_empty_choices(openai_client) -> None:
    _, chunks = stream_text(
        openai_client,
        max_tokens=6,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_ends_generation_and_is_not_emitted(openai_client) -> None:
    free = chat(openai_client, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    stop = text[10:13]
    stopped = chat(openai_client, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_seed_document_sample_requests_succeed(stack) -> None:
    """The two request samples of openai_chat_completions_api.txt, with our model name."""
    sampling = {
        "max_tokens": 20,
        "presence_penalty": 1.03,
        "frequency_penalty": 1.0,
        "seed": None,
        "temperature": 0.5,
        "top_p": 0.95,
        "stream": False,
    }
    samples = [
        {"model": "demo", "messages": [{"role": "user", "content": "You are a helpful assistant."}], **sampling},
        {
            "model": "demo",
            "messages": [
                {"role": "system", "content": "You are a student who is good at math."},
                {"role": "user", "content": "what is your hobby?"},
            ],
            **sampling,
        },
    ]
    for body in samples:
        response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
        streamed = requests.post(f"{stack.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200
        events = [line for line in streamed.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_headers_disable_buffering(stack) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"


def test_content_parts_in_both_forms_give_the_same_prompt(openai_client) -> None:
    plain = chat(openai_client, max_tokens=1, temperature=0)
    parts = openai_client.chat.completions.create(
        model="demo",
        max_tokens=1,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is your hobby?"}]}],
    )
    body = openai_client.chat.completions.create(
        model="demo",
        max_tokens=1,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "body": "what is your hobby?"}]}],  # type: ignore[list-item]
    )
    assert plain.usage.prompt_tokens == parts.usage.prompt_tokens == body.usage.prompt_tokens
    assert plain.choices[0].message.content == parts.choices[0].message.content == body.choices[0].message.content


def test_models_lists_the_served_model(openai_client) -> None:
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["demo"]


@pytest.fixture(scope="module")
def reasoner(stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker and an API serving the demo model under DeepSeek-R1-Distill's chat template, whose
    prompt, with enable_thinking, leaves the model inside its <think> (a reasoning model)."""
    directory = tmp_path_factory.mktemp("reasoner")
    model = directory / "reasoner"
    shutil.copytree(demo_model, model)
    template = real_models.chat_templates() / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    (model / "chat_template.jinja").write_text(template.read_text())
    with localstack.running_model({**stack_env, "MODEL_PATH": str(model)}, "reasoner", directory) as url:
        yield url


def test_a_thinking_token_budget_ends_the_reasoning_where_it_is_spent(stack, reasoner: str, demo_model: Path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's thinking_token_budget: after that many tokens of reasoning the tokens of </think> are
    forced and the answer follows; the same seeded request without it reasons on (its first tokens
    the same draws), and a model that does not reason in <think> refuses it by name."""
    closing = Tokenizer.from_file(str(demo_model / "tokenizer.json")).encode("</think>", add_special_tokens=False).ids
    body = {
        "model": "reasoner",
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 12,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}, "return_token_ids": True, "ignore_eos": True},
    }
    with OpenAI(base_url=f"{reasoner}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        budget = {**body, "extra_body": {**body["extra_body"], "thinking_token_budget": 4}}
        budgeted = client.chat.completions.create(**budget).model_dump()["choices"][0]
        free = client.chat.completions.create(**body).model_dump()["choices"][0]
    ids = budgeted["token_ids"]
    assert ids[4 : 4 + len(closing)] == closing and free["token_ids"][:4] == ids[:4]
    assert free["token_ids"][4 : 4 + len(closing)] != closing
    assert budgeted["message"]["reasoning_content"] is not None and free["message"]["content"] is None  # still thinking
    plain = {"model": "demo", "messages": MESSAGES, "max_tokens": 2, "thinking_token_budget": 4}
    refused = requests.post(f"{stack.base_url}/v1/chat/completions", json=plain, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
