"""Tool calls and structured outputs through a real `kvforge serve` started as README command 1 starts it (no flag
but the port and a data dir: the embedded model in its default configuration), driven by the official `openai`
SDK and LangChain (`langchain-openai`). Even a 135M model's outputs parse and validate: the constraint is in the
decoder."""

from __future__ import annotations

import json
import re
from typing import Annotated

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
MODEL = "SmolLM2-135M-Instruct"  # the embedded model's served name
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)
    hobbies: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def arguments_valid(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_parse_with_a_pydantic_model(client):
    """The SDK's `parse` sends a strict json_schema response_format and validates the reply into the model."""
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person with a name, an age and hobbies."}],
        response_format=Person, temperature=0, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert list(json.loads(choice.message.content)) == ["name", "age", "hobbies"]


# a JSON reply that ends in fp32 and in bf16 alike (an open-ended "say hello as JSON" grows a list in bf16)
JSON_HELLO = 'Reply with exactly this JSON object: {"greeting": "hello"}'


def test_json_object_and_samples_validate(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}], n=3, temperature=1.0, seed=7,
        max_tokens=150, response_format={"type": "json_schema", "json_schema": {
            "name": "cat", "schema": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 20}, "legs": {"type": "integer", "maximum": 4}},
                "required": ["name", "legs"], "additionalProperties": False}}})
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert set(json.loads(choice.message.content)) == {"name", "legs"}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": JSON_HELLO}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_schema_that_cannot_be_enforced_is_a_400(server):
    body = {"messages": ASK_WEATHER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "no-such-type"}}}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                           tool_choice=tool_choice, parallel_tool_calls=False,
                                           temperature=0, max_tokens=100)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls"
    assert choice_.message.content is None and len(choice_.message.tool_calls) == 1
    call = choice_.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    arguments_valid(call, tool)
    if choice == "named":
        assert call.function.name == "get_time"


def test_streamed_tool_calls_are_reassembled_by_the_sdk(client):
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                   max_tokens=100, parallel_tool_calls=False)
    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    whole = client.chat.completions.create(**request)
    streamed, expected = final.choices[0], whole.choices[0]
    assert streamed.finish_reason == expected.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in expected.message.tool_calls]
    assert streamed.message.tool_calls[0].id.startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_parallel_calls_end_without_a_repeat(client, stream):
    """parallel_tool_calls (OpenAI's default: true) lets the model call several times; this small model writes its
    first call again and again where the grammar lets it: the reply ends at the first repeat (the sample is stopped
    there), with distinct calls only, no call text in the content and finish_reason "tool_calls"."""
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
                   temperature=0, max_tokens=300)
    if stream:
        with client.chat.completions.stream(**request, stream_options={"include_usage": True}) as events:
            reply = events.get_final_completion()
    else:
        reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert calls and len(set(calls)) == len(calls)
    for call in choice.message.tool_calls:
        arguments_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    assert reply.usage.completion_tokens < 300


def test_streamed_tool_call_deltas_carry_index_id_and_name(server):
    """What Continue, Codex and litellm each broke on elsewhere: every tool-call delta has its index, the first one
    of a call its id, type and function name; a reply's calls have distinct indexes."""
    body = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": "required",
            "temperature": 0, "max_tokens": 300, "stream": True}
    seen: dict[int, dict] = {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    if call["index"] not in seen:
                        assert call["id"].startswith("call_") and call["type"] == "function"
                        assert call["function"]["name"] in ("get_weather", "get_time")
                        seen[call["index"]] = call
                    json.loads(call["function"]["arguments"])  # each call arrives whole
    assert sorted(seen) == list(range(len(seen))) and seen
    assert len({c["id"] for c in seen.values()}) == len(seen)


def test_a_named_tool_choice_is_one_call(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]


def test_a_multi_turn_tool_conversation(client):
    """call -> the tool's result -> an answer in words that uses it."""
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=60)
    for later_call in auto.choices[0].message.tool_calls or []:  # a small model may call again or answer
        arguments_valid(later_call, WEATHER)
    assert (auto.choices[0].finish_reason == "tool_calls") == bool(auto.choices[0].message.tool_calls)


def test_langchain_structured_output_and_bound_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=150,
                     max_retries=0, timeout=300)
    person = llm.with_structured_output(Person).invoke("Invent a person with a name, an age and hobbies.")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city, in celsius or fahrenheit."""
        return f"21 degrees {unit} in {city}"

    message = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(
        "Weather in Rome?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}


def test_structured_outputs_regex_choice_and_grammar(client, server):
    """vLLM's structured_outputs extra, on completions and chat."""
    regex = r"\d{3}-\d{4}"
    completion = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, completion.choices[0].text)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].message.content in ("yes", "no")
    lark = 'start: "Answer: " WORD "."\nWORD: /[a-z]{1,12}/'
    completion = client.completions.create(model=MODEL, prompt="What color is the sky?", max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"Answer: [a-z]{1,12}\.", completion.choices[0].text)
    both = {"messages": ASK_WEATHER, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=both, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"
    bad = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"prompt": "x", "structured_outputs": {"grammar": "start: missing_rule"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"


def test_tokenize_renders_tools_as_the_chat_route_does(client, server):
    """/v1/tokenize with messages and tools counts the prompt a chat request with them gets."""
    counted = httpx.post(f"{server.url}/v1/tokenize", json={"messages": ASK_WEATHER, "tools": [WEATHER]}, timeout=60)
    assert counted.status_code == 200
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=1)
    assert counted.json()["count"] == reply.usage.prompt_tokens
    plain = httpx.post(f"{server.url}/v1/tokenize", json={"messages": ASK_WEATHER}, timeout=60).json()["count"]
    assert plain < counted.json()["count"]  # the tools' descriptions are in the prompt
