"""OpenAI's Responses API through a real `kvforge serve` started as README command 1 starts it, driven by the
official `openai` SDK (`responses.create`, `.stream`, `.parse`). A request means the same as through the chat
completions API: greedy replies and forced calls are compared with /v1/chat/completions' for the same
conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.app.test_agent_api import MODEL, WEATHER, Person
from tests.helpers.api_checks import assert_openai_error

ASK = "What is the capital of France?"
TOOL = {"type": "function", **{k: WEATHER["function"][k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_create_and_stream_equal_the_chat_reply(client, server):
    expected = chat(server, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
                    temperature=0, max_tokens=200)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, temperature=0,
                                       max_output_tokens=200)
    assert expected["choices"][0]["finish_reason"] == "stop" and response.status == "completed"
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert [item.type for item in response.output] == ["message"] and response.id.startswith("resp_")
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.usage.input_tokens_details.cached_tokens > 0  # the chat request left the prompt cached
    assert response.usage.output_tokens == expected["usage"]["completion_tokens"]

    with client.responses.stream(model=MODEL, instructions="Be brief.", input=ASK, temperature=0,
                                 max_output_tokens=200) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == response.output_text and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") >= 2


def test_a_cut_reply_is_incomplete(client):
    response = client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    events = list(client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


def test_function_calls_round_trip(client, server):
    question = "What is the weather like in Paris today?"
    response = client.responses.create(model=MODEL, input=question, tools=[TOOL], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_output_tokens=100)
    assert [item.type for item in response.output] == ["function_call"]
    call = response.output[0]
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    expected = chat(server, messages=[{"role": "user", "content": question}], tools=[WEATHER],
                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                    max_tokens=100)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call.name, call.arguments) == (expected["name"], expected["arguments"])
    with client.responses.stream(model=MODEL, input=question, tools=[TOOL], parallel_tool_calls=False,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=100) as stream:
        streamed = stream.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in streamed.output] == [("function_call", call.name, call.arguments)]

    result = json.dumps({"temperature": 21, "sky": "sunny"})
    history = [{"role": "user", "content": question}, *[item.model_dump(exclude_none=True) for item in response.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    answer = client.responses.create(model=MODEL, input=history, tools=[TOOL], tool_choice="none", temperature=0,
                                     max_output_tokens=30)
    expected = chat(server, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert answer.output_text == expected["choices"][0]["message"]["content"]


def test_parse_with_a_pydantic_model(client):
    response = client.responses.parse(model=MODEL, input="Invent a person with a name, an age and hobbies.",
                                      text_format=Person, temperature=0, max_output_tokens=120)
    assert response.status == "completed" and isinstance(response.output_parsed, Person)


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, "text.format"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_bad_requests_are_400_naming_the_field(server, fields, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": ASK, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    assert_openai_error(response)
    assert response.json()["error"]["param"] == param and param in response.json()["error"]["message"]
