"""instructor against the server: a pydantic response_model through the official `openai` SDK
(/v1/chat/completions, and /v1/responses) and the official `anthropic` SDK (/v1/messages), in the modes whose
output the server constrains: TOOLS (a named tool_choice; with from_anthropic a forced tool_use), JSON_SCHEMA (a
json_schema response_format) and RESPONSES_TOOLS. (TOOLS_STRICT and ANTHROPIC_TOOLS are deprecated aliases of TOOLS
in instructor 1.17.) (JSON, MD_JSON and ANTHROPIC_JSON put the schema
in the prompt and ask for an unconstrained or merely JSON reply: the 135M model copies the schema or writes code
instead, so those modes say nothing about the server here.)

instructor is installed with `pip install --no-deps` (.ci/run): every release pins jiter<0.15 and rich<15, and
openai >= 3.63 needs jiter >= 0.16, so pip would downgrade the openai SDK to satisfy it."""

from __future__ import annotations

import pytest

from tests.clients import MODEL, Person
from tests.clients.conftest import client_module

ASK = [{"role": "user", "content": "Invent a person with a name and an age."}]


@pytest.fixture(scope="module")
def instructor():
    return client_module("instructor", "instructor", "pip install --no-deps instructor==1.17.0, as .ci/run does")


def openai_client(instructor, server, mode):
    from openai import OpenAI

    return instructor.from_openai(OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300),
                                  mode=mode)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_chat_completions_modes(instructor, server, mode):
    """Each mode's request is answered with a reply that instructor validates into the response_model at the
    first try (max_retries=0: no re-ask), with the completion it came from."""
    client = openai_client(instructor, server, getattr(instructor.Mode, mode))
    person, completion = client.chat.completions.create_with_completion(
        model=MODEL, messages=ASK, response_model=Person, max_retries=0, temperature=0, max_tokens=60)
    assert isinstance(person, Person)
    choice = completion.choices[0]
    assert choice.finish_reason == ("stop" if mode == "JSON_SCHEMA" else "tool_calls")


def test_responses_tools_mode(instructor, server):
    """RESPONSES_TOOLS: a forced function call through /v1/responses, validated into the response_model."""
    client = openai_client(instructor, server, instructor.Mode.RESPONSES_TOOLS)
    person = client.responses.create(model=MODEL, input=ASK, response_model=Person, max_retries=0, temperature=0,
                                     max_output_tokens=60)
    assert isinstance(person, Person)


def test_anthropic_tools_mode(instructor, server):
    """TOOLS with from_anthropic: a forced tool_use (tool_choice {"type": "tool"}) through /v1/messages. (The
    anthropic SDK takes no temperature: the server's default for the embedded model is greedy.)"""
    from anthropic import Anthropic

    client = instructor.from_anthropic(Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300),
                                       mode=instructor.Mode.TOOLS)
    person = client.messages.create(model=MODEL, messages=ASK, response_model=Person, max_retries=0, max_tokens=60)
    assert isinstance(person, Person)


def test_create_partial_reassembles_the_streamed_call(instructor, server):
    """create_partial (TOOLS mode, streamed): instructor parses the forced call's argument deltas as they arrive and
    yields the object as it grows, the last one complete. (The server sends a call's arguments whole in one delta,
    tests/app/test_agent_api.py: so the partials here are the complete object alone.)"""
    client = openai_client(instructor, server, instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model=MODEL, messages=ASK, response_model=Person, max_retries=0, temperature=0, max_tokens=60))
    assert partials and Person.model_validate(partials[-1].model_dump())
