"""The agents' APIs' pure translations, without a stack: Responses and Messages requests to chat
messages, chat deltas to each API's events and final object, and their validation's field names."""

from __future__ import annotations

import json
import time

import pytest
from marshmallow import ValidationError
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from app.anthropic_format import MessageEvents, anthropic_envelope, context_error, messages_error, tool_use_id
from app.anthropic_format import chat_body as messages_chat_body
from app.chat_deltas import Finished
from app.response_runs import turns as truncation_turns
from app.responses_format import ResponseEvents, chat_messages, response_object, responses_error
from app.responses_format import chat_body as responses_chat_body
from schemas.chat import MessageSchema
from schemas.errors import (
    ConstraintFailed,
    ContextLengthExceeded,
    GenerationFailed,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
)
from schemas.messages import MessagesSchema
from schemas.responses import ResponsesSchema


def responses_request(**body):  # type: ignore[no-untyped-def]
    return ResponsesSchema().load({"model": "demo", **body})


def call_delta(call_id: str, name: str, arguments: str = "") -> dict:
    return {
        "tool_calls": [
            {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ]
    }


def arguments_delta(text: str) -> dict:
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = responses_chat_body(responses_request(input="hi", instructions="Be brief."), [])
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert body["response_format"] == {"type": "text"} and "tools" not in body


def test_items_become_chat_messages_with_calls_joined_to_their_assistant_turn() -> None:
    items = responses_request(
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        ]
    ).items
    assert chat_messages(list(items)) == [
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
            "reasoning_content": "think",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_an_assistant_messages_phase_sent_back_is_kept_with_its_item_and_not_read_by_the_template() -> None:
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}], "phase": "commentary"}
    (item,) = responses_request(input=[said]).items
    assert item["phase"] == "commentary"
    assert chat_messages([item]) == [{"role": "assistant", "content": "Checking."}]


def test_a_forced_call_takes_no_text_format_and_a_named_choice_is_chats() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    fmt = {"format": {"type": "json_object"}}
    named = responses_chat_body(
        responses_request(input="x", tools=[tool], tool_choice={"type": "function", "name": "f"}, text=fmt), []
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}} and "response_format" not in named
    auto = responses_chat_body(responses_request(input="x", tools=[tool], text=fmt), [])
    assert auto["tool_choice"] == "auto" and auto["response_format"] == {"type": "json_object"}
    # strict unless the client says false, as OpenAI's Responses API defaults it (chat's default is false).
    assert auto["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    loose = responses_chat_body(responses_request(input="x", tools=[{**tool, "strict": False}]), [])
    assert loose["tools"][0]["function"]["strict"] is False


def test_chat_field_names_are_renamed_to_the_responses_fields() -> None:
    error = responses_error(
        InvalidRequest("max_completion_tokens: Must be at most 256 (maxIterTimes).", param="max_completion_tokens")
    )
    assert (error.param, error.message) == (
        "max_output_tokens",
        "max_output_tokens: Must be at most 256 (maxIterTimes).",
    )
    assert responses_error(InvalidRequest("x", param="max_tokens")).param == "max_output_tokens"  # the context's
    assert responses_error(InvalidRequest("x", param="tools[2].function.parameters")).param == "tools[2].parameters"
    assert (
        responses_error(InvalidRequest("x", param="response_format.json_schema.schema")).param == "text.format.schema"
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": "x", "tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"input": "x", "reasoning": {"summary": "concise"}}, "reasoning"),
        ({"input": "x", "reasoning": {"generate_summary": "short"}}, "reasoning"),
        ({"input": "x", "reasoning": {"summary": "none", "generate_summary": "auto"}}, "reasoning"),
        ({"input": "x", "truncation": "middle"}, "truncation"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "cache": 1}]}]}, "input"),
    ],
)
def test_what_responses_does_not_serve_is_refused_by_field(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        responses_request(**body)
    assert field in caught.value.messages


def test_a_response_echoes_the_sampling_it_runs_with_and_when_it_completed() -> None:
    """OpenAI's response echoes the temperature and top_p it samples with (the request's, else the
    model's generation_config.json defaults, else 1) and says when it completed (a completed response
    only: a response cut by max_output_tokens is incomplete)."""
    plain = response_object(responses_request(input="x"), "resp_1", 0)
    assert (plain["temperature"], plain["top_p"]) == (1.0, 1.0) and "completed_at" not in plain
    shipped = response_object(responses_request(input="x", top_p=0.5), "resp_2", 0, {"temperature": 0.6, "top_p": 0.9})
    assert (shipped["temperature"], shipped["top_p"]) == (0.6, 0.5)
    before = int(time.time())
    completed = ResponseEvents(response_object(responses_request(input="x"), "resp_3", before))
    (*_, event) = completed.start() + completed.delta({"content": "Hi."}) + completed.finish(Finished("stop", 3, 2))
    response = Response.model_validate(event["response"])
    assert response.status == "completed" and before <= response.completed_at <= time.time()
    cut = ResponseEvents(response_object(responses_request(input="x"), "resp_4", before))
    (*_, event) = cut.start() + cut.delta({"content": "Hi"}) + cut.finish(Finished("length", 3, 1))
    assert event["response"]["status"] == "incomplete" and "completed_at" not in event["response"]


def test_response_events_build_reasoning_text_and_a_call_in_order() -> None:
    request = responses_request(input="x")
    builder = ResponseEvents(response_object(request, "resp_1", 0))
    events = builder.start()
    for delta in (
        {"reasoning_content": "hm"},
        {"content": "He"},
        {"content": "llo"},
        call_delta("call_1", "f", '{"a"'),
        arguments_delta(": 1}"),
    ):
        events += builder.delta(delta)
    events += builder.finish(Finished("tool_calls", 3, 7))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning, message, call = events[-1]["response"]["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hm"}] and reasoning["type"] == "reasoning"
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert events[-1]["response"]["usage"]["total_tokens"] == 10
    assert events[0]["response"]["output"] == []  # a snapshot, not the response as it grew


