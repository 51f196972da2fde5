"""Long conversations over real HTTP (uvicorn on 127.0.0.1, the embedded model), through the official clients: a chat
longer than its window (num_ctx, on every dialect) loses its oldest whole turns instead of getting a 400, says so in
the X-KVForge-Dropped-Messages header and the `context_truncated` field, whole and streamed; the next turn after a cut
keeps the same start and reads it from the prefix cache; the Responses API's `truncation` is honoured; Anthropic's
count_tokens counts what /v1/messages would send; a server started with --context-overflow error refuses as before,
and so does any server for a newest turn that cannot fit."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest
from openai import BadRequestError, OpenAI

from kvforge.app.generate.context_fit import FIELD, HEADER
from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine
from tests.helpers.engine_helpers import wait_idle

MODEL = "SmolLM2-135M-Instruct"
WINDOW = 400  # num_ctx: a window the conversations below outgrow within a few turns
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
GREEDY = {"temperature": 0, "max_tokens": 4}


def question(n: int) -> dict:
    return {"role": "user", "content": f"Question {n}: describe item {n}, its colour, its size and its history, "
                                       "in a few plain words please."}


def answer(n: int) -> dict:
    return {"role": "assistant", "content": f"Item {n} is a small red box, made long ago in a town by the sea, "
                                            "and kept on a shelf since."}


def conversation(turns: int) -> list[dict]:
    """The system prompt, then `turns` turns of about 60 tokens; the last one's question unanswered."""
    messages = [SYSTEM]
    for n in range(turns):
        messages += [question(n)] + ([answer(n)] if n < turns - 1 else [])
    return messages


@pytest.fixture(scope="module")
def engine(embedded_llm):
    engine = AsyncEngine(embedded_llm.engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, MODEL)) as served:
        yield served


@pytest.fixture(scope="module")
def refusing_url(engine):
    """The same model on a server started with --context-overflow error."""
    with serve_in_thread(create_app(engine, MODEL, context_overflow="error")) as served:
        yield served


@pytest.fixture()
def client(url):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_long_chat_loses_its_oldest_whole_turns_and_says_so(client, engine):
    messages = conversation(12)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **GREEDY,
                                                           extra_body={"num_ctx": WINDOW})
    completion = raw.parse()
    cut = completion.model_extra[FIELD]
    assert int(raw.headers[HEADER]) == cut["dropped_messages"] == 2 * cut["dropped_turns"] > 0  # whole turns
    # the history left takes about half the window (KEEP_SHARE), the newest turn after it
    assert WINDOW * 0.3 < completion.usage.prompt_tokens <= WINDOW - GREEDY["max_tokens"]
    whole = client.chat.completions.with_raw_response.create(model=MODEL, messages=conversation(3), **GREEDY,
                                                             extra_body={"num_ctx": WINDOW})
    assert HEADER not in whole.headers and FIELD not in (whole.parse().model_extra or {})

    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=messages, stream=True, **GREEDY,
                                                                extra_body={"num_ctx": WINDOW}) as streamed:
        assert streamed.headers[HEADER] == raw.headers[HEADER]
        chunks = list(streamed.parse())
    assert chunks[0].model_extra[FIELD] == cut and all(FIELD not in (c.model_extra or {}) for c in chunks[1:])
    assert wait_idle(engine)


def test_the_turn_after_a_cut_keeps_its_start_and_reads_it_from_the_prefix_cache(client, engine):
    """A client resends the whole conversation each turn: after a cut, the next turn drops the same turns, so its
    prompt starts with the previous prompt, whose KV the prefix cache serves (llama.cpp shifts by half; shifting one
    turn each time would recompute the whole history every turn)."""
    messages = conversation(12)
    first = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, extra_body={"num_ctx": WINDOW})
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, question(12)]
    second = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, extra_body={"num_ctx": WINDOW})
    assert second.model_extra[FIELD] == first.model_extra[FIELD]
    block = embedded_block_size(engine)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - block
    assert second.model_extra["timings"]["cache_n"] == second.usage.prompt_tokens_details.cached_tokens


def embedded_block_size(engine: AsyncEngine) -> int:
    return engine.engine.config.block_size


def test_the_newest_turn_that_cannot_fit_is_still_a_400(client):
    messages = conversation(4)[:-1] + [{"role": "user", "content": "word " * 500}]
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, extra_body={"num_ctx": WINDOW})
    assert refused.value.body["code"] == "context_length_exceeded" and refused.value.body["param"] == "num_ctx"


def test_a_server_set_to_refuse_refuses(refusing_url):
    response = httpx.post(f"{refusing_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": conversation(12), **GREEDY, "num_ctx": WINDOW})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert HEADER not in response.headers


