"""litellm, the client many agents talk through, on tokenline: its tool round trip (a call, then the
follow-up with the tool's result, where litellm sends the assistant's message without `content`)
through gunicorn on the demo model, with a forced call so that random weights give a valid one."""

from __future__ import annotations

import json
from typing import Any

import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def litellm(stack) -> Any:  # type: ignore[no-untyped-def]
    """litellm with its model cost map from its own package (it would fetch one from GitHub)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        yield litellm


def test_litellms_tool_round_trip_is_served(litellm, stack) -> None:  # type: ignore[no-untyped-def]
    endpoint = {"model": "openai/demo", "api_base": f"{stack.base_url}/v1", "api_key": "unused"}
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = litellm.completion(
        **endpoint, messages=messages, tools=[WEATHER], tool_choice=forced, max_tokens=100, seed=1
    )
    # The named call ends with `stop`, as OpenAI ends it; litellm reports a `stop` with calls as `tool_calls`.
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = litellm.completion(**endpoint, messages=messages, tools=[WEATHER], max_tokens=4, seed=1)
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 4