@pytest.mark.parametrize("summary", ["auto", "detailed"])
def test_reasoning_summary_gives_the_reasoning_as_the_items_summary(summary: str) -> None:
    """OpenAI's reasoning summaries, asked for: the reasoning text is the item's summary_text (it is its
    own most detailed summary), streamed as summary events, and the item has no reasoning_text."""
    request = responses_request(input="x", reasoning={"effort": "low", "summary": summary})
    builder = ResponseEvents(response_object(request, "resp_1", 0))
    events = builder.start()
    for delta in ({"reasoning_content": "h"}, {"reasoning_content": "m"}, {"content": "Hi"}):
        events += builder.delta(delta)
    events += builder.finish(Finished("stop", 3, 3))
    assert [e["type"] for e in events[2:8]] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    stream_event = TypeAdapter(ResponseStreamEvent)
    for event in events:
        stream_event.validate_python(event)  # each as the openai SDK types it
    assert [e["summary_index"] for e in events[3:8]] == [0] * 5 and "status" not in events[7]
    assert events[6]["text"] == "hm" and events[7]["part"] == {"type": "summary_text", "text": "hm"}
    final = Response.model_validate(events[-1]["response"])
    reasoning, message = final.output
    assert reasoning.summary[0].text == "hm" and not reasoning.content and message.content[0].text == "Hi"
    assert final.reasoning is not None and (final.reasoning.effort, final.reasoning.summary) == ("low", summary)
    # Given back, the summary is the reasoning of the assistant turn after it.
    follow = responses_request(input=[*events[-1]["response"]["output"], {"role": "user", "content": "y"}])
    assert responses_chat_body(follow, [])["messages"][0] == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "hm",
    }


def test_a_summary_cut_short_ends_incomplete() -> None:
    request = responses_request(input="x", reasoning={"generate_summary": "auto"})
    builder = ResponseEvents(response_object(request, "resp_1", 0))
    builder.delta({"reasoning_content": "h"})
    events = builder.finish(Finished("length", 1, 1))
    done = next(e for e in events if e["type"] == "response.reasoning_summary_part.done")
    assert done["status"] == "incomplete" and done["part"]["text"] == "h"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    assert events[-1]["response"]["reasoning"]["summary"] == "auto"


