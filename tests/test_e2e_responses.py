"""OpenAI's Responses API through the official SDK, gunicorn, Redis and a real worker on the demo model
(random weights: calls are forced with tool_choice, answers are bounded, shapes are asserted, not
texts): plain and streamed responses, a function tool round trip, `responses.parse`, stored
responses continued from another API process, scoped to their API key, deleted, and hostile input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import requests
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from app.responses_format import chat_messages
from schemas.keys import admitted_key
from scripts import localstack

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}
SEED = {"seed": 1}
AUTH = {"Authorization": "Bearer key-one"}  # the SDK client's key: stored responses are scoped to it


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def client(base_url: str, key: str = "key-one") -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def responses_client(stack) -> OpenAI:  # type: ignore[no-untyped-def]
    return client(stack.base_url)


@pytest.fixture(scope="module")
def second_api(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another API process on the same Redis (as a second replica would be)."""
    logs: Path = tmp_path_factory.mktemp("second-api")
    with localstack.running_api(stack_env, logs / "api.log") as url:
        yield url


def test_a_plain_response_has_a_message_usage_and_its_settings(responses_client: OpenAI) -> None:
    response = responses_client.responses.create(
        model="demo", input="Say hello.", instructions="Be brief.", max_output_tokens=4, extra_body=SEED
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.text and response.output_text == part.text
    assert response.usage.output_tokens == 4
    assert response.usage.total_tokens == response.usage.input_tokens + 4
    assert response.instructions == "Be brief." and response.max_output_tokens == 4 and response.store is True
    assert response.max_tool_calls is None and response.truncation == "disabled"
    # What it samples with (the demo model ships no defaults), and no completed_at: it is incomplete.
    assert (response.temperature, response.top_p, response.completed_at) == (1.0, 1.0, None)
    bounded = responses_client.responses.create(
        model="demo", input="hi", max_output_tokens=2, max_tool_calls=3, store=False
    )
    assert bounded.max_tool_calls == 3  # built-in tools' calls: tokenline runs none


def test_a_streamed_response_sends_the_semantic_events_in_order(responses_client: OpenAI) -> None:
    stream = responses_client.responses.create(
        model="demo", input="Say hello.", max_output_tokens=4, stream=True, extra_body=SEED
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds[4:-4]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == text and final.output_text == text and final.usage.output_tokens == 4
    assert events[2].item.id == events[-2].item.id == final.output[0].id


def test_a_stream_sends_its_events_while_the_response_is_generated(responses_client: OpenAI) -> None:
    """The first events arrive before the end: the response is stored only when it ends."""
    stream = responses_client.responses.create(
        model="demo", input="Go on.", max_output_tokens=256, stream=True, extra_body={"ignore_eos": True}
    )
    with stream:
        created = next(iter(stream))
        assert created.type == "response.created"
        with pytest.raises(openai.NotFoundError):
            responses_client.responses.retrieve(created.response.id)


def test_a_stream_the_client_leaves_is_stored_as_cancelled_with_its_output_so_far(
    responses_client: OpenAI,
    stack,  # type: ignore[no-untyped-def]
) -> None:
    """Its id was in the first event: a retrieve finds it (it was a 404), and a follow-up may continue it.
    The worker is stopped while the client leaves, so that the generation cannot end first."""
    stream = responses_client.responses.create(
        model="demo", input="Go on.", max_output_tokens=256, stream=True, extra_body={"ignore_eos": True}
    )

    def stored() -> bool:
        try:
            return responses_client.responses.retrieve(response_id).status == "cancelled"
        except openai.NotFoundError:
            return False

    try:
        with stream:
            events = iter(stream)
            response_id = next(events).response.id
            deltas = 0
            for event in events:  # some text, then the client leaves
                deltas += event.type == "response.output_text.delta"
                if deltas == 3:
                    stack.worker.send_signal(signal.SIGSTOP)
                    break
        localstack.wait_for(stored, 10, "the left stream to be stored")
    finally:
        stack.worker.send_signal(signal.SIGCONT)
    left = responses_client.responses.retrieve(response_id)
    assert left.output and all(item.status == "incomplete" for item in left.output) and left.output_text
    assert left.usage is None  # it did not end: nothing was counted
    follow_up = responses_client.responses.create(
        model="demo", previous_response_id=response_id, input="And then?", max_output_tokens=2, extra_body=SEED
    )
    assert follow_up.status == "incomplete"


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_call_item_with_what_the_sdk_sends_of_a_direct_call_is_taken(responses_client: OpenAI) -> None:
    """openai 3.52's function-call items carry `caller`, `namespace` and `async`: a direct call, not
    asynchronous, is what tokenline's calls are (anything else is a 400 naming it)."""
    call = {**CALL, "caller": {"type": "direct"}, "namespace": None, "async": False}
    follow = [call, {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    answer = responses_client.responses.create(
        model="demo", input=[{"role": "user", "content": "Weather?"}, *follow], max_output_tokens=1, extra_body=SEED
    )
    assert answer.status == "incomplete"
    assert [item.type for item in responses_client.responses.input_items.list(answer.id, order="asc")] == [
        "message",
        "function_call",
        "function_call_output",
    ]


def test_a_function_output_must_answer_a_call_of_the_conversation(responses_client: OpenAI) -> None:
    """As OpenAI answers it: an agent that sent the wrong id got an answer that ignored its tool's result."""
    stray = {"type": "function_call_output", "call_id": "call_nope", "output": "18 C"}
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(
            model="demo", input=[{"role": "user", "content": "Weather?"}, CALL, stray], max_output_tokens=1
        )
    assert caught.value.body["param"] == "input[2].call_id" and "call_nope" in caught.value.message
    first = responses_client.responses.create(
        model="demo", input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED, extra_body=SEED
    )
    (call,) = first.output
    answered = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    follow = responses_client.responses.create(
        model="demo", previous_response_id=first.id, input=[answered], max_output_tokens=1, extra_body=SEED
    )
    assert follow.status == "incomplete"  # the call is in the conversation it continues
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(
            model="demo", previous_response_id=first.id, input=[stray], max_output_tokens=1
        )
    assert caught.value.body["param"] == "input[0].call_id"


def test_a_function_call_must_have_its_output(responses_client: OpenAI) -> None:
    """As OpenAI answers it: a call sent back without its tool's result would be answered as though the
    tool had returned nothing. So is a response that called continued without the call's output."""
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(
            model="demo", input=[{"role": "user", "content": "Weather?"}, CALL], max_output_tokens=1
        )
    assert caught.value.body["param"] == "input"
    assert caught.value.body["message"] == "input: No tool output found for function call call_1."
    first = responses_client.responses.create(
        model="demo", input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED, extra_body=SEED
    )
    (call,) = first.output
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(
            model="demo", previous_response_id=first.id, input="And in Vienna?", max_output_tokens=1
        )
    assert caught.value.body["message"] == f"input: No tool output found for function call {call.call_id}."


def test_a_function_tool_round_trip_continues_with_its_output(responses_client: OpenAI) -> None:
    first = responses_client.responses.create(
        model="demo", input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED, extra_body=SEED
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and set(json.loads(call.arguments)) == {"city"}
    follow = [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = responses_client.responses.create(
        model="demo", input=[{"role": "user", "content": "Weather in Paris?"}, *follow], tools=[WEATHER],
        max_output_tokens=4, extra_body=SEED,
    )  # fmt: skip
    assert second.status == "incomplete" and second.usage.output_tokens == 4
    assert second.usage.input_tokens > first.usage.input_tokens


def test_an_empty_function_output_continues_the_conversation(responses_client: OpenAI) -> None:
    # A tool run for its effect returns "" (openai-agents sends a function tool's empty result so).
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": ""}
    response = responses_client.responses.create(
        model="demo", input=[{"role": "user", "content": "Weather in Paris?"}, call, output], tools=[WEATHER],
        max_output_tokens=2, extra_body=SEED,
    )  # fmt: skip
    assert response.status == "incomplete" and response.usage.output_tokens == 2


def test_a_streamed_forced_call_streams_its_arguments(responses_client: OpenAI) -> None:
    events = list(
        responses_client.responses.create(
            model="demo", input="Weather?", tools=[WEATHER], tool_choice=FORCED, stream=True, extra_body=SEED
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == arguments and set(json.loads(arguments)) == {"city"}
    assert events[-1].response.output[0].arguments == arguments


def test_a_namespaces_functions_are_shown_and_their_calls_name_it(responses_client: OpenAI) -> None:
    """Codex's multi_agent_v1: a namespace of function tools. The model is shown its functions; a call
    of one is a function_call item that names the namespace, which a follow-up sends back."""
    spawn = {
        "type": "function",
        "name": "spawn_agent",
        "parameters": {
            "type": "object",
            "properties": {"task": {"type": "string", "maxLength": 8}},
            "required": ["task"],
        },
    }
    agents = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [spawn]}
    response = responses_client.responses.create(
        model="demo",
        input="Start an agent.",
        tools=[agents, WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "spawn_agent"},
        max_output_tokens=60,
        extra_body=SEED,
    )
    (call,) = response.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    echoed = response.model_dump()["tools"][0]
    assert echoed["type"] == "namespace" and [tool["name"] for tool in echoed["tools"]] == ["spawn_agent"]
    follow = responses_client.responses.create(
        model="demo",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "started"}],
        tools=[agents, WEATHER],  # type: ignore[list-item]
        max_output_tokens=2,
        extra_body=SEED,
    )
    assert follow.status == "incomplete"
    again = responses_client.responses.create(
        model="demo",
        input=[
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "x"},
        ],
        max_output_tokens=2,
        store=False,
        extra_body=SEED,
    )
    assert again.status == "incomplete"


def test_codexs_client_metadata_is_taken_and_not_echoed(responses_client: OpenAI) -> None:
    """Codex sends its session, thread and turn ids in every request (it has no setting to leave them
    out); they change nothing about the answer."""
    ids = {"session_id": "s-1", "turn_id": "t-1", "x-codex-turn-metadata": json.dumps({"agent_name": "/root"})}
    response = responses_client.responses.create(
        model="demo", input="hi", max_output_tokens=2, store=False, extra_body={**SEED, "client_metadata": ids}
    )
    assert response.status == "incomplete" and "client_metadata" not in response.model_dump()
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(model="demo", input="hi", extra_body={"client_metadata": {"n": 1}})
    assert caught.value.body["param"] == "client_metadata.n.value"


def test_allowed_tools_required_calls_one_of_them_and_is_echoed(responses_client: OpenAI) -> None:
    """What pydantic-ai sends where an agent's step may call some of its tools: the model is shown
    those only, and mode required forces a call of one of them."""
    note = {"type": "function", "name": "note", "parameters": {"type": "object", "properties": {}}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    response = responses_client.responses.create(
        model="demo", input="Weather?", tools=[note, WEATHER], tool_choice=choice, max_output_tokens=60, extra_body=SEED
    )
    assert [(item.type, item.name) for item in response.output] == [("function_call", "get_weather")]
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.mode == "required"
    unknown = {**choice, "tools": [{"type": "function", "name": "nope"}]}
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(model="demo", input="Weather?", tools=[WEATHER], tool_choice=unknown)
    assert caught.value.body["param"] == "tool_choice" and "No tool is named 'nope'" in caught.value.body["message"]


def test_parse_gives_the_pydantic_model_of_text_format(responses_client: OpenAI) -> None:
    response = responses_client.responses.parse(
        model="demo", input="A person, please.", text_format=Person, max_output_tokens=100, extra_body=SEED
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Person)
    assert response.text.format.type == "json_schema" and response.text.format.name == "Person"


def test_previous_response_id_continues_from_another_api_process(responses_client: OpenAI, second_api: str) -> None:
    first = responses_client.responses.create(model="demo", input="Remember: 42.", max_output_tokens=4, extra_body=SEED)
    other = client(second_api)
    second = other.responses.create(
        model="demo", input="What was it?", previous_response_id=first.id, max_output_tokens=4, extra_body=SEED
    )
    assert second.previous_response_id == first.id
    # The follow-up's prompt holds the first exchange: its input and its output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert other.responses.retrieve(second.id).output_text == second.output_text
    items = responses_client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "What was it?")]


def test_item_references_are_the_stored_items_they_name(responses_client: OpenAI, second_api: str, stack) -> None:  # type: ignore[no-untyped-def]
    """What the AI SDK sends of an earlier turn under store: true: `item_reference`s to the stored
    response's items (its input's and its output's), read from any API process, of the same API key."""
    first = responses_client.responses.create(model="demo", input="Remember: 42.", max_output_tokens=4, extra_body=SEED)
    (asked,) = responses_client.responses.input_items.list(first.id).data
    (answer,) = first.output
    chained = responses_client.responses.create(
        model="demo", input="What was it?", previous_response_id=first.id, max_output_tokens=4, extra_body=SEED
    )
    references = [{"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": answer.id}]
    question = {"role": "user", "content": "What was it?"}
    referred = client(second_api).responses.create(
        model="demo", input=[*references, question], max_output_tokens=4, extra_body=SEED
    )
    assert referred.usage.input_tokens == chained.usage.input_tokens and referred.output_text == chained.output_text
    items = responses_client.responses.input_items.list(referred.id, order="asc").data
    assert [(item.id, item.role) for item in items[:2]] == [(asked.id, "user"), (answer.id, "assistant")]
    assert items[1].content[0].text == first.output_text

    stranger = client(stack.base_url, key="key-two")
    with pytest.raises(openai.NotFoundError) as caught:
        stranger.responses.create(model="demo", input=[*references, question], max_output_tokens=2)
    assert caught.value.body["param"] == "input[0].id"
    assert caught.value.body["message"] == f"Item with id '{asked.id}' not found."
    responses_client.responses.delete(first.id)  # `referred` holds its items too, in its input
    assert responses_client.responses.create(model="demo", input=references, max_output_tokens=2, store=False).status
    responses_client.responses.delete(referred.id)
    with pytest.raises(openai.NotFoundError) as caught:
        responses_client.responses.create(model="demo", input=[question, references[1]], max_output_tokens=2)
    assert caught.value.body["param"] == "input[1].id"


def test_a_stored_response_is_not_found_with_another_api_key(responses_client: OpenAI, stack) -> None:  # type: ignore[no-untyped-def]
    first = responses_client.responses.create(model="demo", input="hi", max_output_tokens=2, extra_body=SEED)
    stranger = client(stack.base_url, key="key-two")
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        stranger.responses.create(model="demo", input="and?", previous_response_id=first.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(first.id)
    assert responses_client.responses.retrieve(first.id).id == first.id


def test_delete_removes_a_response_and_store_false_keeps_none(responses_client: OpenAI) -> None:
    kept = responses_client.responses.create(model="demo", input="hi", max_output_tokens=2, extra_body=SEED)
    with pytest.raises(openai.BadRequestError) as caught:  # the route takes no query parameters
        responses_client.responses.delete(kept.id, extra_query={"force": "true"})
    assert caught.value.body["param"] == "force"
    responses_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(kept.id)
    unstored = responses_client.responses.create(
        model="demo", input="hi", max_output_tokens=2, store=False, extra_body=SEED
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(unstored.id)


def test_a_background_response_is_queued_then_stored_as_it_ends(responses_client: OpenAI) -> None:
    queued = responses_client.responses.create(
        model="demo", input="Say hello.", background=True, max_output_tokens=4, extra_body=SEED
    )
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    localstack.wait_for(
        lambda: responses_client.responses.retrieve(queued.id).status == "incomplete", 30, "the response's end"
    )
    done = responses_client.responses.retrieve(queued.id)
    assert done.output_text and done.usage.output_tokens == 4 and done.background is True


def stored_end(stack, response_id: str) -> str:  # type: ignore[no-untyped-def]
    """Wait for the API's thread to store a background response's end; its status as it was stored."""
    prefix = f"background response stored request_id={response_id} status="
    localstack.wait_for(lambda: prefix in (stack.logs / "api.log").read_text(), 30, "the background response's end")
    (line,) = [line for line in (stack.logs / "api.log").read_text().splitlines() if prefix in line]
    return line.split(prefix, 1)[1].strip()


def test_a_background_response_is_cancelled_from_another_api_process(
    stack, responses_client: OpenAI, second_api: str
) -> None:  # type: ignore[no-untyped-def]
    running = responses_client.responses.create(
        model="demo", input="Go on.", background=True, max_output_tokens=256, extra_body={"ignore_eos": True}
    )
    cancelled = client(second_api).responses.cancel(running.id)
    assert cancelled.id == running.id and cancelled.status == "cancelled"
    assert stored_end(stack, running.id) == "cancelled"
    stored = responses_client.responses.retrieve(running.id)
    assert stored.status == "cancelled" and all(item.status == "incomplete" for item in stored.output)
    assert client(second_api).responses.cancel(running.id).status == "cancelled"  # again: as it is
    with pytest.raises(openai.BadRequestError):
        responses_client.responses.cancel(
            responses_client.responses.create(model="demo", input="hi", max_output_tokens=1).id
        )


def test_a_cancel_answers_the_output_so_far_and_a_follow_up_may_continue_from_it_at_once(
    responses_client: OpenAI,
) -> None:
    """The record a cancel writes held the output as it was when the run started (an empty message, in
    progress); answered as the cancel's result, and continued from at once, it made the follow-up's
    conversation end in an empty assistant turn: a 400 that blamed `input`."""
    running = responses_client.responses.create(
        model="demo", input="Go on.", background=True, max_output_tokens=256, extra_body={"ignore_eos": True}
    )
    localstack.wait_for(
        lambda: responses_client.responses.retrieve(running.id).status == "in_progress", 30, "the run to start"
    )
    cancelled = responses_client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output
    assert all(item.status == "incomplete" for item in cancelled.output) and cancelled.output_text
    follow_up = responses_client.responses.create(
        model="demo", previous_response_id=running.id, input="And then?", max_output_tokens=2, extra_body=SEED
    )
    assert follow_up.status == "incomplete" and follow_up.output_text


def test_a_finished_background_response_cannot_be_cancelled(stack, responses_client: OpenAI) -> None:  # type: ignore[no-untyped-def]
    done = responses_client.responses.create(
        model="demo", input="Say hello.", background=True, max_output_tokens=2, extra_body=SEED
    )
    assert stored_end(stack, done.id) == "incomplete"
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.cancel(done.id)
    assert "incomplete" in caught.value.message and caught.value.body["param"] == "response_id"
    # The route takes no parameters, in its query or its body.
    for extra in ({"extra_query": {"reason": "late"}}, {"extra_body": {"reason": "late"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            responses_client.responses.cancel(done.id, **extra)
        assert caught.value.body["param"] == "reason"
    assert responses_client.responses.retrieve(done.id).status == "incomplete"


def test_a_running_background_response_deleted_stops_and_is_not_stored_again(stack, responses_client: OpenAI) -> None:  # type: ignore[no-untyped-def]
    running = responses_client.responses.create(
        model="demo", input="Go on.", background=True, max_output_tokens=256, extra_body={"ignore_eos": True}
    )
    localstack.wait_for(
        lambda: responses_client.responses.retrieve(running.id).status == "in_progress", 30, "the response's start"
    )
    responses_client.responses.delete(running.id)
    log = stack.logs / "api.log"
    deleted = f"background response deleted before its end request_id={running.id}"
    localstack.wait_for(lambda: deleted in log.read_text(), 30, "the deleted response's end")
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(running.id)


@contextmanager
def one_process_api(stack_env: dict[str, str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], OpenAI]]:
    """An API of one gunicorn process on the stack's Redis (generation may run for seconds): its
    master and a client of it."""
    port = localstack.free_port()
    env = {**stack_env, "WEB_CONCURRENCY": "1", "TOKENLINE_MAX_ITER_TIMES": "2000"}
    master = localstack.start_api(env, port, log=log)
    try:
        localstack.wait_for_api(port, master)
        yield master, client(f"http://127.0.0.1:{port}")
    finally:
        localstack.stop(master)


def test_a_background_response_of_an_api_process_that_reloads_ends_as_failed_and_frees_its_place(
    stack, stack_env: dict[str, str], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A reload (SIGHUP) stops the API's processes once their open requests end: a background response
    they ran is stored as failed, and its place under maxLinkNum given back (it stayed in_progress for
    responsesTtl and held its place for queueTimeout + e2eTimeout)."""
    with one_process_api(stack_env, tmp_path / "api.log") as (master, reloading):
        running = reloading.responses.create(
            model="demo", input="Go on.", background=True, max_output_tokens=2000, extra_body={"ignore_eos": True}
        )
        localstack.wait_for(
            lambda: reloading.responses.retrieve(running.id).status == "in_progress", 30, "the response's start"
        )
        master.send_signal(signal.SIGHUP)
        localstack.wait_for(
            lambda: reloading.responses.retrieve(running.id).status != "in_progress", 30, "the stored response's end"
        )
        stored = reloading.responses.retrieve(running.id)
    assert stored.status == "failed" and "stopped (a restart or a reload)" in stored.error.message
    places = redis.Redis.from_url(stack.redis_url)
    assert places.zscore(admitted_key("demo"), running.id) is None
    places.close()


def test_a_background_response_of_a_killed_api_process_is_stored_as_failed_by_its_next_reader(
    stack, stack_env: dict[str, str], responses_client: OpenAI, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """An API process killed outright (SIGKILL, the OOM killer) stores nothing more: its background
    responses stayed `in_progress` for responsesTtl, a follow-up from one was a 400 ("still
    in_progress") and a cancel waited 5 s to answer items still open. Another process reading one finds
    no listener on the record's reply channel and stores it as failed, its items closed."""
    with one_process_api(stack_env, tmp_path / "api.log") as (master, doomed):
        body = {"model": "demo", "input": "Go on.", "background": True, "max_output_tokens": 2000}
        runs = [doomed.responses.create(**body, extra_body={"ignore_eos": True}) for _ in range(2)]
        for run in runs:
            localstack.wait_for(
                lambda run=run: doomed.responses.retrieve(run.id).status == "in_progress", 30, "the runs' start"
            )
        (gunicorn_worker,) = localstack.child_processes(master.pid)
        os.kill(gunicorn_worker, signal.SIGKILL)
        # Read from the stack's API processes; Redis drops the dead process's subscription once the
        # kernel has closed its socket, within a second.
        localstack.wait_for(
            lambda: responses_client.responses.retrieve(runs[0].id).status != "in_progress", 10, "the run's end"
        )
        read = responses_client.responses.retrieve(runs[0].id)
        with pytest.raises(openai.BadRequestError) as refused:
            responses_client.responses.cancel(runs[1].id)
    assert read.status == "failed" and read.error.code == "server_error"
    assert "died before it ended" in read.error.message
    assert read.output and all(item.status == "incomplete" for item in read.output)
    assert refused.value.body["param"] == "response_id" and "is failed" in refused.value.message
    follow_up = responses_client.responses.create(
        model="demo", previous_response_id=runs[0].id, input="And then?", max_output_tokens=2, extra_body=SEED
    )
    assert follow_up.status == "incomplete"
    assert responses_client.responses.retrieve(runs[1].id).status == "failed"
    api_log = (stack.logs / "api.log").read_text()
    assert f"background response {runs[0].id}: the API process that ran it" in api_log


def test_a_response_whose_call_was_cut_short_can_be_continued(responses_client: OpenAI) -> None:
    note = {
        "type": "function",
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 200}},
            "required": ["text"],
        },
    }
    cut = responses_client.responses.create(
        model="demo", input="go", tools=[note], tool_choice="required", max_output_tokens=16, extra_body=SEED
    )
    (call,) = cut.output
    assert cut.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(call.arguments)  # cut inside its arguments: no client could run it
    follow_up = responses_client.responses.create(
        model="demo", input="Never mind.", previous_response_id=cut.id, max_output_tokens=2, extra_body=SEED
    )
    assert follow_up.status == "incomplete" and follow_up.output_text
    with pytest.raises(openai.BadRequestError) as caught:  # nor can it be sent back by reference
        responses_client.responses.create(model="demo", input=[{"type": "item_reference", "id": call.id}])
    assert caught.value.body["param"] == "input[0].id" and "cannot be sent back" in caught.value.body["message"]


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/responses/{id}?starting_after=3", "starting_after"),
        ("/v1/responses/{id}?include[]=message.output_text.logprobs", "include"),
        ("/v1/responses/{id}?stream=true", "stream"),
        ("/v1/responses/{id}/input_items?before=x", "before"),
        ("/v1/responses/{id}/input_items?include[]=message.output_text.logprobs", "include"),
        ("/v1/responses/{id}/input_items?limit=%C2%B2", "limit"),  # a superscript 2 is a digit to str.isdigit
        ("/v1/responses/{id}/input_items?limit=%EF%BC%95", "limit"),  # a full-width 5
    ],
)
def test_a_query_parameter_a_route_does_not_honour_is_a_400_naming_it(
    stack, responses_client: OpenAI, path: str, param: str
) -> None:  # type: ignore[no-untyped-def]
    kept = responses_client.responses.create(model="demo", input="hi", max_output_tokens=1, extra_body=SEED)
    answer = requests.get(stack.base_url + path.format(id=kept.id), headers=AUTH, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    for honoured in ("?include_obfuscation=false&stream=false", "/input_items?include=&order=asc&limit=1"):
        assert requests.get(f"{stack.base_url}/v1/responses/{kept.id}{honoured}", headers=AUTH, timeout=10).ok


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "demo", "input": 5}, "input"),
        ({"model": "demo", "input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
        (
            {"model": "demo", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"model": "demo", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        (
            {
                "model": "demo",
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                ],
            },
            "input[1].arguments",
        ),
        *(
            ({"model": "demo", "input": [{**CALL, **extra}]}, f"input[0].{name}")
            for name, extra in (
                ("caller", {"caller": {"type": "program", "caller_id": "p"}}),
                ("namespace", {"namespace": "bad name!"}),
                ("async", {"async": True}),
            )
        ),
        ({"model": "demo", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        # A type that is a list or an object (they were a 500: looked up in a dict of types).
        (
            {"model": "demo", "input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]},
            "input[0].content[0].type",
        ),
        ({"model": "demo", "input": "hi", "tools": [{"type": {}, "name": "f"}]}, "tools[0].type"),
        ({"model": "demo", "input": "hi", "tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"model": "demo", "input": "hi", "tools": [{"type": "function", "name": "get weather"}]}, "tools[0].name"),
        ({"model": "demo", "input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"model": "demo", "input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
        ({"model": "demo", "input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"model": "demo", "input": "hi", "background": True, "store": False}, "background"),
        ({"model": "demo", "input": "hi", "background": True, "stream": True}, "background"),
        ({"model": "demo", "input": "hi", "previous_response_id": "resp_../../x"}, "previous_response_id"),
        ({"model": "demo", "input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
        (
            {"model": "demo", "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"}]},
            "input[0].encrypted_content",
        ),
        ({"model": "demo", "input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.name"),
        ({"model": "demo", "input": "x" * 600_000}, "input"),
        ({"model": "demo", "input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"model": "demo", "input": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_hostile_input_is_a_400_naming_the_field(stack, body: dict, param: str) -> None:  # type: ignore[no-untyped-def]
    answer = requests.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize(
    "path",
    [
        "/v1/responses/nope",
        "/v1/responses/resp_" + "0" * 32,
        "/v1/responses/resp-" + "0" * 32,
        "/v1/responses/resp_x/input_items",
    ],
)
def test_an_unknown_response_id_is_a_404(stack, path: str) -> None:  # type: ignore[no-untyped-def]
    answer = requests.get(stack.base_url + path, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "invalid_request_error"


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in one scrape."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    wanted = set(labels.items())
    return sum(s.value for s in samples if s.name == name and wanted <= set(s.labels.items()))


def settled(read: Callable[[], float], quiet: float = 1.5) -> float:
    """`read()` once it has not changed for `quiet` seconds (three worker heartbeats)."""
    seen = {"value": read(), "since": time.monotonic()}

    def still() -> bool:
        value = read()
        if value != seen["value"]:
            seen.update(value=value, since=time.monotonic())
        return time.monotonic() - seen["since"] >= quiet

    localstack.wait_for(still, 15, "the worker's counts to settle", interval=0.1)
    return seen["value"]


def requests_counted(base_url: str, **labels: str) -> float:
    return metric(base_url, "tokenline:api_requests_total", **labels)


def test_the_metrics_count_requests_by_api(responses_client: OpenAI, stack) -> None:  # type: ignore[no-untyped-def]
    labels = {"api": "responses", "route": "/v1/responses", "status": "200"}
    before = requests_counted(stack.base_url, **labels)
    responses_client.responses.create(model="demo", input="hi", max_output_tokens=1, store=False)
    assert requests_counted(stack.base_url, **labels) == before + 1


def test_a_follow_up_hits_the_prefix_cache_of_its_conversation(responses_client: OpenAI, stack, settings) -> None:  # type: ignore[no-untyped-def]
    def looked_up() -> float:
        return metric(stack.base_url, "tokenline:prefix_cache_queries_total", model="demo")

    def hits() -> float:
        return metric(stack.base_url, "tokenline:prefix_cache_hits_total", model="demo")

    first = responses_client.responses.create(
        model="demo", input="Remember these words: " + "apple banana cherry " * 20, max_output_tokens=4, extra_body=SEED
    )
    # The worker pushes its counts every heartbeat: take them once they include every earlier request.
    looked, hit = settled(looked_up), hits()
    second = responses_client.responses.create(
        model="demo", input="Which words?", previous_response_id=first.id, max_output_tokens=4, extra_body=SEED
    )
    localstack.wait_for(lambda: looked_up() >= looked + second.usage.input_tokens, 10, "the follow-up's lookup")
    assert looked_up() - looked == second.usage.input_tokens
    # Every full block of the first prompt is reused: the follow-up's prompt begins with it.
    block = settings.cache_block_size
    assert hits() - hit >= first.usage.input_tokens // block * block > 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 1}),
        ("/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 1, "background": True}),
        ("/v1/messages", {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_the_callers_request_id_is_logged_and_sent_back_on_the_agents_apis(stack, path: str, body: dict) -> None:  # type: ignore[no-untyped-def]
    trace = f"trace-{uuid.uuid4().hex[:8]}"
    answer = requests.post(stack.base_url + path, json=body, headers={**AUTH, "X-Request-Id": trace}, timeout=30)
    assert answer.ok and answer.headers["X-Request-Id"] == trace, answer.text
    ours = answer.json()["id"]
    logged = f"request_id={ours} x_request_id={trace}"
    localstack.wait_for(lambda: logged in (stack.logs / "api.log").read_text(), 10, "the ids tied in the log")


def said(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


WORDS = "lorem ipsum dolor sit amet consectetur " * 60
CHAT_TURNS = [
    *(item for turn in range(8) for item in (said("user", f"Turn {turn}: {WORDS}"), said("assistant", WORDS))),
    said("user", "And now?"),
]
AGENT_LOOP = [  # one task, then the calls an agent made and their outputs
    said("user", "Check the weather in every city."),
    *(
        item
        for call in range(8)
        for item in (
            {
                "type": "function_call",
                "call_id": f"call_{call}",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": f"call_{call}", "output": f"Report {call}: {WORDS}"},
        )
    ),
]


@pytest.mark.parametrize(
    ("items", "cuts"),
    [
        (CHAT_TURNS, range(2, len(CHAT_TURNS))),  # after the first user message, every message starts a turn
        (AGENT_LOOP, range(1, len(AGENT_LOOP), 2)),  # each call starts one (its output goes with it)
    ],
    ids=["chat-turns", "agent-loop"],
)
def test_truncation_auto_leaves_out_the_oldest_turns_of_a_conversation_too_long_for_its_context(
    stack,  # type: ignore[no-untyped-def]
    responses_client: OpenAI,
    items: list[dict[str, Any]],
    cuts: range,
) -> None:
    """OpenAI's truncation "auto": a conversation whose prompt exceeds the model's input bound keeps its
    first user message (an agent's task) and loses its oldest turns after it, as few as make it fit
    (its prompt that of the rendered conversation so cut, as /tokenize counts it); "disabled" (the
    default) is a 400 that says why; the response says which it ran with."""
    with pytest.raises(openai.BadRequestError) as refused:
        responses_client.responses.create(model="demo", input=items, max_output_tokens=4, store=False)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
    limit = int(refused.value.message.split("maximum input length is ")[1].split()[0])

    def prompt_tokens(cut: int) -> int:
        body = {"model": "demo", "messages": chat_messages([*items[:1], *items[cut:]])}
        return requests.post(f"{stack.base_url}/tokenize", json=body, headers=AUTH, timeout=30).json()["count"]

    counts = [prompt_tokens(cut) for cut in cuts]
    assert counts[0] > limit and counts[-1] <= limit  # more than one turn goes, and not all of them
    expected = next(count for count in counts if count <= limit)
    response = responses_client.responses.create(
        model="demo",
        input=items,  # type: ignore[arg-type]
        max_output_tokens=4,
        store=False,
        truncation="auto",
        extra_body=SEED,
    )
    assert response.truncation == "auto" and response.status in ("incomplete", "completed")
    assert response.usage is not None and response.usage.input_tokens == expected


def test_truncation_auto_answers_a_conversation_that_fits_whole(stack, responses_client: OpenAI) -> None:  # type: ignore[no-untyped-def]
    fitting = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    fitting.append({"role": "user", "content": "And now?"})
    short = responses_client.responses.create(
        model="demo",
        input=fitting,
        max_output_tokens=2,
        store=False,
        truncation="auto",
        extra_body=SEED,  # type: ignore[arg-type]
    )
    counted = requests.post(
        f"{stack.base_url}/tokenize", json={"model": "demo", "messages": fitting}, headers=AUTH, timeout=30
    )
    assert short.usage is not None and short.usage.input_tokens == counted.json()["count"]


def test_included_logprobs_are_the_message_tokens_as_chat_gives_them(responses_client: OpenAI, openai_client) -> None:  # type: ignore[no-untyped-def]
    """include message.output_text.logprobs (with top_logprobs alternatives): the output text's part and
    its stream's deltas carry its tokens' logprobs, those chat gives for the same seeded request."""
    asked = {"model": "demo", "input": "Say hello.", "max_output_tokens": 6, "store": False, "top_logprobs": 2}
    response = responses_client.responses.create(**asked, include=["message.output_text.logprobs"], extra_body=SEED)
    chat = openai_client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        seed=1,
    )
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    (part,) = response.output[0].content
    assert part.text == chat.choices[0].message.content and len(expected) == 6
    assert [entry.model_dump() for entry in part.logprobs] == expected and response.top_logprobs == 2
    events = list(
        responses_client.responses.create(
            **asked, include=["message.output_text.logprobs"], stream=True, extra_body=SEED
        )
    )
    streamed = [
        entry.model_dump(exclude_none=True)
        for e in events
        if e.type == "response.output_text.delta"
        for entry in e.logprobs
    ]
    assert streamed == expected
    assert responses_client.responses.create(**asked, extra_body=SEED).output[0].content[0].logprobs == []  # not asked
