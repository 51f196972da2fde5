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
     "takes no images"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "takes no audio"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:;base64,aGk="}}]}],
     "only on user messages"),
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
    ({"extra_body": {"metadata": {"a": "b"}}}, "metadata", "unknown field"),
    ({"logit_bias": {str(10**6): 5}}, "logit_bias", "logit_bias"),  # beyond the vocabulary: the engine says so
])
def test_refused_completion_fields(client, fields, param, why):
    error = refusal(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, **fields))
    assert error["param"] == param and why in error["message"], error


# --- a batch of prompts, echo with logprobs (what lm-eval's local-completions sends) -------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gives_each_prompts_choices_in_order(client, tokenizer, server, stream):
    """Choice i * n + j is prompt i's sample j (OpenAI's and vLLM's order), each what the prompt alone gives."""
    texts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model=MODEL, prompt=t, max_tokens=3, temperature=0).choices[0].text
             for t in texts]
    for batch in (texts, [tokenizer.encode(t) for t in texts]):
        request = dict(model=MODEL, prompt=batch, max_tokens=3, temperature=0, n=2)
        if stream:
            texts_by_index: dict[int, str] = {}
            for chunk in client.completions.create(**request, stream=True, stream_options={"include_usage": True}):
                for choice in chunk.choices:
                    texts_by_index[choice.index] = texts_by_index.get(choice.index, "") + choice.text
                usage = chunk.usage
            got = [texts_by_index[i] for i in range(6)]
        else:
            reply = client.completions.create(**request)
            assert [c.index for c in reply.choices] == list(range(6))
            got, usage = [c.text for c in reply.choices], reply.usage
        assert got == [text for text in alone for _ in range(2)]
        assert usage.completion_tokens == 18
        assert usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    assert wait_idle(server[1])


def test_a_batch_too_large_or_mixed_is_400_naming_the_prompt(client):
    for prompt in (["a"] * 257, [[1, 2], "b"], [], [[]]):
        assert refusal(lambda p=prompt: client.completions.create(model=MODEL, prompt=p, max_tokens=1))["param"] == \
            "prompt"


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, server):
    """lm-eval's loglikelihood: the prompt's tokens lead the logprobs, the first one's null (nothing before it),
    each position's the model's distribution after the tokens before it -- the same top logprobs as generating
    from that prefix gives."""
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    for prompt in (tokenizer.decode(ids), ids):
        for _ in range(2):  # the second time the prefix cache holds the prompt: the logprobs are computed anyway
            scored = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1, temperature=0,
                                               logprobs=2, echo=True).choices[0]
            lp = scored.logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert "".join(lp.tokens) == scored.text
            assert all(len(top) == 2 and max(top.values()) >= value - 1e-5
                       for top, value in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    for k in (1, 5, len(ids) - 1):
        after = client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1, temperature=0, logprobs=2)
        expected = after.choices[0].logprobs.top_logprobs[0]
        assert lp.top_logprobs[k].keys() == expected.keys()
        assert list(lp.top_logprobs[k].values()) == pytest.approx(list(expected.values()), abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert wait_idle(server[1])


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


def test_num_ctx_bounds_the_request_as_ollamas_option(client):
    """Open WebUI forwards a model's num_ctx (Ollama's option) to OpenAI connections too: the request's context
    window, as /api/chat's options.num_ctx -- the reply ends where it does, a prompt that fills it is a 400."""
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    window = first.usage.prompt_tokens + 3
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=50, temperature=0,
                                         extra_body={"num_ctx": window, "ignore_eos": True})
    assert cut.usage.completion_tokens == 3 and cut.choices[0].finish_reason == "length"
    error = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                                           extra_body={"num_ctx": first.usage.prompt_tokens}))
    assert error["param"] == "num_ctx" and error["code"] == "context_length_exceeded"
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, temperature=0,
                                     extra_body={"num_ctx": 8, "ignore_eos": True})
    assert text.usage.prompt_tokens + text.usage.completion_tokens == 8