def test_encrypted_reasoning_carries_the_reasoning_back_to_a_client_that_stores_nothing() -> None:
    """include's reasoning.encrypted_content: each reasoning item ends with its text sealed in it, and an
    item given back with only that (what a store: false client keeps) is the reasoning again."""
    for reasoning in ({}, {"summary": "auto"}):
        request = responses_request(
            input="x", include=["reasoning.encrypted_content"], reasoning=reasoning, store=False
        )
        builder = ResponseEvents(response_object(request, "resp_1", 0), request.encrypted_reasoning)
        builder.delta({"reasoning_content": "Think é"})
        events = builder.delta({"content": "Hi"})
        done = next(e for e in events if e["type"] == "response.output_item.done")
        sealed = done["item"]["encrypted_content"]
        assert isinstance(sealed, str) and "Think" not in sealed
        final = Response.model_validate(builder.finish(Finished("stop", 1, 2))[-1]["response"])
        assert final.output[0].encrypted_content == sealed  # type: ignore[union-attr]
        kept = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
        follow = responses_request(
            input=[kept, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "y"}]
        )
        assert responses_chat_body(follow, [])["messages"][0] == {
            "role": "assistant",
            "content": "Hi",
            "reasoning_content": "Think é",
        }
    plain = ResponseEvents(response_object(responses_request(input="x"), "resp_2", 0))
    plain.delta({"reasoning_content": "h"})
    assert "encrypted_content" not in plain.finish(Finished("stop", 1, 1))[-1]["response"]["output"][0]
    for foreign in ("gAAAAABo", "tokenline-reasoning-v1:%%%", "tokenline-reasoning-v1://8="):
        with pytest.raises(ValidationError) as caught:
            responses_request(input=[{"type": "reasoning", "summary": [], "encrypted_content": foreign}])
        assert "encrypted_content" in str(caught.value.messages)


def test_no_summary_is_reasoning_text() -> None:
    for reasoning in ({"summary": "none"}, {"summary": None}, {}):
        builder = ResponseEvents(response_object(responses_request(input="x", reasoning=reasoning), "r", 0))
        builder.delta({"reasoning_content": "h"})
        item = builder.finish(Finished("stop", 1, 1))[-1]["response"]["output"][0]
        assert item["content"] == [{"type": "reasoning_text", "text": "h"}] and item["summary"] == []


def test_a_response_cut_by_max_output_tokens_is_incomplete_and_a_failure_is_failed() -> None:
    builder = ResponseEvents(response_object(responses_request(input="x"), "resp_1", 0))
    builder.delta({"content": "a"})
    last = builder.finish(Finished("length", 1, 1))[-1]
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert last["response"]["output"][0]["status"] == "incomplete"
    Response.model_validate(last["response"])  # what the openai SDK's type requires, usage included
    for error, code in (
        (GenerationFailed("boom"), "server_error"),
        (RequestTimeout("late"), "server_error"),
        (ConstraintFailed("no token fits", param="text.format.schema"), "invalid_prompt"),
        (Overloaded("busy"), "rate_limit_exceeded"),
    ):
        failing = ResponseEvents(response_object(responses_request(input="x"), "resp_2", 0))
        failed = failing.fail(error)[-1]
        assert failed["type"] == "response.failed"
        assert failed["response"]["error"] == {"code": code, "message": error.message}
        Response.model_validate(failed["response"])  # the SDK's codes are a Literal


def messages_request(**body):  # type: ignore[no-untyped-def]
    return MessagesSchema().load({"model": "demo", "max_tokens": 8, **body})


def test_messages_become_chat_messages_with_tool_results_first() -> None:
    request = messages_request(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "bad", "is_error": True},
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
        stop_sequences=["END"],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        thinking={"type": "disabled"},
    )
    body = messages_chat_body(request)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            "reasoning_content": "hm",
        },
        {"role": "tool", "tool_call_id": "1", "content": "Error: bad"},
        {"role": "user", "content": "and?"},
    ]
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"]) == ("required", False, ["END"])
    assert "include_stop_str_in_output" not in body  # the worker names the stop that ended it (stop_reason)
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["max_completion_tokens"] == 8


@pytest.mark.parametrize("chat_id", ["ZlAJHYrqh", "call_8f2a", "functions.get_weather:0"])
def test_a_tool_use_id_sent_back_is_the_call_id_the_model_wrote(chat_id: str) -> None:
    """Mistral's templates take only the 9-character ids its models write, Kimi's its own: the chat
    message of a tool_use (and of its result) carries the id the tool_use was made from."""
    issued = tool_use_id(chat_id)
    assert issued.startswith("toolu_")
    request = messages_request(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": issued, "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": issued, "content": "18 C"}]},
        ]
    )
    assistant, result = messages_chat_body(request)["messages"][1:]
    assert assistant["tool_calls"][0]["id"] == result["tool_call_id"] == chat_id


