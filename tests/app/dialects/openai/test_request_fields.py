"""No silent ignores: every field of OpenAI's chat-completions and completions requests is honoured or
refused with a 400 naming it, and anything else is refused as unknown. Driven over real HTTP (uvicorn on
127.0.0.1, the embedded model) by the official `openai` client (`extra_body` for fields it does not know)
and raw httpx: refusals name the field, metadata is accepted, logit_bias steers greedy decoding, echo puts
the prompt in front of each choice, whole and streamed."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.api_checks import assert_openai_error
from tests.helpers.engine_helpers import wait_idle
from tests.helpers.threaded_api import openai_client, threaded_api

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "fields-key-321"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Say hello."}]
PROMPT = "The capital of France is"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(embedded_llm):
    with threaded_api(embedded_llm, MODEL, API_KEY) as served:
        yield served


@pytest.fixture()
def client(server):
    return openai_client(server[0], API_KEY)


@pytest.fixture(scope="module")
def tokenizer(embedded_llm):
    return embedded_llm.engine.tokenizer


def refusal(call) -> dict:
    """The error body of a call that must be refused with 400."""
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


# --- refused -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("foo", 1), ("echo", True), ("guided_json", {"type": "object"}),
                                          ("Max_Tokens", 4)])
def test_unknown_chat_field_is_400_naming_it(client, field, value):
    error = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                                           extra_body={field: value}))
    assert error["param"] == field and "unknown field" in error["message"] and field in error["message"]


def test_unknown_field_inside_a_message_names_messages(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "mood": "happy"}], "max_tokens": 1}
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 400
    assert_openai_error(r)
    assert r.json()["error"]["param"] == "messages" and "'mood'" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value, why", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}], "use tools"),
    ("function_call", "auto", "use tool_choice"),
    ("audio", {"voice": "alloy", "format": "wav"}, "text-only"),
    ("modalities", ["text", "audio"], "text-only"),
    ("prediction", {"type": "content", "content": "Hello"}, "predicted outputs"),
    ("web_search_options", {"search_context_size": "low"}, "web search"),
    ("reasoning_effort", "low", "chat_template_kwargs"),
    ("verbosity", "low", "verbosity"),
    ("moderation", {"model": "omni-moderation-latest"}, "moderation"),
    ("top_logprobs", 2, "logprobs: true"),
    ("stream_options", {"include_obfuscation": True}, "obfuscation"),
    ("tool_choice", "auto", "needs tools"),
    ("tool_choice", "required", "needs tools"),
    ("logit_bias", {"hello": 5}, "token ids"),
    ("logit_bias", {"5": 101}, "100"),
])
def test_refused_chat_field_is_400_naming_it_and_why(client, field, value, why):
    error = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                                           **{field: value}))
    assert error["param"] == field and why in error["message"], error


def test_refused_field_sent_as_null_is_absent(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1, "audio": None, "functions": None,
            "reasoning_effort": None}
    assert httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers=HEADERS, timeout=60).status_code == 200


def test_tool_choice_must_name_one_of_the_tools(client):
    error = refusal(lambda: client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=1, tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert error["param"] == "tool_choice" and "get_time" in error["message"]


@pytest.mark.parametrize("tools, why", [
    ([{"type": "custom", "custom": {"name": "grep"}}], "custom tools"),
    ([{"type": "function", "function": {"name": "two words"}}], "pattern"),
    ([TOOL, TOOL], "unique"),
])
def test_bad_tools_are_400(client, tools, why):
    error = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, tools=tools))
    assert error["param"] == "tools" and why in error["message"], error


@pytest.mark.parametrize("messages, why", [
    ([{"role": "user", "content": "What is 2+2?"}, {"role": "tool", "content": "4"}], "tool_call_id"),
    ([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                   {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}],
     "text-only"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "text-only"),
    ([{"role": "function", "name": "f", "content": "4"}], "deprecated"),
    ([{"role": "user", "content": "hi", "tool_call_id": "call_1"}], "only on tool messages"),
    ([{"role": "user"}], "needs content"),
])
def test_bad_messages_are_400_naming_messages(client, messages, why):
    error = refusal(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1))
    assert error["param"] == "messages" and why in error["message"], error


@pytest.mark.parametrize("fields, param, why", [
    ({"suffix": " and that is all."}, "suffix", "fill-in-the-middle"),
    ({"best_of": 3}, "best_of", "equal to n"),
    ({"echo": True, "logprobs": 1}, "echo", "logprobs"),
    ({"extra_body": {"metadata": {"a": "b"}}}, "metadata", "unknown field"),
    ({"logit_bias": {str(10**6): 5}}, "logit_bias", "logit_bias"),  # beyond the vocabulary: the engine says so
])
def test_refused_completion_fields(client, fields, param, why):
    error = refusal(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, **fields))
    assert error["param"] == param and why in error["message"], error


def test_batched_prompts_are_refused(client):
    error = refusal(lambda: client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=1))
    assert error["param"] == "prompt" and "batch" in error["message"]


# --- accepted ------------------------------------------------------------------------------------------


def test_metadata_fields_are_accepted(client, server):
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, user="user-1", metadata={"run": "test"}, store=False,
        service_tier="auto", prompt_cache_key="greeting", safety_identifier="hash-1", modalities=["text"],
        parallel_tool_calls=True, stream_options=None, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, user="user-1", best_of=1).choices
    assert wait_idle(server[1])


def test_tool_history_and_named_tool_choice_are_accepted(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "The user wants the weather.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "weather", "schema": {"type": "object"}, "strict": True}}}
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text


# --- logit_bias -----------------------------------------------------------------------------------------


def test_logit_bias_forces_a_token(client, tokenizer):
    zebra = tokenizer.encode(" zebra")[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    logit_bias={str(zebra): 100})
    assert out.choices[0].text == tokenizer.decode([zebra])
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0,
                                          logit_bias={str(zebra): 100})
    assert chat.choices[0].message.content == tokenizer.decode([zebra])


def test_logit_bias_bans_the_greedy_token(client):
    def first_token_id(**fields) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0,
                                               logprobs=True, **fields)
        return reply.choices[0].logprobs.content[0].model_extra["id"]

    greedy = first_token_id()
    assert first_token_id(logit_bias={str(greedy + 1): -100}) == greedy  # another token's ban changes nothing
    assert first_token_id(logit_bias={str(greedy): -100}) != greedy


# --- echo -----------------------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_completion(client, tokenizer, server):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.usage.completion_tokens == 4  # the echo is not counted as generated
    ids = tokenizer.encode("Once upon a time")
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert from_ids.choices[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    assert len(from_ids.choices[0].text) > len(tokenizer.decode(ids))
    assert wait_idle(server[1])


def test_streamed_echo_opens_each_choice(client, server):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, n=2,
                                            echo=True, stream=True))
    for index in (0, 1):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert texts[0].startswith(PROMPT)
        assert "".join(texts) == PROMPT + plain  # greedy: both choices alike
    assert wait_idle(server[1])
