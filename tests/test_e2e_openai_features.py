"""The OpenAI features agents and evaluation harnesses use, through the official SDK and gunicorn:
forced tool calls and structured output on the demo model (random weights), logprobs against
transformers, completions with echo, the model routes and /tokenize."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from scripts import localstack

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def valid_weather(arguments: dict) -> bool:
    return (
        set(arguments) == {"city", "days", "unit"}
        and isinstance(arguments["city"], str)
        and len(arguments["city"]) <= 12
        and type(arguments["days"]) is int
        and 1 <= arguments["days"] <= 7
        and arguments["unit"] in ("c", "f")
    )


def valid_person(value: dict) -> bool:
    return (
        set(value) == {"name", "age", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 10
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(t in ("a", "b") for t in value["tags"])
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_named_tool_choice_gives_that_call_with_arguments_valid_for_its_schema(openai_client, seed: int) -> None:
    completion = openai_client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        seed=seed,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM end a call the client named
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert valid_weather(json.loads(call.function.arguments))


def test_a_forced_call_with_a_response_format_is_the_call_as_an_agent_with_an_output_type_sends_them(
    openai_client, stack
) -> None:
    """openai-agents sends its output type's response_format with tool_choice "required" (OpenAI and
    vLLM take the pair): the call is made, constrained by its tool's schema; the format, which shapes
    text, has none to shape. A format whose schema does not compile is still a 400 naming it."""
    report = {"type": "json_schema", "json_schema": {"name": "report", "schema": {"type": "object"}}}
    completion = openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice="required", response_format=report,
        max_tokens=200, seed=3,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and valid_weather(json.loads(call.function.arguments))
    broken = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "integer", "maximum": 2e30}}}
    body = {"model": "demo", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
    refused = requests.post(
        f"{stack.base_url}/v1/chat/completions", json={**body, "response_format": broken}, timeout=30
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.json_schema.schema"


def test_required_tool_choice_streams_one_valid_call_per_choice(openai_client) -> None:
    stream = openai_client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=7,
        n=2,
        stream=True,
    )
    calls: dict[int, list] = {0: [], 1: []}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            calls[choice.index] += choice.delta.tool_calls or []
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        first, *rest = calls[index]
        assert first.id.startswith("call_") and all(d.index == 0 and d.id is None for d in rest)
        arguments = json.loads("".join(d.function.arguments for d in calls[index]))
        if first.function.name == "get_weather":
            assert valid_weather(arguments)
        else:
            assert first.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")


def test_json_schema_output_validates_inside_a_mixed_batch(openai_client) -> None:
    """Constrained and free requests run side by side; each constrained answer that ends parses and
    validates, and the free ones are unaffected."""

    def constrained(seed: int):  # type: ignore[no-untyped-def]
        return openai_client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "A person, please."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            max_tokens=120,
            seed=seed,
        )

    def free(seed: int):  # type: ignore[no-untyped-def]
        return openai_client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=20, seed=seed)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: (constrained if i % 2 else free)(i + 1), range(8)))
    for i, completion in enumerate(results):
        choice = completion.choices[0]
        if i % 2:
            assert choice.finish_reason == "stop"
            assert valid_person(json.loads(choice.message.content))
        else:
            assert choice.finish_reason == "length" and completion.usage.completion_tokens == 20
    alone = free(3).choices[0].message.content
    assert results[2].choices[0].message.content == alone


def test_json_object_output_is_a_json_object_or_is_cut_by_length(openai_client) -> None:
    for seed in (1, 2, 3, 4):
        completion = openai_client.chat.completions.create(
            model="demo", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=60, seed=seed
        )
        choice = completion.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and completion.usage.completion_tokens == 60
            assert choice.message.content.startswith("{")


STRUCTURED = [  # vLLM's structured_outputs, and what each answer must be
    ({"choice": ["positive", "negative", "neutral"]}, lambda text: text in ("positive", "negative", "neutral")),
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    ({"grammar": 'root ::= ("yes" | "no") " " d\nd ::= [0-9]'}, lambda text: re.fullmatch("(yes|no) [0-9]", text)),
    ({"json": json.dumps(PERSON)}, lambda text: valid_person(json.loads(text))),
]


@pytest.mark.parametrize("seed", [1, 2])
def test_vllms_structured_outputs_constrain_chat_and_completions(openai_client, seed: int) -> None:
    """A choice, a regex, a GBNF grammar and a schema (as its JSON text), through the openai SDK's
    extra_body as vLLM's users send them: on random weights only the constraint shapes the answer."""
    for spec, allowed in STRUCTURED:
        chat = openai_client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=120, seed=seed, extra_body={"structured_outputs": spec}
        )
        assert chat.choices[0].finish_reason == "stop" and allowed(chat.choices[0].message.content), spec
        completion = openai_client.completions.create(
            model="demo", prompt="The answer:", max_tokens=120, seed=seed, extra_body={"structured_outputs": spec}
        )
        assert completion.choices[0].finish_reason == "stop" and allowed(completion.choices[0].text), spec