@pytest.mark.parametrize(
    "extra", [{"caller": None, "toolset_name": None}, {"caller": {"type": "direct"}}], ids=["model_dump", "direct"]
)
def test_a_tool_use_block_as_the_anthropic_sdk_dumps_it_is_taken(extra: dict) -> None:
    """The SDK's ToolUseBlock.model_dump() keeps `caller` and `toolset_name` as null: a history kept as
    dicts is sent back with them."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}, **extra}
    request = messages_request(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]},
        ]
    )
    (tool_call,) = messages_chat_body(request)["messages"][1]["tool_calls"]
    assert tool_call == {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}
    for refused, value in (("caller", {"type": "code_execution_20250825"}), ("toolset_name", "github")):
        turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{**call, refused: value}]}, result]
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=turns)
        assert caught.value.messages["messages"][1]["content"][0].keys() == {refused}


def test_a_tool_result_must_answer_a_tool_use_of_the_assistant_turn_before_it() -> None:
    """As Anthropic requires; consecutive assistant messages are one turn."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}
    split = [{"role": "assistant", "content": "Let me look."}, {"role": "assistant", "content": [use]}]
    assert messages_request(messages=[{"role": "user", "content": "x"}, *split, result]).messages
    for turns in (
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "no call"}, result],
        [result],
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [use]},
            result,
            {"role": "assistant", "content": "ok"},
            result,
        ],
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=turns)
        (index,) = caught.value.messages["messages"]
        assert caught.value.messages["messages"][index] == {
            "content": {0: {"tool_use_id": ["No tool_use block with id 'toolu_1' in the assistant turn before it."]}}
        }


def test_each_tool_use_has_its_tool_result_in_the_next_turn() -> None:
    """As Anthropic requires: a call sent back without its result would be answered as though its tool
    had returned nothing. The results may come in any order, over consecutive user messages."""
    uses = [{"type": "tool_use", "id": f"toolu_{n}", "name": "f", "input": {}} for n in (1, 2)]
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": "18 C"} for n in (2, 1)]
    ask = {"role": "user", "content": "x"}
    split = [
        {"role": "user", "content": results[:1]},
        {"role": "user", "content": [*results[1:], {"type": "text", "text": "and?"}]},
    ]
    assert messages_request(messages=[ask, {"role": "assistant", "content": uses}, *split]).messages
    unanswered = (
        "tool_use ids were found without tool_result blocks immediately after: {}. "
        "Each tool_use block must have a corresponding tool_result block in the next message."
    )
    for turns, index, missing in (
        ([ask, {"role": "assistant", "content": uses}, {"role": "user", "content": results[:1]}], 1, "toolu_1"),
        ([ask, {"role": "assistant", "content": uses}, ask], 1, "toolu_1, toolu_2"),
        (
            [ask, {"role": "assistant", "content": "I will."}, {"role": "assistant", "content": uses[:1]}, ask],
            2,
            "toolu_1",
        ),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=turns)
        assert caught.value.messages["messages"] == {index: {"content": [unanswered.format(missing)]}}


