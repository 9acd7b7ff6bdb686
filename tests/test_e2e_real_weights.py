"""SmolLM2-135M-Instruct's real weights served by the whole stack (a worker, gunicorn, the openai
client): chat answers are transformers' greedy answers, streamed and not, and /v1/completions scores a
prompt as transformers does (the logprob of each prompt token, within 1e-3)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from anthropic import Anthropic
from openai import OpenAI
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from scripts import localstack

pytestmark = [pytest.mark.e2e, pytest.mark.real_weights]

MODEL = "smollm2"
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?"]
SCORED = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


@pytest.fixture(scope="module")
def client(smollm2: Path, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    env = {**stack_env, "MODEL_PATH": str(smollm2), "TOKENLINE_MAX_ITER_TIMES": ""}
    with (
        localstack.running_model(env, MODEL, tmp_path_factory.mktemp("smollm2")) as url,
        OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client,
    ):
        yield client  # closed first: an idle connection holds the API's stop for gunicorn's keep-alive


@pytest.fixture(scope="module")
def model(smollm2: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)


def generated(model: torch.nn.Module, smollm2: Path, question: str) -> tuple[str, str]:
    """transformers' greedy answer and why it ended ("stop" at the end-of-turn token, else "length")."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :]
    return tokenizer.decode(out, skip_special_tokens=True), "stop" if out[-1] == tokenizer.eos_token_id else "length"


def test_chat_answers_are_transformers_greedy_answers_streamed_and_not(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    answers = [generated(model, smollm2, question) for question in QUESTIONS]
    assert answers[0] == ("The capital of France is Paris.", "stop")
    for question, (expected, finish) in zip(QUESTIONS, answers, strict=True):
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
        assert whole.choices[0].message.content == expected
        assert whole.choices[0].finish_reason == finish
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=48, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_completions_scores_the_prompt_as_transformers_does(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    ids = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode(SCORED).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    scored = client.completions.create(model=MODEL, prompt=SCORED, max_tokens=0, echo=True, logprobs=1)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == SCORED
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(ids)
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), torch.tensor(expected), rtol=0, atol=1e-3)


def test_a_prefilled_answer_is_continued_as_transformers_continues_it(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    """An assistant prefill (chat's continue_final_message, vLLM's; the Messages API's final assistant
    message): the answer is the rest of the text, transformers' greedy continuation of the prompt that
    `apply_chat_template(continue_final_message=True)` renders."""
    messages = [
        {"role": "user", "content": "Name a famous landmark in Paris."},
        {"role": "assistant", "content": "One famous landmark in Paris is"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, return_dict=False
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    expected = tokenizer.decode(out, skip_special_tokens=True)
    assert expected.startswith(" the Eiffel Tower")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=16,
        extra_body={"continue_final_message": True},
    )
    assert chat.choices[0].message.content == expected
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    # vLLM's echo: the answer begins with the final assistant message's text, streamed and not.
    echo = {"continue_final_message": True, "echo": True}
    asked = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16, "extra_body": echo}
    whole = client.chat.completions.create(**asked)  # type: ignore[call-overload]
    assert whole.choices[0].message.content == messages[1]["content"] + expected
    stream = client.chat.completions.create(**asked, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == messages[1]["content"] + expected
    with Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            extra_body={"temperature": 0},  # the SDK no longer sends sampling fields itself
        )
    assert message.content[0].text == expected  # type: ignore[union-attr]
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(ids)


def test_vllms_bad_words_allowed_token_ids_and_prompt_truncation_steer_as_transformers_does(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    """vLLM's request fields on real text: `bad_words` keep "Paris" out of the answer that had it
    (transformers' greedy answer with the same token sequences banned), `allowed_token_ids` leave the
    model the better of two tokens by its own logits, and `truncate_prompt_tokens` answers the prompt's
    last tokens as a prompt of those tokens alone is answered."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    # As vLLM tokenizes a bad word: alone, and after a space where that gives other tokens as many.
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    assert len(banned[0]) == len(banned[1]) and banned[0][0] != banned[1][0]
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, bad_words_ids=banned)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" not in expected
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=24,
        extra_body={"bad_words": ["Paris"]},  # type: ignore[arg-type]
    )
    assert chat.choices[0].message.content == expected

    prompt = "Is the sky blue? Answer yes or no. Answer:"
    prompt_ids = tokenizer.encode(prompt)
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no"))
    with torch.no_grad():
        last = model(torch.tensor([prompt_ids])).logits[0, -1]
    better = yes if last[yes] > last[no] else no
    assert last.argmax().item() not in (yes, no)  # the restriction decides, not the model's own choice
    picked = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=1, extra_body={"allowed_token_ids": [yes, no]}
    )
    assert picked.choices[0].text == tokenizer.decode([better])

    text = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
    text_ids = tokenizer.encode(text)
    kept = text_ids[-6:]
    out = model.generate(torch.tensor([kept]), max_new_tokens=8, do_sample=False)[0, len(kept) :]
    truncated = client.completions.create(
        model=MODEL, prompt=text, temperature=0, max_tokens=8, echo=True, extra_body={"truncate_prompt_tokens": 6}
    )
    assert truncated.usage is not None and truncated.usage.prompt_tokens == 6
    assert truncated.choices[0].text == tokenizer.decode(kept) + tokenizer.decode(out)


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_streamed_and_not(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    """vLLM's return_token_ids: the prompt's ids (chat: the rendered conversation's) and the answer's,
    its end-of-turn token included, transformers' greedy ids; a stream splits the answer's ids among
    its chunks with their text and gives the prompt's in its first chunk."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert expected[-1] == tokenizer.eos_token_id
    asked = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}
    whole = client.chat.completions.create(**asked, extra_body={"return_token_ids": True}).model_dump()
    assert whole["prompt_token_ids"] == ids and whole["choices"][0]["token_ids"] == expected
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(**asked, stream=True, extra_body={"return_token_ids": True})
    ]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == expected
    assert (
        "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == whole["choices"][0]["message"]["content"]
    )
    assert "token_ids" not in client.chat.completions.create(**asked).model_dump()["choices"][0]  # only when asked

    prompt_ids = tokenizer.encode(SCORED)
    expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[
        0, len(prompt_ids) :
    ].tolist()
    asked = {
        "model": MODEL,
        "prompt": SCORED,
        "temperature": 0,
        "max_tokens": 6,
        "extra_body": {"return_token_ids": True},
    }
    choice = client.completions.create(**asked).model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == expected
    chunks = [c.model_dump()["choices"][0] for c in client.completions.create(**asked, stream=True)]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c.get("token_ids") or []] == expected