def test_anthropic_messages_take_num_ctx_and_cut_the_same_way(url, client, engine):
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    history = conversation(12)[1:]
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=SYSTEM["content"],
                                                   messages=history, extra_body={"num_ctx": WINDOW,
                                                                                 "temperature": 0})
    message = raw.parse()
    expected = client.chat.completions.create(model=MODEL, messages=conversation(12), **GREEDY,
                                              extra_body={"num_ctx": WINDOW})
    assert message.model_extra[FIELD] == expected.model_extra[FIELD] and raw.headers[HEADER]
    assert message.content[0].text == expected.choices[0].message.content  # the same conversation was kept
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=4, messages=history, extra_body={"num_ctx": 0})
    assert "num_ctx" in refused.value.body["error"]["message"]
    with httpx.stream("POST", f"{url}/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": 4, "messages": history, "stream": True, "num_ctx": WINDOW}) as streamed:
        assert streamed.headers[HEADER] == raw.headers[HEADER]
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[0]["message"][FIELD] == expected.model_extra[FIELD]
    assert wait_idle(engine)


def test_anthropic_count_tokens_counts_what_messages_would_send(url):
    """count_tokens, as Anthropic's, counts what /v1/messages would send: after the cut, with the same header and
    field; our extras num_ctx and max_tokens (the reply's room) as /v1/messages takes them, and without max_tokens
    the room any large max_tokens gets."""
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    fields = {"model": MODEL, "system": SYSTEM["content"], "messages": conversation(12)[1:]}
    counted = claude.messages.with_raw_response.count_tokens(**fields, extra_body={"num_ctx": WINDOW, "max_tokens": 4})
    sent = claude.messages.with_raw_response.create(**fields, max_tokens=4,
                                                    extra_body={"num_ctx": WINDOW, "temperature": 0})
    count, message = counted.parse(), sent.parse()
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens < WINDOW  # what the model saw
    assert count.model_extra[FIELD] == message.model_extra[FIELD] and counted.headers[HEADER] == sent.headers[HEADER]

    def count_of(**extra) -> anthropic.types.MessageTokensCount:
        return claude.messages.count_tokens(**fields, extra_body={"num_ctx": WINDOW, **extra})

    # no max_tokens: a quarter of the window kept for the reply, as for any max_tokens of at least that
    roomy = count_of()
    assert roomy == count_of(max_tokens=WINDOW // 4) == count_of(max_tokens=32000)
    assert roomy.input_tokens <= WINDOW - WINDOW // 4 and roomy.model_extra[FIELD]["dropped_turns"] > 0
    whole = claude.messages.with_raw_response.count_tokens(model=MODEL, messages=conversation(12)[1:])
    assert HEADER not in whole.headers and FIELD not in (whole.parse().model_extra or {})  # the model's window: fits
    for bad in ({"num_ctx": 0}, {"max_tokens": 0}):
        with pytest.raises(anthropic.BadRequestError) as refused:
            count_of(**bad)
        assert next(iter(bad)) in refused.value.body["error"]["message"]


def test_ollama_chat_cuts_to_its_num_ctx(url, engine):
    options = {"temperature": 0, "num_predict": 4, "num_ctx": WINDOW}
    reply = ollama.Client(host=url, timeout=120).chat(model=MODEL, messages=conversation(12), options=options)
    assert reply.done and 0 < reply.prompt_eval_count <= WINDOW  # not the 400 it was
    whole = httpx.post(f"{url}/api/chat", timeout=120, json={"model": MODEL, "messages": conversation(12),
                                                             "options": options, "stream": False})
    assert whole.json()[FIELD]["dropped_messages"] == int(whole.headers[HEADER]) > 0
    with httpx.stream("POST", f"{url}/api/chat", timeout=120, json={"model": MODEL, "messages": conversation(12),
                                                                    "options": options}) as streamed:
        assert streamed.headers[HEADER] == whole.headers[HEADER]
        lines = [json.loads(line) for line in streamed.iter_lines() if line]
    assert lines[-1]["done"] and lines[-1][FIELD] == whole.json()[FIELD]
    assert wait_idle(engine)


def test_responses_truncation_auto_cuts_and_disabled_refuses(client, engine):
    items = conversation(12)[1:]
    raw = client.responses.with_raw_response.create(model=MODEL, instructions=SYSTEM["content"], input=items,
                                                    truncation="auto", temperature=0, max_output_tokens=4,
                                                    extra_body={"num_ctx": WINDOW})
    response = raw.parse()
    assert response.truncation == "auto" and response.model_extra[FIELD]["dropped_turns"] > 0 and raw.headers[HEADER]
    for truncation in ("disabled", None):  # OpenAI's default
        fields = {"truncation": truncation} if truncation else {}
        with pytest.raises(BadRequestError) as refused:
            client.responses.create(model=MODEL, instructions=SYSTEM["content"], input=items, temperature=0,
                                    max_output_tokens=4, extra_body={"num_ctx": WINDOW}, **fields)
        assert refused.value.body["code"] == "context_length_exceeded" and refused.value.body["param"] == "num_ctx"
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", extra_body={"num_ctx": -1})
    assert refused.value.body["param"] == "num_ctx"
    assert wait_idle(engine)