def test_tool_use_ids_are_unique_and_each_is_answered_once() -> None:
    """The chat template pairs a call and its result by id: two calls of one id, or two results for
    one call, leave the model a conversation it cannot read (Anthropic refuses both)."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}
    answered = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    cases = {
        "id": [answered[0], {"role": "assistant", "content": [use, {**use, "input": {"a": 1}}]}, answered[2]],
        "later": [*answered, {"role": "assistant", "content": [use]}, answered[2]],
        "tool_use_id": [*answered, {"role": "user", "content": [result]}],
    }
    expected = {
        "id": (1, 1, "id", "tool_use ids must be unique: 'toolu_1' is used before."),
        "later": (3, 0, "id", "tool_use ids must be unique: 'toolu_1' is used before."),
        "tool_use_id": (3, 0, "tool_use_id", "The tool_use block with id 'toolu_1' has a tool_result already."),
    }
    for name, turns in cases.items():
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=turns)
        i, j, key, error = expected[name]
        assert caught.value.messages["messages"] == {i: {"content": {j: {key: [error]}}}}, name


def test_an_assistant_turn_of_thinking_alone_is_reasoning_without_content() -> None:
    """A reply cut by max_tokens while it reasoned is one thinking block; sent back as it came, it is
    an assistant message with reasoning and no content, which the chat request takes."""
    request = messages_request(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Let me", "signature": ""}]},
            {"role": "user", "content": "well?"},
        ]
    )
    body = messages_chat_body(request)
    assert body["messages"][1] == {"role": "assistant", "content": None, "reasoning_content": "Let me"}
    assert MessageSchema().load(body["messages"][1]).reasoning_content == "Let me"


def test_consecutive_turns_of_one_role_are_one_turn_as_anthropic_combines_them() -> None:
    request = messages_request(
        messages=[
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]},
            {"role": "user", "content": "three"},
        ]
    )
    assert messages_chat_body(request)["messages"] == [
        {"role": "user", "content": "one\ntwo"},
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "x", "content": "r"},
        {"role": "user", "content": "three"},
    ]


def test_message_events_build_thinking_text_and_tool_use_blocks() -> None:
    builder = MessageEvents("msg_1", "demo", 5)
    events = builder.start()
    for delta in (
        {"reasoning_content": "hm"},
        {"content": "ok"},
        call_delta("call_ab", "f", '{"a": '),
        arguments_delta("1}"),
    ):
        events += builder.delta(delta)
    events += builder.finish(Finished("tool_calls", 5, 9))
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta",
        "text_delta",
        "input_json_delta",
        "input_json_delta",
    ]
    assert builder.message["content"] == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": tool_use_id("call_ab"), "name": "f", "input": {"a": 1}},
    ]
    ending = {"input_tokens": 5, "output_tokens": 9, "cache_read_input_tokens": 0}
    assert builder.message["stop_reason"] == "tool_use" and events[-2]["usage"] == ending
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] == 5


def test_a_tool_use_cut_short_has_empty_input_and_stops_on_max_tokens() -> None:
    builder = MessageEvents("msg_1", "demo", 5)
    builder.delta(call_delta("call_1", "f", '{"a": '))
    builder.finish(Finished("length", 5, 8))
    assert builder.message["content"][0]["input"] == {} and builder.message["stop_reason"] == "max_tokens"


def test_chat_field_names_are_renamed_to_the_messages_fields() -> None:
    assert messages_error(InvalidRequest("x", param="max_completion_tokens")).param == "max_tokens"
    assert messages_error(InvalidRequest("x", param="tools[0].function.parameters")).param == "tools[0].input_schema"
    assert (
        messages_error(InvalidRequest("messages[3].content: bad", param="messages[3].content")).message
        == "messages: bad"
    )
    # Words that name the field already do not get it twice.
    unknown = InvalidRequest("Unrecognized request argument supplied: min_tokens", param="min_tokens")
    assert messages_error(unknown).message == "Unrecognized request argument supplied: min_tokens"
    empty = InvalidRequest("stop[0]: Shorter than minimum length 1.", param="stop[0]")  # a field ending in "]"
    assert messages_error(empty).message == "stop_sequences[0]: Shorter than minimum length 1."
    assert anthropic_envelope(400, "stop_sequences[0]: Too short.", param="stop_sequences[0]")["error"]["message"] == (
        "stop_sequences[0]: Too short."
    )
    # A chat template's own words get the field in front.
    assert messages_error(InvalidRequest("System role not supported", param="messages")).message == (
        "messages: System role not supported"
    )
    assert messages_error(InvalidRequest("too long", param="max_completion_tokens")).message == "max_tokens: too long"


def test_a_final_assistant_message_is_a_prefill_the_answer_continues() -> None:
    """As Anthropic takes it: the chat request continues its text, which ends without whitespace and
    calls no tool (nothing would answer the call)."""
    hi = {"role": "user", "content": "hi"}
    body = messages_chat_body(messages_request(messages=[hi, {"role": "assistant", "content": "Hello,"}]))
    assert body["continue_final_message"] is True and body["messages"][-1] == {"role": "assistant", "content": "Hello,"}
    assert "continue_final_message" not in messages_chat_body(messages_request(messages=[hi]))
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    for content, where in (
        ("Hello, ", {1: {"content": {0: {"text": ["final assistant content cannot end with trailing whitespace"]}}}}),
        ([call, {"type": "text", "text": "x"}], {1: {"content": {0: {"type": [NO_RESULT]}}}}),
        ([{"type": "thinking", "thinking": "hm", "signature": ""}], {1: {"content": [ENDS_WITH_TEXT]}}),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=[hi, {"role": "assistant", "content": content}])
        assert caught.value.messages == {"messages": where}


NO_RESULT = "A final assistant turn (a prefill) is continued as text: its tool_use has no tool_result."
ENDS_WITH_TEXT = "A final assistant turn (a prefill) must end with text."


def test_server_tools_are_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        messages_request(messages=[{"role": "user", "content": "x"}], tools=[{"type": "bash_20250124", "name": "bash"}])
    assert "server tools (bash_20250124)" in json.dumps(caught.value.messages)


def test_the_stop_sequence_the_worker_names_ends_the_message_and_text_is_sent_as_it_comes() -> None:
    builder = MessageEvents("msg_1", "demo", 5, stops=("END", "X"))
    events = builder.start()
    for piece in ("Hello", " E"):  # the worker's text stops before the stop sequence; nothing is held
        sent = builder.delta({"content": piece})
        assert sent[-1]["delta"] == {"type": "text_delta", "text": piece}
        events += sent
    events += builder.finish(Finished("stop", 5, 3, stop_reason="END"))
    sent_text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert sent_text == builder.message["content"][0]["text"] == "Hello E"
    assert (builder.message["stop_reason"], builder.message["stop_sequence"]) == ("stop_sequence", "END")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_a_message_that_ends_otherwise_names_no_stop_sequence() -> None:
    for finished, reason in ((Finished("length", 5, 3), "max_tokens"), (Finished("stop", 5, 3), "end_turn")):
        builder = MessageEvents("msg_1", "demo", 5, stops=("END",))
        builder.delta({"content": "Hello EN"})
        builder.finish(finished)
        assert builder.message["content"][0]["text"] == "Hello EN"
        assert (builder.message["stop_reason"], builder.message["stop_sequence"]) == (reason, None)


def test_a_cancelled_response_keeps_its_output_so_far_with_its_items_closed() -> None:
    builder = ResponseEvents(response_object(responses_request(input="x", background=True), "resp_1", 0))
    builder.delta({"content": "Hel"})
    events = builder.cancel()
    assert [e["type"] for e in events][-1] == "response.output_item.done"
    assert builder.response["status"] == "cancelled" and builder.response["background"] is True
    (message,) = builder.response["output"]
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "Hel")


def test_a_background_response_must_be_stored_and_not_streamed() -> None:
    for body in ({"store": False}, {"stream": True}):
        with pytest.raises(ValidationError) as caught:
            responses_request(input="x", background=True, **body)
        assert "background" in caught.value.messages


def test_tool_input_schemas_and_parameters_describe_an_object() -> None:
    with pytest.raises(ValidationError) as caught:
        messages_request(
            messages=[{"role": "user", "content": "x"}], tools=[{"name": "f", "input_schema": {"type": "string"}}]
        )
    assert "input_schema" in caught.value.messages["tools"][0]
    with pytest.raises(ValidationError) as caught:
        responses_request(input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}])
    assert "parameters" in caught.value.messages["tools"][0]
    assert messages_request(
        messages=[{"role": "user", "content": "x"}], tools=[{"name": "f", "input_schema": {"type": "object"}}]
    )


def test_output_config_becomes_the_chat_response_format_and_reasoning_effort() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    ask = [{"role": "user", "content": "x"}]
    body = messages_chat_body(
        messages_request(
            messages=ask, output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
        )
    )
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert body["reasoning_effort"] == "low"
    tool = {"name": "f", "input_schema": {"type": "object"}}
    forced = messages_request(
        messages=ask,
        tools=[tool],
        tool_choice={"type": "any"},
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert "response_format" not in messages_chat_body(forced)  # a forced call writes no text to shape


def test_what_already_happens_is_taken_automatic_caching_and_the_standard_speed() -> None:
    ask = [{"role": "user", "content": "x"}]
    assert messages_request(messages=ask, cache_control={"type": "ephemeral"}, speed="standard").messages
    marked = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        }
    ]
    assert messages_request(messages=marked).messages
    with pytest.raises(ValidationError) as caught:
        messages_request(messages=ask, speed="fast")
    assert caught.value.messages == {"speed": ["Must be 'standard': tokenline has no fast mode."]}
    with pytest.raises(ValidationError) as caught:
        messages_request(messages=ask, speed=3)
    assert caught.value.messages == {"speed": ["Not a valid string."]}
    for marker in ({"type": "bogus"}, {"type": "ephemeral", "ttl": "2h"}, {"type": "ephemeral", "extra": 1}):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=ask, cache_control=marker)
        assert "cache_control" in caught.value.messages


def test_a_function_tools_fields_that_ask_for_what_happens_anyway_are_taken_and_the_others_refused() -> None:
    """The openai SDK's function tool: a synchronous call made directly by the model is what happens;
    an asynchronous or programmatic one, or an output schema, is refused by name."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}
    taken = {"async": False, "allowed_callers": ["direct"], "output_schema": None}
    (loaded,) = responses_request(input="hi", tools=[{**tool, **taken}]).tools
    assert loaded["async"] is False and loaded["allowed_callers"] == ["direct"]
    for field, value, what in (
        ("async", True, "asynchronous function calls"),
        ("allowed_callers", ["programmatic"], "programmatic tool calls"),
        ("output_schema", {"type": "string"}, "output schemas of functions"),
    ):
        with pytest.raises(ValidationError) as caught:
            responses_request(input="hi", tools=[{**tool, field: value}])
        assert caught.value.messages == {"tools": {0: {field: [f"tokenline does not support {what}."]}}}


