"""LlamaIndex's Ollama LLM (`llama-index-llms-ollama`, on the official `ollama` client) against the server's Ollama
API: the context window read from /api/show, complete, chat, streamed completion and structured_predict (Ollama's
`format` with the output class's JSON schema), whole and streamed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.clients import MODEL, Person
from tests.clients.conftest import client_module

ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def ollama_llm():
    return client_module("llama_index.llms.ollama", "llama-index-llms-ollama")


def llm(ollama_llm, server, num_predict: int, **fields):
    return ollama_llm.Ollama(model=MODEL, base_url=server.url, request_timeout=300, temperature=0,
                             additional_kwargs={"num_predict": num_predict}, **fields)


def test_the_context_window_comes_from_the_server(ollama_llm, server):
    """Without a context_window the LLM reads `<family>.context_length` from /api/show's model_info (and sends it as
    num_ctx): the server's context, not LlamaIndex's default of 3900."""
    context = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert llm(ollama_llm, server, 8).metadata.context_window == context


def test_complete_chat_and_stream(ollama_llm, server):
    """complete and chat (through /api/chat) give the reply's text with Ollama's token counts; stream_complete's
    deltas add up to the whole text; acomplete (the ollama AsyncClient) gives the same text."""
    from llama_index.core.llms import ChatMessage

    model = llm(ollama_llm, server, 24, context_window=4096)
    completion = model.complete(ASK)
    assert completion.text and completion.raw["done_reason"] in ("stop", "length")
    assert completion.raw["prompt_eval_count"] > 5 and 0 < completion.raw["eval_count"] <= 24
    reply = model.chat([ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content=ASK)])
    assert reply.message.role == "assistant" and reply.message.content
    parts = list(model.stream_complete(ASK))
    assert len(parts) > 2 and "".join(p.delta for p in parts) == parts[-1].text == completion.text
    assert asyncio.run(model.acomplete(ASK)).text == completion.text


def test_structured_predict_whole_and_streamed(ollama_llm, server):
    """structured_predict sends the output class's schema as Ollama's format and validates the reply; the streamed
    variant yields the object as it grows, the last one complete."""
    from llama_index.core.prompts import PromptTemplate

    model = llm(ollama_llm, server, 60, context_window=4096)
    prompt = PromptTemplate("Invent a person called {name}.")
    person = model.structured_predict(Person, prompt, name="Ada")
    assert isinstance(person, Person)
    streamed = list(model.stream_structured_predict(Person, prompt, name="Ada"))
    assert len(streamed) > 1 and Person.model_validate(streamed[-1].model_dump()) == person
