"""litellm against the server through its three ways to a local server: `ollama/` (Ollama's /api/generate, the
messages flattened into a prompt by litellm), `ollama_chat/` (/api/chat) and `openai/` (/v1/chat/completions at
api_base). litellm also asks /api/show for the model's context and tool support. Its bundled model cost map is used
(LITELLM_LOCAL_MODEL_COST_MAP=True, conftest.py): it would fetch one from the internet at import."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.clients import ASK_WEATHER, MODEL, WEATHER_TOOL, Person
from tests.clients.conftest import client_module

ASK = [{"role": "user", "content": "What is the capital of France?"}]
PREFIXES = ["ollama", "ollama_chat", "openai"]


@pytest.fixture(scope="module")
def litellm():
    return client_module("litellm", "litellm")


def base(server, prefix: str) -> str:
    return f"{server.url}/v1" if prefix == "openai" else server.url


@pytest.mark.parametrize("prefix", PREFIXES)
def test_completion_whole_and_streamed(litellm, server, prefix):
    """A reply in OpenAI's shape whichever API it came through, with usage; the stream's deltas add up to the same
    text and its last chunk has the finish reason."""
    request = dict(model=f"{prefix}/{MODEL}", api_base=base(server, prefix), api_key="unused", messages=ASK,
                   max_tokens=16, temperature=0)
    whole = litellm.completion(**request)
    choice = whole.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 5 and 0 < whole.usage.completion_tokens <= 16
    chunks = list(litellm.completion(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [choice.finish_reason]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_response_format_with_a_pydantic_model(litellm, server, prefix):
    """response_format=Person: a json_schema response_format for openai/, Ollama's format with the schema for the
    ollama prefixes; the reply validates against the schema."""
    reply = litellm.completion(model=f"{prefix}/{MODEL}", api_base=base(server, prefix), api_key="unused",
                               messages=[{"role": "user", "content": "Invent a person."}], max_tokens=60,
                               temperature=0, response_format=Person)
    assert reply.choices[0].finish_reason == "stop"
    Person.model_validate_json(reply.choices[0].message.content)


def test_forced_tool_call_through_openai(litellm, server):
    """tools + tool_choice "required" through openai/: the call comes back in OpenAI's shape with arguments valid
    for the tool's schema."""
    reply = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused",
                               messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER_TOOL],
                               tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_tools_through_ollama_chat(litellm, server):
    """tools through ollama_chat/ (litellm drops tool_choice: Ollama has none): a reply in OpenAI's shape, any call
    with parsed arguments."""
    reply = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=server.url,
                               messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER_TOOL],
                               max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_model_info_from_the_ollama_api(litellm, server, monkeypatch):
    """litellm.get_model_info asks /api/show: the context from model_info["<family>.context_length"], and tool
    support from the model's template, where Ollama's templates for tool-calling models mention tools (litellm
    reads nothing else; /api/show's capabilities list "tools"). An agent framework on litellm uses this to choose
    native tool calls over a prompt."""
    monkeypatch.setenv("OLLAMA_API_BASE", server.url)
    context = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    info = litellm.get_model_info(f"ollama/{MODEL}")
    assert info["max_input_tokens"] == litellm.get_model_info(f"ollama_chat/{MODEL}")["max_input_tokens"] == context
    assert info["supports_function_calling"] is True
    assert litellm.supports_function_calling(f"ollama_chat/{MODEL}") is True
