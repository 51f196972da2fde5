"""LangChain's Ollama integration (`langchain-ollama`'s ChatOllama, on the official `ollama` client) against the
server's Ollama API at the server's base URL: invoke, stream, with_structured_output (Ollama's `format` with the
JSON schema, and format "json") and bind_tools with a tool-call round trip. Ollama's API has no tool_choice (the
135M model does not call tools unforced), so bind_tools is checked for what the client reads, whatever the model
chooses."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest

from tests.clients import ASK_WEATHER, MODEL, WEATHER_TOOL, Person, get_weather
from tests.clients.conftest import client_module

ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def langchain_ollama():
    return client_module("langchain_ollama", "langchain-ollama")


def chat(langchain_ollama, server, **fields):
    return langchain_ollama.ChatOllama(model=MODEL, base_url=server.url, temperature=0, **fields)


def test_invoke_and_stream(langchain_ollama, server):
    """validate_model_on_init finds the model in /api/tags; a reply carries Ollama's metadata (done_reason, counts)
    as usage; the streamed chunks add up to the same message, the last one with the metadata; ainvoke (the ollama
    AsyncClient) gives the same reply."""
    llm = chat(langchain_ollama, server, num_predict=24, validate_model_on_init=True)
    reply = llm.invoke(ASK)
    assert reply.content and reply.response_metadata["done_reason"] in ("stop", "length")
    assert reply.response_metadata["model_name"] == MODEL
    usage = reply.usage_metadata
    assert usage["input_tokens"] > 5 and 0 < usage["output_tokens"] <= 24
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    chunks = list(llm.stream(ASK))
    assert len(chunks) > 2
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == reply.content
    assert whole.response_metadata["done_reason"] == reply.response_metadata["done_reason"]
    assert whole.usage_metadata == usage
    assert asyncio.run(llm.ainvoke(ASK)).content == reply.content


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_with_structured_output(langchain_ollama, server, method):
    """json_schema (the default) sends the model's schema as Ollama's `format`; json_mode sends format "json"
    (the prompt names the keys). Either way the reply parses into the pydantic model."""
    llm = chat(langchain_ollama, server, num_predict=60).with_structured_output(Person, method=method)
    prompt = "Invent a person." if method == "json_schema" else \
        'Invent a person. Reply with a JSON object with the keys "name" (a string) and "age" (a number).'
    assert isinstance(llm.invoke(prompt), Person)


def test_bind_tools_and_a_tool_result_round_trip(langchain_ollama, server):
    """bind_tools sends the tools in OpenAI's format; any call the model makes comes back as a LangChain tool call
    with parsed arguments. A conversation with a call and its ToolMessage (Ollama names the tool, not the call) is
    answered (with text, or another call, as the model chooses)."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = chat(langchain_ollama, server, num_predict=40).bind_tools([WEATHER_TOOL])
    reply = llm.invoke(ASK_WEATHER)
    assert isinstance(reply, AIMessage) and reply.response_metadata["done_reason"] in ("stop", "length")
    for call in reply.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER_TOOL["function"]["parameters"])
    arguments = {"city": "Paris", "unit": "celsius"}
    history = [HumanMessage(ASK_WEATHER),
               AIMessage("", tool_calls=[{"name": "get_weather", "args": arguments, "id": "call_1"}]),
               ToolMessage(get_weather(**arguments), tool_call_id="call_1")]
    answer = llm.invoke(history)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)
