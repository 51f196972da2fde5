"""OpenAI's Agents SDK (`openai-agents`) against the server's /v1/chat/completions: an agent on
OpenAIChatCompletionsModel with its own AsyncOpenAI client at the server's base URL, tracing disabled (it would
upload traces to OpenAI). Function tools are sent as strict JSON schemas; ModelSettings carry tool_choice, sampling
and parallel_tool_calls; an output_type is sent as a strict json_schema response_format."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.clients import ASK_WEATHER, MODEL, CityWeather, Person, get_weather
from tests.clients.conftest import client_module

INSTRUCTIONS = "You answer questions about the weather."


@pytest.fixture(scope="module")
def agents():
    sdk = client_module("agents", "openai-agents")
    sdk.set_tracing_disabled(True)
    return sdk


def run(agents, server, build, prompt: str, **kwargs):
    """Runner.run on a fresh event loop with its own AsyncOpenAI client (a client is bound to its loop)."""
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        return await agents.Runner.run(build(model), prompt, **kwargs)

    return asyncio.run(main())


def tool_calls(result) -> list:
    return [item.raw_item for item in result.new_items if type(item).__name__ == "ToolCallItem"]


def test_a_required_tool_call_runs_the_function(agents, server):
    """tool_choice "required" with one call at a time: the model's call parses into the tool's strict schema, the SDK
    runs the Python function, and stop_on_first_tool makes its result the run's final output."""
    weather = agents.function_tool(get_weather)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False)

    def build(model):
        return agents.Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[weather],
                            model_settings=settings, tool_use_behavior="stop_on_first_tool")

    result = run(agents, server, build, ASK_WEATHER)
    (call,) = tool_calls(result)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, weather.params_json_schema)
    assert result.final_output == get_weather(**arguments)


def test_an_output_type_is_a_validated_object(agents, server):
    """output_type: the SDK sends a strict json_schema response_format and validates the reply into the model."""

    def build(model):
        return agents.Agent(name="people", instructions="You invent people.", model=model, output_type=Person,
                            model_settings=agents.ModelSettings(temperature=0, max_tokens=60))

    result = run(agents, server, build, "Invent a person.")
    assert isinstance(result.final_output, Person)


def test_a_tool_then_a_structured_answer(agents, server):
    """The agent loop: a required tool call first, its result sent back as a tool message (the SDK then resets
    tool_choice to auto), then the final answer as the output_type, within three turns."""
    weather = agents.function_tool(get_weather)

    def build(model):
        return agents.Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[weather],
                            output_type=CityWeather,
                            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60,
                                                                parallel_tool_calls=False))

    result = run(agents, server, build, ASK_WEATHER, max_turns=3)
    assert isinstance(result.final_output, CityWeather)
    calls = tool_calls(result)
    assert calls and all(call.name == "get_weather" for call in calls)
    outputs = [item for item in result.new_items if type(item).__name__ == "ToolCallOutputItem"]
    assert len(outputs) == len(calls)


def test_a_streamed_run_gives_the_same_call_and_usage(agents, server):
    """Runner.run_streamed reads the chunks (tool-call deltas, then the usage chunk the SDK asks for with
    include_usage): the same call and final output as the whole run, and the usage counted."""
    from openai import AsyncOpenAI

    weather = agents.function_tool(get_weather)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False,
                                    include_usage=True)

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[weather],
                             model_settings=settings, tool_use_behavior="stop_on_first_tool")
        streamed = agents.Runner.run_streamed(agent, ASK_WEATHER)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(main())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    (call,) = tool_calls(streamed)
    assert streamed.final_output == get_weather(**json.loads(call.arguments))
    usage = streamed.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and 0 < usage.output_tokens <= 60