def test_anthropics_request_fields_tokenline_lacks_are_refused_but_for_null() -> None:
    hi = [{"role": "user", "content": "hi"}]
    for field, value, what in (
        ("diagnostics", {"previous_message_id": "msg_1"}, "request diagnostics"),
        ("user_profile_id", "p", "user profiles"),
        ("workspace_id", "w", "workspaces"),
    ):
        assert messages_request(messages=hi, **{field: None}).max_tokens == 8
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=hi, **{field: value})
        assert caught.value.messages == {field: [f"tokenline does not support {what}."]}


def test_a_thinking_budget_is_chats_thinking_token_budget_within_anthropics_bounds() -> None:
    """Anthropic's thinking.budget_tokens (≥ 1024, below max_tokens, with type enabled) is vLLM's
    thinking_token_budget on the chat path; out of its bounds it is a 400 naming it."""
    enabled = {"type": "enabled", "budget_tokens": 1024}
    hi = [{"role": "user", "content": "hi"}]
    body = messages_chat_body(messages_request(messages=hi, max_tokens=2048, thinking=enabled))
    assert body["thinking_token_budget"] == 1024 and body["chat_template_kwargs"] == {"enable_thinking": True}
    for thinking, max_tokens, param in (
        ({"type": "enabled", "budget_tokens": 1023}, 2048, "thinking"),
        ({"type": "enabled", "budget_tokens": 2048}, 2048, "thinking.budget_tokens"),
        ({"type": "adaptive", "budget_tokens": 1024}, 2048, "thinking"),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=hi, max_tokens=max_tokens, thinking=thinking)
        assert param in caught.value.messages


