"""openai-agents, with its default model class (OpenAIResponsesModel, the Responses API), runs an agent
with a function tool to completion against tokenline, through gunicorn, Redis and a real worker on the
demo model: the first call is forced with tool_choice (the SDK then resets it to auto), and the
answer is the agent's output type, a bounded Pydantic model (text.format), so that noise ends."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e


class Forecast(BaseModel):
    summary: str = Field(max_length=8)


def test_an_agent_calls_its_function_tool_and_completes(stack) -> None:  # type: ignore[no-untyped-def]
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "18 C, sunny"

    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="agent-key", max_retries=0, timeout=60)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Forecast,
        model=OpenAIResponsesModel(model="demo", openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=80, extra_body={"seed": 1}),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(cities) == 1 and len(cities[0]) <= 12
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2
    assert all(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)
