"""Anthropic's Messages API through the official `anthropic` SDK, gunicorn, Redis and a real worker on
the demo model (random weights: calls are forced with tool_choice, answers are bounded, shapes are
asserted, not texts): plain and streamed messages, a tool use round trip with tool_result, a forced
tool, count_tokens, and hostile input answered in Anthropic's error envelope."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import anthropic
import pydantic
import pytest
import requests
from anthropic import Anthropic

pytestmark = pytest.mark.e2e

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCED = {"type": "tool", "name": "get_weather"}
SEED = {"seed": 1}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(stack) -> Anthropic:  # type: ignore[no-untyped-def]
    return Anthropic(base_url=stack.base_url, api_key="key-one", max_retries=0, timeout=60)


def test_a_plain_message_has_a_text_block_stop_reason_and_usage(claude: Anthropic) -> None:
    message = claude.messages.create(
        model="demo", max_tokens=4, system="Be brief.", messages=[{"role": "user", "content": "Hi"}], extra_body=SEED
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 4 and message.usage.input_tokens > 0
    assert message._request_id == message.id  # the `request-id` header, as Anthropic sends it


def test_a_streamed_message_sends_anthropics_events_in_order(claude: Anthropic) -> None:
    with claude.messages.stream(
        model="demo", max_tokens=4, messages=[{"role": "user", "content": "Hi"}], extra_body=SEED
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]  # "text" is the SDK's own convenience event
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_message_and_is_named(claude: Anthropic, stream: bool) -> None:
    ask = {"model": "demo", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}], "extra_body": SEED}
    text = claude.messages.create(**ask).content[0].text  # the same seed writes the same text
    stop = text.strip()[len(text.strip()) // 2 :][:2]
    if stream:
        with claude.messages.stream(**ask, stop_sequences=[stop]) as answer:
            sent = "".join(answer.text_stream)
            message = answer.get_final_message()
        assert sent == message.content[0].text
    else:
        message = claude.messages.create(**ask, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_that_takes_the_whole_text_leaves_no_content_block(claude: Anthropic, stream: bool) -> None:
    ask = {"model": "demo", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}], "extra_body": SEED}
    stop = claude.messages.create(**ask).content[0].text[:2]
    if stream:
        with claude.messages.stream(**ask, stop_sequences=[stop]) as answer:
            events = list(answer)
            message = answer.get_final_message()
        assert not [e for e in events if e.type.startswith("content_block")]
    else:
        message = claude.messages.create(**ask, stop_sequences=[stop])
    assert message.content == [] and (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_is_not_cut_by_a_stop_sequence(claude: Anthropic) -> None:
    # Every call of this tool writes `"city"`: a stop sequence ends text, not a forced call.
    message = claude.messages.create(
        model="demo",
        max_tokens=100,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=FORCED,
        stop_sequences=['"city"'],
        extra_body=SEED,
    )
    (use,) = message.content
    assert set(use.input) == {"city"} and (message.stop_reason, message.stop_sequence) == ("tool_use", None)


def test_a_forced_tool_gives_a_tool_use_block(claude: Anthropic) -> None:
    message = claude.messages.create(
        model="demo", max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=FORCED, extra_body=SEED
    )
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and isinstance(use.input["city"], str)


def test_a_tool_use_round_trip_continues_with_the_tool_result(claude: Anthropic) -> None:
    first = claude.messages.create(
        model="demo", max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=SEED
    )
    (use,) = [block for block in first.content if block.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 C, sunny"}]}
    history = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = claude.messages.create(model="demo", max_tokens=4, messages=history, tools=[WEATHER], extra_body=SEED)
    assert second.stop_reason in ("max_tokens", "tool_use", "end_turn")
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("content", [None, "", []])
def test_an_empty_tool_result_continues_the_conversation(claude: Anthropic, content: object) -> None:
    # A tool run for its effect returns nothing; Anthropic's content is optional.
    result = {"type": "tool_result", "tool_use_id": "toolu_1", **({} if content is None else {"content": content})}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    history = [*ASK, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    message = claude.messages.create(model="demo", max_tokens=2, messages=history, tools=[WEATHER], extra_body=SEED)
    assert message.usage.output_tokens == 2


def test_a_streamed_forced_tool_streams_its_input_as_json_deltas(claude: Anthropic) -> None:
    with claude.messages.stream(
        model="demo", max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=FORCED, extra_body=SEED
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input and final.stop_reason == "tool_use"


def test_a_tool_as_the_ai_sdk_streams_it_sends_its_input_in_one_delta_when_not_eager(claude: Anthropic) -> None:
    """@ai-sdk/anthropic streams every tool with eager_input_streaming set (and its input_examples):
    true streams the input as it is written, false sends it whole in one delta before the block's stop."""
    examples = {"input_examples": [{"city": "Paris"}]}
    for eager in (True, False):
        tool = {**WEATHER, **examples, "eager_input_streaming": eager}
        with claude.messages.stream(
            model="demo", max_tokens=100, messages=ASK, tools=[tool], tool_choice=FORCED, extra_body=SEED
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert json.loads("".join(deltas)) == final.content[0].input and final.stop_reason == "tool_use"
        assert len(deltas) > 1 if eager else len(deltas) == 1, deltas


def test_the_sdks_tool_runner_goes_on_without_a_thread(claude: Anthropic) -> None:
    """The anthropic SDK's tool runner asks the server to keep the conversation (`thread`); tokenline
    refuses as Anthropic refuses a request it cannot thread, so the runner sends the conversation whole,
    and its loop runs: the forced call's tool runs, its result goes back, the model answers."""
    ran = []

    @anthropic.beta_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return "Sunny."

    runner = claude.beta.messages.tool_runner(
        model="demo",
        max_tokens=40,
        messages=ASK,
        tools=[get_weather],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_iterations=2,
        extra_body=SEED,
    )
    replies = list(runner)
    assert len(ran) == 2 and [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="demo", max_tokens=4, messages=ASK, extra_body={"thread": {"type": "create"}})
    assert caught.value.body["error"]["details"] == {"error_code": "thread_unsupported_request", "unsupported": []}


def test_a_system_message_among_the_turns_is_rendered_there(claude: Anthropic) -> None:
    """What Claude Code sends after its first user message (a system message of the agents it can
    start): served, its text in the prompt."""
    note = {"role": "system", "content": "Available agent types: none."}
    turns = [{"role": "user", "content": "hi"}, note, *ASK]
    message = claude.beta.messages.create(model="demo", max_tokens=2, messages=turns, extra_body=SEED)  # type: ignore[list-item]
    plain = claude.messages.create(model="demo", max_tokens=2, messages=[turns[0], *ASK], extra_body=SEED)
    assert message.stop_reason == "max_tokens" and message.usage.input_tokens > plain.usage.input_tokens


def test_a_prompt_too_long_for_the_context_is_refused_in_anthropics_words(claude: Anthropic) -> None:
    """The words Claude Code reads to compact its conversation ("prompt is too long: P tokens > L");
    app/anthropic_format.py's context_error words a max_tokens that does not fit (tests/test_agents_formats.py)."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "word " * 5000}])
    message = caught.value.body["error"]["message"]
    assert re.fullmatch(r"messages: prompt is too long: (\d+) tokens > 2047 maximum", message), message


class Verdict(pydantic.BaseModel):
    ok: bool


def test_structured_output_is_json_of_the_schema_and_the_sdk_parses_it(claude: Anthropic) -> None:
    """output_config.format (what `messages.parse` sends): the reply's text is JSON of the schema,
    whatever the (random) weights prefer; streamed alike."""
    parsed = claude.messages.parse(model="demo", max_tokens=64, messages=ASK, output_format=Verdict, extra_body=SEED)
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Verdict)
    (block,) = parsed.content
    assert Verdict.model_validate_json(block.text) == parsed.parsed_output
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with claude.messages.stream(
        model="demo", max_tokens=64, messages=ASK, output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=SEED,
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert set(json.loads(final.content[0].text)) == {"n"}


def test_count_tokens_counts_the_prompt_a_message_would_have(claude: Anthropic) -> None:
    counted = claude.messages.count_tokens(model="demo", messages=ASK, tools=[WEATHER])
    message = claude.messages.create(model="demo", max_tokens=1, messages=ASK, tools=[WEATHER], extra_body=SEED)
    # Anthropic's input_tokens leave out the tokens read from the (prefix) cache.
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0


def test_a_thinking_budget_on_a_model_that_does_not_reason_is_met(claude: Anthropic) -> None:
    """Anthropic's thinking `enabled` needs a budget (Claude Code sends 31,999 by default): on a model
    that does not reason, the ceiling is met by no reasoning at all. (count_tokens reads the request as
    a create does; this stack's maxIterTimes leaves no max_tokens above the least budget, 1,024.)"""
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}  # the demo model does not reason
    counted = claude.messages.count_tokens(model="demo", messages=ASK, thinking=thinking).input_tokens
    assert counted == claude.messages.count_tokens(model="demo", messages=ASK).input_tokens


def test_x_api_key_and_bearer_are_both_accepted(stack) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "demo", "max_tokens": 1, "messages": ASK}
    for headers in ({"x-api-key": "k", "anthropic-version": "2023-06-01"}, {"Authorization": "Bearer k"}):
        assert requests.post(f"{stack.base_url}/v1/messages", json=body, headers=headers, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"model": "demo", "messages": ASK}, "max_tokens"),
        ({"model": "demo", "max_tokens": "4", "messages": ASK}, "max_tokens"),
        ({"model": "demo", "max_tokens": 4, "messages": "hi"}, "messages"),
        (
            {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages",
        ),
        (
            {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
            "messages",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 4,
                "messages": ASK,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "tools",
        ),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "tools": [{"name": "bad name!", "input_schema": {}}]},
            "tools",
        ),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice",
        ),
        ({"model": "demo", "max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
        ({"model": "demo", "max_tokens": 100000, "messages": ASK}, "max_tokens"),
        ({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 600_000}]}, "messages"),
        ({"model": "demo", "max_tokens": 4, "messages": ASK, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "output_config": {"effort": "max"}},
            "output_config.effort",
        ),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "json_schema"}}},
            "output_config.format.schema",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 4,
                "messages": ASK,
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}},
            },
            "output_config.format",
        ),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "system": [{"type": "text", "text": "x", "foo": 1}]},
            "system[0].foo",
        ),
        ({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        (
            {"model": "demo", "max_tokens": 4, "messages": ASK, "tools": [{**WEATHER, "input_examples": [{}]}]},
            "tools[0].input_examples[0]",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}],
            },
            "messages[0].content[0].text",
        ),
    ],
)
def test_hostile_input_is_a_400_in_anthropics_envelope(stack, body: dict, where: str) -> None:  # type: ignore[no-untyped-def]
    answer = requests.post(f"{stack.base_url}/v1/messages", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    message = error["error"]["message"]
    assert message.startswith(where) or message == f"Unrecognized request argument supplied: {where}", error
    assert error["request_id"].startswith("req_") and answer.headers["request-id"] == error["request_id"]


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("GET", "/v1/messages/count_tokens", 405, "invalid_request_error"),
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
    ],
)
def test_a_path_or_method_no_route_takes_answers_in_anthropics_envelope(  # type: ignore[no-untyped-def]
    stack, method: str, path: str, status: int, kind: str
) -> None:
    answer = requests.request(method, stack.base_url + path, json={}, timeout=30)
    assert answer.status_code == status
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["request_id"].startswith("req_")


def test_the_sdk_raises_its_own_errors_from_the_envelope(claude: Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="demo", max_tokens=4, messages=[*ASK, {"role": "assistant", "content": "so "}])