def test_truncation_keeps_the_head_and_cuts_only_where_a_turn_starts() -> None:
    """What truncation "auto" may leave out: everything up to the first user message stays; the rest
    may start at a user message, or at the assistant's reasoning, message or call that answers a user
    message or a call's output, never between a call and its output."""
    system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u"}]}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    think = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c", "output": "o"}
    conversation = [system, user, think, call, output, call, output, said, user, said]
    # 2 (the reasoning) would leave nothing out; 3 and 4 would part a turn (its reasoning, a call's output).
    assert truncation_turns(conversation) == (2, [5, 7, 8, 9])
    assert truncation_turns([call, output]) == (0, [])  # no user message, and no turn starts after one


def test_the_tool_fields_anthropics_sdks_send_are_honoured() -> None:
    """What @ai-sdk/anthropic and Anthropic's SDKs send with a tool: a null type is a custom tool;
    eager_input_streaming says how its input streams (MessageEvents); input examples, each valid by
    the tool's schema, follow its description; deferred loading and programmatic callers are refused."""
    hi = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "f", "description": "The weather.", "input_schema": schema}
    taken = {
        "type": None,
        "eager_input_streaming": True,
        "input_examples": [{"city": "Paris"}, {"city": "Zürich"}],
        "defer_loading": False,
        "allowed_callers": ["direct"],
    }
    body = messages_chat_body(messages_request(messages=hi, tools=[{**tool, **taken}]))
    assert body["tools"][0]["function"]["description"] == (
        'The weather.\n\nExamples of input:\n{"city": "Paris"}\n{"city": "Zürich"}'
    )
    bare = messages_chat_body(messages_request(messages=hi, tools=[{"name": "f", "input_schema": schema}]))
    assert "description" not in bare["tools"][0]["function"]
    examples_only = {"name": "f", "input_schema": schema, "input_examples": [{"city": "Oslo"}]}
    body = messages_chat_body(messages_request(messages=hi, tools=[examples_only]))
    assert body["tools"][0]["function"]["description"] == 'Examples of input:\n{"city": "Oslo"}'
    for field, value, message in (
        (
            "input_examples",
            [{"city": "Paris"}, {"town": "Paris"}],
            {1: ["Not valid by the tool's input_schema: 'city' is a required property."]},
        ),
        ("eager_input_streaming", "yes", ["Not a valid boolean."]),
        ("defer_loading", True, ["tokenline does not support deferred tool loading."]),
        ("allowed_callers", ["code_execution_20250825"], ["tokenline does not support programmatic tool calls."]),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=hi, tools=[{**tool, field: value}])
        assert caught.value.messages == {"tools": {0: {field: message}}}