def test_a_structured_output_that_does_not_compile_is_a_400_naming_its_field(stack) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "The answer:"}),
    ):
        for spec, param in (({"regex": "("}, "regex"), ({"choice": []}, "choice")):
            response = requests.post(
                f"{stack.base_url}{path}", json={"model": "demo", **body, "structured_outputs": spec}, timeout=30
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == f"structured_outputs.{param}"


def test_a_schema_that_does_not_compile_is_a_400_naming_it(stack) -> None:
    body = {
        "model": "demo",
        "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
    }
    response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def reference(demo_model: Path):  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    return model.eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def test_chat_logprobs_are_the_models_own_distribution(openai_client, stack, reference) -> None:
    completion = openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    prompt = requests.post(f"{stack.base_url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens == 8
    generated = requests.post(
        f"{stack.base_url}/tokenize",
        json={"prompt": completion.choices[0].message.content, "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    expected = reference_logprobs(reference, prompt + generated)
    for i, entry in enumerate(entries):
        row = expected[len(prompt) - 1 + i]
        best = row.topk(3)
        assert entry.logprob == pytest.approx(row.max().item(), abs=1e-4)  # greedy: the top token
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_streamed_logprobs_equal_the_non_streamed_ones(openai_client) -> None:
    kwargs = {"model": "demo", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = openai_client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in openai_client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs
        for entry in choice.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in whole]


def test_completions_echo_scores_every_prompt_token_like_transformers(openai_client, stack, reference) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    completion = openai_client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    ids = requests.post(f"{stack.base_url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    (choice,) = completion.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(ids) and completion.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    expected = reference_logprobs(reference, ids)
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
        # The two best alternatives, and the prompt's own token among them or beside them.
        top = logprobs.top_logprobs[i]
        best = sorted(top.values(), reverse=True)[:2]
        assert best == pytest.approx(expected[i - 1].topk(2).values.tolist(), abs=1e-4)
        assert top[logprobs.tokens[i]] == logprobs.token_logprobs[i]
        assert len(top) == (2 if ids[i] in expected[i - 1].topk(2).indices else 3)


def test_completions_top_logprobs_hold_each_sampled_token_too(openai_client) -> None:
    """OpenAI's completions return "up to logprobs+1 elements": the alternatives asked for, and the
    sampled token where it is not among them (vLLM alike)."""
    completion = openai_client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=12, logprobs=1, temperature=2.0, seed=5
    )
    logprobs = completion.choices[0].logprobs
    outside = 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        # The keys are texts: pieces of characters (U+FFFD) of different ids share one.
        assert token in top and (top[token] == logprob or token == "\ufffd") and len(top) <= 2
        outside += len(top) == 2
    assert outside  # at temperature 2, some sampled tokens are not the most likely one


def test_completions_take_token_ids_and_lists_of_prompts(openai_client) -> None:
    completion = openai_client.completions.create(
        model="demo", prompt=["Hello there", "Good morning"], max_tokens=3, n=2, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text == completion.choices[1].text  # greedy choices of one prompt agree
    assert completion.usage.completion_tokens == 12
    by_ids = openai_client.completions.create(model="demo", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 4 and by_ids.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in openai_client.completions.create(
            model="demo", prompt="Hello there", max_tokens=3, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == completion.choices[0].text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_completions_refuse_what_they_cannot_do_by_name(stack, change: dict, param: str) -> None:
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2, **change}
    response = requests.post(f"{stack.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_models_retrieve_and_a_missing_model_is_404(openai_client) -> None:
    import openai

    assert openai_client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as refused:  # the route takes no query parameters
        openai_client.models.retrieve("demo", extra_query={"limit": 1})
    assert refused.value.body["param"] == "limit"  # type: ignore[index]


def test_tokenize_and_detokenize_round_trip(stack) -> None:
    ids = requests.post(f"{stack.base_url}/tokenize", json={"prompt": "hello world"}, timeout=30).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
    text = requests.post(f"{stack.base_url}/detokenize", json={"tokens": ids["tokens"]}, timeout=30).json()
    assert text["prompt"].endswith("hello world")


def test_tokenize_renders_messages_with_or_without_the_assistant_turns_opening(stack) -> None:
    def tokenize(**body: object) -> requests.Response:
        return requests.post(f"{stack.base_url}/tokenize", json=body, timeout=30)

    opened = tokenize(messages=MESSAGES).json()["tokens"]
    assert tokenize(messages=MESSAGES, add_generation_prompt=True).json()["tokens"] == opened
    closed = tokenize(messages=MESSAGES, add_generation_prompt=False).json()["tokens"]
    assert len(closed) < len(opened) and opened[: len(closed)] == closed
    refused = tokenize(prompt="hi", add_generation_prompt=False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_generation_prompt"
    refused = tokenize(prompt="hi", chat_template_kwargs={"enable_thinking": False})  # no template renders it
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_an_agent_follow_up_turn_with_tool_results_is_served(openai_client) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    completion = openai_client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=3)
    assert completion.choices[0].finish_reason == "length"


def test_min_tokens_logit_bias_and_stop_token_ids_take_effect(openai_client, stack) -> None:
    base = {"model": "demo", "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
    first = openai_client.chat.completions.create(**base, logprobs=True)
    token = requests.post(
        f"{stack.base_url}/tokenize",
        json={"prompt": first.choices[0].logprobs.content[0].token, "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"][0]
    stopped = openai_client.chat.completions.create(**base, extra_body={"stop_token_ids": [token]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].stop_reason == token and first.choices[0].stop_reason is None  # type: ignore[attr-defined]
    banned = openai_client.chat.completions.create(**base, logit_bias={str(token): -100}, logprobs=True)
    assert banned.choices[0].logprobs.content[0].token != first.choices[0].logprobs.content[0].token


def joined_stream(stream) -> tuple[list[dict], str | None, list]:  # type: ignore[no-untyped-def]
    """A streamed choice's calls as a client joins them, its finish_reason and its tool-call deltas."""
    calls: list[dict] = []
    deltas: list = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                if delta.id:
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, deltas


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_allowed_tools_show_the_model_only_those_tools_and_required_calls_one_of_them(openai_client) -> None:
    """OpenAI's `allowed_tools` choice: the template renders the allowed tools only, and mode required
    forces a call of one of them."""
    allowed = [{"type": "function", "function": {"name": TIME["function"]["name"]}}]

    def ask(mode: str, **extra: object):  # type: ignore[no-untyped-def]
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": allowed}}
        return openai_client.chat.completions.create(
            model="demo", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, **extra
        )

    calls = [ask("required", max_tokens=100, seed=seed).choices[0].message.tool_calls or [] for seed in range(1, 5)]
    assert {call.function.name for called in calls for call in called} == {TIME["function"]["name"]}
    shown = openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[TIME], tool_choice="none", max_tokens=1
    )
    assert ask("auto", max_tokens=1).usage.prompt_tokens == shown.usage.prompt_tokens  # the prompt of TIME alone


def test_a_forced_calls_arguments_stream_as_they_are_generated(openai_client) -> None:
    kwargs = {"model": "demo", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 200}
    calls, finish, deltas = joined_stream(openai_client.chat.completions.create(**kwargs, seed=5, stream=True))
    # A named call ends with `stop`, as OpenAI ends it; its arguments come one delta per generated piece.
    assert finish == "stop" and len(deltas) > 3
    whole = openai_client.chat.completions.create(**kwargs, seed=5).choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert valid_weather(json.loads(calls[0]["arguments"]))


@pytest.mark.parametrize(("tool_choice", "max_tokens"), [("required", 40), (NAMED, 12)])
def test_a_forced_call_cut_by_max_tokens_is_a_tool_call_with_the_arguments_so_far(
    openai_client, tool_choice, max_tokens: int
) -> None:
    kwargs = {"model": "demo", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice}
    kwargs["max_tokens"] = max_tokens  # past the function's name (33 demo tokens in the required array), not the end
    completion = openai_client.chat.completions.create(**kwargs, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    calls, finish, _ = joined_stream(openai_client.chat.completions.create(**kwargs, seed=3, stream=True))
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_an_answer_sent_back_as_the_sdk_dumps_it_is_served(openai_client, stack) -> None:
    """`messages.append(completion.choices[0].message.model_dump())`: every field of OpenAI's response
    message, null where unset (refusal, audio, function_call, annotations), as the openai SDK dumps it."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice=named, max_tokens=40, temperature=0
    )
    called = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(called) and called["tool_calls"]
    call_id = called["tool_calls"][0]["id"]
    messages = [*MESSAGES, called, {"role": "tool", "tool_call_id": call_id, "content": "18 C"}]
    second = openai_client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=3)
    said = second.choices[0].message.model_dump()
    third = openai_client.chat.completions.create(
        model="demo", messages=[*messages, said, {"role": "user", "content": "Thanks"}], max_tokens=2
    )
    assert third.choices[0].finish_reason == "length"
    # A refusal is the assistant's text.
    refused = {"role": "assistant", "content": None, "refusal": "I cannot say."}
    as_text = {"role": "assistant", "content": "I cannot say."}

    def tokens(turn: dict) -> list[int]:
        body = {"messages": [*MESSAGES, turn, {"role": "user", "content": "Why?"}]}
        return requests.post(f"{stack.base_url}/tokenize", json=body, timeout=30).json()["tokens"]

    assert tokens(refused) == tokens(as_text)


def test_fields_whose_request_is_what_happens_are_accepted(openai_client) -> None:
    completion = openai_client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=2,
        store=False,
        service_tier="auto",
        modalities=["text"],
        metadata={"team": "agents"},
        safety_identifier="user-42",
        prompt_cache_key="weather-bot",
        reasoning_effort="low",
    )
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "demo", "messages": MESSAGES}),
        ("/v1/completions", {"model": "demo", "prompt": "hi"}),
        ("/generate", {"prompt": "hi"}),
    ],
)
def test_the_end_users_id_is_logged_with_the_request_id_on_every_text_route(stack, path: str, body: dict) -> None:
    """OpenAI's `user`, accepted on each route, is what it is for: in the log beside our request id."""
    answer = requests.post(f"{stack.base_url}{path}", json={**body, "max_tokens": 1, "user": "u-7"}, timeout=30)
    assert answer.ok, answer.text
    logged = f"request_id={answer.headers['X-Request-Id']} user=u-7 "
    localstack.wait_for(lambda: logged in (stack.logs / "api.log").read_text(), 10, "the user in the log")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"store": True}, "store"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"modalities": ["audio"]}, "modalities[0]"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "messages[1].audio"),
        ({"messages": [*MESSAGES, {"role": "assistant", "function_call": {"name": "f"}}]}, "messages[1].function_call"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[1].refusal"),
        ({"messages": [{"role": "user", "content": "x", "annotations": [{"type": "url"}]}]}, "messages[0].annotations"),
    ],
)
def test_fields_asking_for_what_cannot_happen_are_a_400_naming_them(stack, change: dict, param: str) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 2, **change}
    response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_continuous_usage_stats_count_the_tokens_in_every_chunk(openai_client) -> None:
    stream = openai_client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},  # sampled at temperature 1: an end of sequence before 6 tokens
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2:] == [6, 6]
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


def test_completions_stream_continuous_usage_stats_too(openai_client) -> None:
    stream = openai_client.completions.create(
        model="demo",
        prompt="Hello there",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},  # sampled at temperature 1: it ended at 3 tokens once
    )
    counts = [c.usage.completion_tokens for c in stream]
    assert counts == sorted(counts) and counts[-1] == 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_the_stop_string_that_ended_a_completion(openai_client, stream: bool) -> None:  # type: ignore[no-untyped-def]
    base = {"model": "demo", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 12}
    text = openai_client.completions.create(**base).choices[0].text
    stop = text[len(text) // 2 :][:2]
    choices = (
        [c for chunk in openai_client.completions.create(**base, stop=[stop], stream=True) for c in chunk.choices]
        if stream
        else openai_client.completions.create(**base, stop=[stop]).choices
    )
    last = choices[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)  # type: ignore[attr-defined]
    assert "".join(c.text for c in choices) == text[: text.index(stop)]