def test_prompt_logprobs_score_the_prompt_as_transformers_does_in_vllms_shape(
    client: OpenAI, model: torch.nn.Module, smollm2: Path
) -> None:
    """vLLM's prompt_logprobs: per prompt token (the first null) its id's logprob, rank among the
    vocabulary and text, then the k likeliest tokens' (ranks 1 to k), transformers' within 1e-3; on
    chat over the rendered conversation, on /v1/completions in each choice."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=2,
        extra_body={"prompt_logprobs": 2},  # type: ignore[arg-type]
    ).model_dump()
    completion = client.completions.create(
        model=MODEL, prompt=SCORED, temperature=0, max_tokens=2, extra_body={"prompt_logprobs": 2}
    ).model_dump()
    for ids, scored in (
        (chat_ids, chat["prompt_logprobs"]),
        (tokenizer.encode(SCORED), completion["choices"][0]["prompt_logprobs"]),
    ):
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert scored[0] is None and len(scored) == len(ids)
        for position, entry in enumerate(scored[1:], start=1):
            row, token = expected[position - 1], ids[position]
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
            assert mine["decoded_token"] == tokenizer.decode([token]) or position == 1
            # Its rank, up to ties within float noise.
            low, high = (int((row > row[token] + d).sum()) + 1 for d in (1e-4, -1e-4))
            assert low <= mine["rank"] <= high
            best = row.topk(2).indices.tolist()
            assert all(entry[str(t)]["rank"] == r or t == token for r, t in enumerate(best, 1))
            assert set(entry) == {str(token), *map(str, best)}
    one = client.completions.create(model=MODEL, prompt=[42], max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert one.model_dump()["choices"][0]["prompt_logprobs"] == [None]  # nothing predicts a first token


def test_return_tokens_as_token_ids_names_each_logprob_entry_by_its_id(client: OpenAI) -> None:
    """vLLM's return_tokens_as_token_ids: chat's and completions' logprob entries name their tokens
    `token_id:<id>` (the ids return_token_ids gives), the text itself unchanged."""
    asked = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body=asked,  # type: ignore[arg-type]
    ).model_dump()["choices"][0]
    entries = chat["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    assert all(alt["token"].startswith("token_id:") for e in entries for alt in e["top_logprobs"])
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)  # type: ignore[arg-type]
    assert chat["message"]["content"] == plain.choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt=SCORED, temperature=0, max_tokens=4, logprobs=1, echo=True, extra_body=asked
    ).model_dump()["choices"][0]
    ids = [*completion["prompt_token_ids"], *completion["token_ids"]]
    assert completion["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert completion["text"].startswith(SCORED)
    assert completion["logprobs"]["text_offset"][-1] < len(completion["text"])  # offsets of the text, not the names


def test_penalised_greedy_answers_are_transformers_ones(client: OpenAI, model: torch.nn.Module, smollm2: Path) -> None:
    """repetition_penalty is transformers' (prompt and output), presence and frequency penalties
    OpenAI's (output counts): the greedy answers are transformers' with the same processors, token
    for token."""

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, start: int, presence: float, frequency: float) -> None:
            self.start, self.presence, self.frequency = start, presence, frequency

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            counts = torch.bincount(input_ids[0, self.start :], minlength=scores.shape[-1]).float()
            return scores - self.frequency * counts - self.presence * (counts > 0).float()

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": "List three fruits and repeat them."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    plain = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    for asked, processors in (
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        (
            {"presence_penalty": 0.8, "frequency_penalty": 0.5},
            {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids), 0.8, 0.5)])},
        ),
    ):
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, **processors)
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=24,
            extra_body={**asked, "return_token_ids": True},
        )
        assert expected[0, len(ids) :].tolist() != plain  # the penalty changes the answer
        assert answer.model_dump()["choices"][0]["token_ids"] == expected[0, len(ids) :].tolist(), asked


# SmolLM2's template with a tools section that teaches Qwen's hermes calls (its own has none), and one
# that teaches Llama 3's JSON calls (the whole answer; the `<|python_tag|>` it names selects the format).
TOOLS_SECTION = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    '{% endfor %}</tools>\nTo call one, write <tool_call>\n{"name": <name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{% endif %}"
)
LLAMA_SECTION = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'To call one, answer with only {"name": <name>, "parameters": <args-json-object>} (or <|python_tag|> '
    "first).<|im_end|>\n{% endif %}"
)
SHOWN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "ROM", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "ROM", "days": 2}}',
}


@pytest.fixture(scope="module", params=sorted(SHOWN))
def tools_client(
    request: pytest.FixtureRequest, smollm2: Path, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OpenAI, str]]:
    """SmolLM2 served with a tools section before its template, and the format it teaches: hermes's in
    the model's directory (its other files linked, not copied), Llama 3's from the chatTemplate
    setting."""
    model = tmp_path_factory.mktemp("smollm2-tools") / "smollm2-tools"
    model.mkdir()
    for file in smollm2.iterdir():
        if file.name != "chat_template.jinja":
            (model / file.name).symlink_to(file)
    own = (smollm2 / "chat_template.jinja").read_text()
    env = {**stack_env, "MODEL_PATH": str(model), "TOKENLINE_MAX_ITER_TIMES": ""}
    if request.param == "hermes":
        (model / "chat_template.jinja").write_text(TOOLS_SECTION + own)
    else:
        (model / "chat_template.jinja").write_text(own)
        (model.parent / "llama.jinja").write_text(LLAMA_SECTION + own)
        env["TOKENLINE_CHAT_TEMPLATE"] = str(model.parent / "llama.jinja")
    with (
        localstack.running_model(env, model.name, model.parent) as url,
        OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client,
    ):
        yield client, request.param


def test_a_strict_tools_call_under_auto_keeps_to_its_schema_where_the_model_left_it(
    tools_client: tuple[OpenAI, str],
) -> None:
    """Real weights, tool_choice auto, calls shown twice in the model's format (hermes's, or Llama 3's
    JSON answer): SmolLM2 writes the third call itself, with the city's name, which the schema's enum
    does not hold; with `strict: true` the grammar holds the call to the schema, and the same greedy
    model writes one of the enum's codes. With a JSON response format beside the tools (one that
    takes any object: a Llama 3 call may not pass as the answer), the model still calls, held so."""
    client, format = tools_client
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["BER", "ROM", "PAR"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    asked, answered = (
        {"role": "user", "content": "Weather in Rome for 2 days?"},
        {"role": "assistant", "content": SHOWN[format]},
    )
    messages: Any = [asked, answered, asked, answered, {"role": "user", "content": "Weather in Berlin for 3 days?"}]
    calls = {}
    for strict in (False, True):
        tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": schema, "strict": strict}}
        answer = client.chat.completions.create(
            model="smollm2-tools", messages=messages, tools=[tool], temperature=0, max_tokens=60
        )
        (call,) = answer.choices[0].message.tool_calls or []
        assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        calls[strict] = json.loads(call.function.arguments)
    assert calls[False]["city"] not in schema["properties"]["city"]["enum"]  # type: ignore[index]
    assert calls[True]["city"] in ("BER", "ROM", "PAR") and set(calls[True]) == {"city", "days"}
    assert isinstance(calls[True]["days"], int)
    # An agent with an output type sends its JSON format beside the tools: the model may still call.
    report = {"type": "json_schema", "json_schema": {"name": "report", "schema": {"type": "object"}}}
    answer = client.chat.completions.create(
        model="smollm2-tools", messages=messages, tools=[tool], response_format=report, temperature=0, max_tokens=60
    )
    (call,) = answer.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == calls[True]