def test_a_tool_whose_input_is_not_streamed_eagerly_sends_it_in_one_delta_at_its_end() -> None:
    """eager_input_streaming false: the block's input goes in one input_json_delta before its stop;
    other tools' input streams as the model writes it."""
    builder = MessageEvents("msg_1", "demo", 5, buffered=frozenset({"slow"}))
    events = builder.start()
    events += builder.delta(call_delta("call_1", "slow", '{"a": '))
    events += builder.delta(arguments_delta("1}"))
    events += builder.delta(call_delta("call_2", "fast", '{"b": '))
    events += builder.delta(arguments_delta("2}"))
    events += builder.finish(Finished("tool_calls", 5, 8))
    deltas = [(e["index"], e["delta"]["partial_json"]) for e in events if e["type"] == "content_block_delta"]
    assert deltas == [(0, '{"a": 1}'), (1, '{"b": '), (1, "2}")]
    kinds = [e["type"] for e in events if e.get("index") == 0]
    assert kinds == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert [block["input"] for block in builder.message["content"]] == [{"a": 1}, {"b": 2}]


def test_a_request_too_long_for_the_context_is_worded_as_anthropic_words_it() -> None:
    """What Claude Code parses: `P + M > L` (it retries with the max_tokens that fits) and "prompt is
    too long" (it compacts the conversation)."""
    too_many = ContextLengthExceeded("x", param="max_completion_tokens", counts=(41315, 32000, 65536))
    error = messages_error(context_error(too_many, too_many.counts))
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert error.message == (
        "input length and `max_tokens` exceed context limit: 41315 + 32000 > 65536, "
        "decrease input length or `max_tokens` and try again"
    )
    too_long = ContextLengthExceeded("x", param="messages", counts=(70000, None, 65535))
    error = messages_error(context_error(too_long, too_long.counts))
    assert error.message == "messages: prompt is too long: 70000 tokens > 65535 maximum"


def test_a_system_message_among_the_turns_is_a_system_message_there() -> None:
    """Claude Code's (anthropic-beta mid-conversation-system): its text is a system message where it
    stands; one cleared at the next user message is left out once a user message follows it."""
    hi, again = {"role": "user", "content": "hi"}, {"role": "user", "content": "again"}
    note = {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]}
    body = messages_chat_body(messages_request(messages=[hi, note, again]))
    assert body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Agents: none."},
        {"role": "user", "content": "again"},
    ]
    fleeting = {**note, "clear_at": "next_user_message"}
    assert messages_chat_body(messages_request(messages=[hi, fleeting]))["messages"][-1]["role"] == "system"
    body = messages_chat_body(messages_request(messages=[hi, fleeting, again]))
    assert [m["content"] for m in body["messages"]] == ["hi\nagain"]  # the user turns, one turn again
    for message, where in (
        ({"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, "content"),
        ({**hi, "clear_at": "never"}, "clear_at"),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=[hi, message])
        assert list(caught.value.messages["messages"][1]) == [where]


def test_context_management_that_clears_nothing_is_taken_and_any_other_edit_refused() -> None:
    """Claude Code sends clear_thinking with keep "all" whenever thinking is on: nothing is cleared,
    which is what happens."""
    hi = [{"role": "user", "content": "hi"}]
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert messages_request(messages=hi, context_management=keep_all).max_tokens == 8
    assert messages_request(messages=hi, context_management=None).max_tokens == 8
    for edit, field in (
        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}, "keep"),
        ({"type": "clear_thinking_20251015"}, "keep"),
        ({"type": "clear_tool_uses_20250919", "keep": "all"}, "type"),
    ):
        with pytest.raises(ValidationError) as caught:
            messages_request(messages=hi, context_management={"edits": [edit]})
        assert list(caught.value.messages["context_management"]["edits"][0]) == [field]
