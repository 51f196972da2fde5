"""pydantic-ai (`pydantic-ai-slim[openai]`) against the server's /v1/chat/completions: OpenAIChatModel through an
OpenAIProvider at the server's base URL. A pydantic output_type is by default an output tool (`final_result`) that
the model must call (tool_choice "required", beside the agent's own tools); NativeOutput sends it as a json_schema
response_format instead."""

from __future__ import annotations

import asyncio

import pytest

from tests.clients import ASK_WEATHER, MODEL, CityWeather, Person, get_weather
from tests.clients.conftest import client_module

SETTINGS = {"temperature": 0, "max_tokens": 60, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def pydantic_ai():
    return client_module("pydantic_ai", "pydantic-ai-slim[openai]")


@pytest.fixture()
def model(pydantic_ai, server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))


def limits():
    from pydantic_ai.usage import UsageLimits

    return UsageLimits(request_limit=4)


def parts(result, kind: str) -> list:
    return [part for message in result.all_messages() for part in message.parts if type(part).__name__ == kind]


def test_an_agent_with_a_tool_and_an_output_type(pydantic_ai, model):
    """An agent with a function tool and a pydantic output_type: every call the model makes parses into its tool's
    arguments (each function call is run and answered), and the run ends with a validated CityWeather."""
    agent = pydantic_ai.Agent(model, output_type=CityWeather, tools=[get_weather],
                              instructions="You answer questions about the weather.", model_settings=SETTINGS)
    result = agent.run_sync(ASK_WEATHER, usage_limits=limits())
    assert isinstance(result.output, CityWeather)
    calls = parts(result, "ToolCallPart")
    assert calls and calls[-1].tool_name == "final_result"
    for call in calls:
        if call.tool_name == "get_weather":
            get_weather(**call.args_as_dict())
    returned = {part.tool_call_id for part in parts(result, "ToolReturnPart")}
    assert {call.tool_call_id for call in calls} <= returned
    assert result.usage.requests <= 4 and result.usage.output_tokens > 0


def test_native_output_is_a_json_schema_reply(pydantic_ai, model):
    """NativeOutput: the schema goes as a strict json_schema response_format; the reply's text is the object."""
    agent = pydantic_ai.Agent(model, output_type=pydantic_ai.NativeOutput(Person), model_settings=SETTINGS)
    result = agent.run_sync("Invent a person.", usage_limits=limits())
    assert isinstance(result.output, Person)
    assert parts(result, "TextPart") and not parts(result, "ToolCallPart")


def test_a_streamed_output_grows_into_the_object(pydantic_ai, model):
    """run_stream reads the streamed output tool call and gives the validated object at the end (the server sends
    a call's arguments whole in one delta, so there are few partial outputs before it)."""
    agent = pydantic_ai.Agent(model, output_type=Person, model_settings=SETTINGS)

    async def main():
        async with agent.run_stream("Invent a person.", usage_limits=limits()) as streamed:
            return [output async for output in streamed.stream_output(debounce_by=None)]

    outputs = asyncio.run(main())
    assert outputs and isinstance(outputs[-1], Person)
