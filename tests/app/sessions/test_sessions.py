"""The sessions API (/v1/sessions) over real HTTP (uvicorn on 127.0.0.1) with the real embedded model and a
real store, SQLite and PostgreSQL: CRUD, validation (nothing rejected is stored), the streamed reply's events,
multi-turn history kept server-side (the same prompt as /v1/chat/completions with the whole history, prefix
cache hits from turn 2), the chat template's prefix stability that those cache hits rest on, sampling
settings and their per-message overrides, branches (an edited message and a regenerated reply beside the old
ones, switching back hits the old branch's cached prefix), a client hanging up mid-reply, and a burst of sessions
at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine
from kvforge.core.async_engine import build_off_main_thread
from kvforge.core.config import EngineConfig
from kvforge.core.engine import LLMEngine
from kvforge.core.sampling import SamplingParams
from kvforge.core.store import Store
from tests.helpers.engine_helpers import assert_idle, wait_idle
from tests.helpers.parity import same_or_near_tie

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512  # small, so that a long message cannot fit
DEFAULT_MAX_TOKENS = 16  # what a reply without any max_tokens gets
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def engine(embedded_path):
    """One engine for the module (the model is expensive; stores and apps are cheap)."""
    # fp32: replies are compared greedy with the chat route's (bf16, the default on a CPU with AMX, has near-ties
    # that a different batch breaks the other way)
    config = EngineConfig(model=str(embedded_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128, dtype="float32")
    engine = AsyncEngine(build_off_main_thread(lambda: LLMEngine(config, progress=False)))
    yield engine
    engine.close()


@contextmanager
def serve(engine: AsyncEngine, db_url: str) -> Iterator[tuple[httpx.Client, object]]:
    """An app on its own store sharing the module's engine, served by uvicorn; a client for it and the app."""
    store = Store(db_url)
    app = create_app(engine, MODEL, store=store, default_max_tokens=DEFAULT_MAX_TOKENS)
    try:
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            yield http, app
    finally:
        store.close()


@pytest.fixture()
def server(engine, db_url):
    """The sessions API on SQLite and on PostgreSQL."""
    with serve(engine, db_url) as (http, app):
        yield http, app
    assert wait_idle(engine), "a test left a request running"


@pytest.fixture()
def sqlite_server(engine, tmp_path):
    """For tests whose subject is the engine side (one database is enough)."""
    with serve(engine, f"sqlite:///{tmp_path / 'kvforge.db'}") as (http, app):
        yield http, app
    assert wait_idle(engine), "a test left a request running"


# --- helpers ------------------------------------------------------------------------------------------

def create(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def get(http: httpx.Client, session_id: str) -> dict:
    r = http.get(f"/v1/sessions/{session_id}")
    assert r.status_code == 200, r.text
    return r.json()


def parse_sse(lines) -> list:
    """The events of a server-sent-events stream: dicts, and the final "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def post_stream(http: httpx.Client, session_id: str, **body) -> list:
    with http.stream("POST", f"/v1/sessions/{session_id}/messages", json=body) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.iter_lines())


def post_whole(http: httpx.Client, session_id: str, **body) -> dict:
    r = http.post(f"/v1/sessions/{session_id}/messages", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def check_reply_events(events: list, content: str) -> dict:
    """user, delta..., done, [DONE]; returns the done event."""
    assert [e if isinstance(e, str) else e["type"] for e in (events[0], events[-2], events[-1])] == [
        "user", "done", "[DONE]"], events
    assert all(e["type"] == "delta" for e in events[1:-2]), events
    deltas = [e["content"] for e in events[1:-2]]
    assert deltas and all(deltas), "no partial reply before the final one"
    user, done = events[0]["message"], events[-2]
    assert user["role"] == "user" and user["content"] == content
    assert done["message"]["role"] == "assistant"
    assert done["message"]["content"] == "".join(deltas)
    assert done["message"]["id"] > user["id"]
    return done


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"]
    return error


def wait_for(predicate, timeout: float = 30):
    """Poll until `predicate()` is truthy (returns it) or `timeout` passes (returns the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# --- CRUD -----------------------------------------------------------------------------------------------

def test_crud(server):
    http, _ = server
    assert http.get("/v1/sessions").json() == {"object": "list", "data": []}

    plain = create(http)
    assert len(plain["id"]) == 32 and plain["object"] == "session"
    assert plain["title"] == "New chat" and plain["model"] == MODEL and plain["messages"] == []
    assert plain["settings"] == {"system_prompt": None, "sampling": {}}

    sampling = {"temperature": 0.3, "top_p": 0.9, "max_tokens": 7, "stop": ["\n\n"], "seed": 5}
    full = create(http, title="Trip planning", system_prompt="You are terse.", sampling=sampling)
    assert full["title"] == "Trip planning"
    assert full["settings"] == {"system_prompt": "You are terse.", "sampling": sampling}
    third = create(http, title="Third")

    listed = http.get("/v1/sessions").json()
    assert listed["object"] == "list"
    assert [s["id"] for s in listed["data"]] == [third["id"], full["id"], plain["id"]]  # newest first
    assert all("messages" not in s for s in listed["data"])

    got = get(http, full["id"])
    assert got == full  # settings round-trip through the database unchanged
    assert http.get(f"/v1/sessions/{full['id']}/messages").json() == {"object": "list", "data": []}

    # rename: the settings stay; the renamed session is now the most recently updated
    renamed = http.patch(f"/v1/sessions/{plain['id']}", json={"title": "Renamed"}).json()
    assert renamed["title"] == "Renamed" and renamed["settings"] == plain["settings"]
    assert renamed["updated_at"] >= plain["updated_at"]
    assert [s["id"] for s in http.get("/v1/sessions").json()["data"]][0] == plain["id"]

    # system prompt: the sampling stays
    changed = http.patch(f"/v1/sessions/{full['id']}", json={"system_prompt": "You are verbose."}).json()
    assert changed["settings"] == {"system_prompt": "You are verbose.", "sampling": sampling}
    assert changed["title"] == "Trip planning"
    # sampling: replaced as a whole, the system prompt stays
    changed = http.patch(f"/v1/sessions/{full['id']}", json={"sampling": {"temperature": 0}}).json()
    assert changed["settings"] == {"system_prompt": "You are verbose.", "sampling": {"temperature": 0}}
    # an explicit null clears the system prompt
    changed = http.patch(f"/v1/sessions/{full['id']}", json={"system_prompt": None}).json()
    assert changed["settings"] == {"system_prompt": None, "sampling": {"temperature": 0}}
    assert get(http, full["id"]) == changed  # persisted, not just echoed
    assert get(http, plain["id"])["title"] == "Renamed"

    r = http.delete(f"/v1/sessions/{full['id']}")
    assert r.status_code == 200 and r.json() == {"id": full["id"], "object": "session.deleted", "deleted": True}
    assert {s["id"] for s in http.get("/v1/sessions").json()["data"]} == {plain["id"], third["id"]}
    for r in (http.get(f"/v1/sessions/{full['id']}"),
              http.get(f"/v1/sessions/{full['id']}/messages"),
              http.patch(f"/v1/sessions/{full['id']}", json={"title": "x"}),
              http.delete(f"/v1/sessions/{full['id']}"),
              http.post(f"/v1/sessions/{full['id']}/messages", json={"content": "Hello?", "max_tokens": 2})):
        error = assert_error(r, 404, "session_id")
        assert error["type"] == "not_found_error" and error["code"] == "session_not_found"


def test_unknown_session_is_404(server):
    http, _ = server
    for r in (http.get("/v1/sessions/nope"), http.get("/v1/sessions/0123456789abcdef0123456789abcdef"),
              http.post("/v1/sessions/nope/messages", json={"content": "hi"}),
              http.patch("/v1/sessions/nope", json={"title": "t"}), http.delete("/v1/sessions/nope")):
        error = assert_error(r, 404, "session_id")
        assert error["type"] == "not_found_error"


# --- validation -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, mentions", [
    ({"sampling": {"temperature": 5}}, "sampling", "temperature"),
    ({"sampling": {"temprature": 0.5}}, "sampling", "temprature"),
    ({"sampling": {"n": 2}}, "sampling", "n"),
    ({"sampling": {"max_tokens": 0}}, "sampling", "max_tokens"),
    # what only SamplingParams checks: a session must not accept settings that fail every message
    ({"sampling": {"stop": [""]}}, "sampling", "stop"),
    ({"sampling": {"max_tokens": 3, "min_tokens": 5}}, "sampling", "min_tokens"),
    ({"title": ""}, "title", "title"),
    ({"bogus": 1}, "bogus", "bogus"),
])
def test_bad_session_settings_are_400(server, body, param, mentions):
    http, _ = server
    assert mentions in assert_error(http.post("/v1/sessions", json=body), 400, param)["message"]
    session = create(http, sampling={"temperature": 0})
    if "sampling" in body:
        assert mentions in assert_error(http.patch(f"/v1/sessions/{session['id']}", json=body), 400, param)["message"]
    assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == [session["id"]]  # nothing else created
    assert get(http, session["id"])["settings"] == {"system_prompt": None, "sampling": {"temperature": 0}}


def test_bad_messages_are_400_and_not_stored(server, engine):
    http, _ = server
    session = create(http)
    url = f"/v1/sessions/{session['id']}/messages"
    long_message = "hello " * 600  # ~600 tokens: beyond the engine's 512-token context
    medium_message = "hello " * 300  # fits, but not with 300 tokens of reply
    for body, param in [({"content": ""}, "content"),
                        ({}, "content"),
                        ({"content": "Hi", "temperature": 9}, "temperature"),
                        ({"content": "Hi", "n": 2}, "n"),
                        ({"content": "Hi", "max_tokens": 0}, "max_tokens"),
                        ({"content": "Hi", "top_p": 0}, "top_p"),
                        ({"content": long_message}, "content"),
                        ({"content": long_message, "stream": False}, "content"),
                        ({"content": medium_message, "max_tokens": 300}, "content")]:
        error = assert_error(http.post(url, json=body), 400, param)
        if body.get("content") in (long_message, medium_message):
            assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    after = get(http, session["id"])
    assert after["messages"] == [] and http.get(url).json()["data"] == []  # no rejected message was stored
    assert after["title"] == "New chat"  # nor did one name the session
    assert wait_idle(engine)

    # the session still works, and its first accepted message is the first one in the history
    reply = post_whole(http, session["id"], content="Hi", max_tokens=2)
    assert [m["content"] for m in get(http, session["id"])["messages"]] == ["Hi", reply["message"]["content"]]


# --- streaming --------------------------------------------------------------------------------------------

def test_streamed_reply_events_and_whole_reply(server, engine):
    http, _ = server
    session = create(http, sampling={"temperature": 0})
    question = "What is the capital of France?"
    events = post_stream(http, session["id"], content=question, max_tokens=8, ignore_eos=True)
    done = check_reply_events(events, question)
    user, message = events[0]["message"], done["message"]
    assert {"type", "message", "usage", "timings"} <= set(done)
    usage = done["usage"]
    assert usage["completion_tokens"] == 8 and message["finish_reason"] == "length"  # ignore_eos: all 8
    assert usage["prompt_tokens"] == user["prompt_tokens"] == message["prompt_tokens"] > 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert message["completion_tokens"] == 8
    assert message["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert done["timings"]["ttft_ms"] > 0 and done["timings"]["tokens_per_second"] > 0
    assert {"ttft_ms", "tpot_ms", "tokens_per_second", "queue_ms"} <= set(done["timings"])

    # the history holds exactly what the events said
    stored = get(http, session["id"])
    assert stored["messages"] == [user, message]
    assert stored["title"] == question
    assert http.get(f"/v1/sessions/{session['id']}/messages").json()["data"] == [user, message]

    # stream=false: one JSON body with the same parts
    whole = post_whole(http, session["id"], content="Thanks! And Germany?", max_tokens=6)
    assert {"user", "message", "usage", "timings"} <= set(whole) and "type" not in whole
    assert whole["user"]["content"] == "Thanks! And Germany?" and whole["message"]["role"] == "assistant"
    assert 0 < whole["usage"]["completion_tokens"] <= 6
    assert whole["usage"]["completion_tokens"] == whole["message"]["completion_tokens"]
    assert whole["usage"]["prompt_tokens"] > usage["prompt_tokens"] + usage["completion_tokens"]
    assert get(http, session["id"])["messages"] == [user, message, whole["user"], whole["message"]]
    assert wait_idle(engine)


# --- multi-turn -------------------------------------------------------------------------------------------

def test_multi_turn_history_is_kept_and_renders_the_same_prompt(server, engine):
    http, _ = server
    system = "You are a helpful geography assistant. Answer in one sentence."
    session = create(http, system_prompt=system, sampling=GREEDY)
    block_size = engine.engine.config.block_size
    questions = ["What is the capital of France?", "And the capital of Japan?", "Which of the two is larger?"]
    history = [{"role": "system", "content": system}]
    previous = None
    for turn, question in enumerate(questions, start=1):
        done = check_reply_events(post_stream(http, session["id"], content=question), question)
        reply, usage = done["message"]["content"], done["usage"]
        history.append({"role": "user", "content": question})

        # the same conversation sent whole to /v1/chat/completions gives the same prompt and the same reply
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, **GREEDY})
        assert r.status_code == 200, r.text
        reference = r.json()
        assert reference["usage"]["prompt_tokens"] == usage["prompt_tokens"], f"turn {turn}: another prompt"
        assert reference["choices"][0]["message"]["content"] == reply, f"turn {turn}"
        assert reference["usage"]["completion_tokens"] == usage["completion_tokens"]
        history.append({"role": "assistant", "content": reply})

        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if previous is not None:
            # the previous turn's prompt and reply (all but the last sampled token, whose KV is never
            # computed) are the prefix of this prompt: every full block of them comes from the cache
            assert cached >= (previous["prompt_tokens"] + previous["completion_tokens"] - 1) // block_size * block_size
            assert cached > 0
            assert usage["prompt_tokens"] > previous["prompt_tokens"] + previous["completion_tokens"]
        previous = usage

    stored = get(http, session["id"])
    assert stored["title"] == questions[0]  # the first message named the session
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [
        (m["role"], m["content"]) for m in history[1:]]
    assert len(stored["messages"]) == 6
    ids = [m["id"] for m in stored["messages"]]
    assert ids == sorted(ids)
    assert wait_idle(engine)


def test_chat_template_renders_stable_prefixes(engine):
    """What makes turn N+1's cache hit possible: turn N's prompt followed by its reply, as generated, is
    a prefix of turn N+1's prompt, as text (byte for byte) and as token ids."""
    tokenizer = engine.tokenizer

    async def generate(prompt_ids: list[int]):
        stream = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=8))
        async for out in stream:
            final = out
        return final

    messages: list[dict] = []
    turns = []
    for question in ["Hi! Who are you?", "What is 2+2?", "Name a color."]:
        messages.append({"role": "user", "content": question})
        text = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.apply_chat_template(messages)
        assert ids == tokenizer.hf.encode(text, add_special_tokens=False)
        out = asyncio.run(generate(ids))
        assert out.finish_reason in ("stop", "length") and out.token_ids
        turns.append((text, ids, out))
        messages.append({"role": "assistant", "content": out.text})

    # the history with each reply, rendered without a generation prompt, is a prefix of the next prompt too
    for n in range(len(turns) - 1):
        history = tokenizer.hf.apply_chat_template(messages[:2 * n + 2], add_generation_prompt=False, tokenize=False)
        assert turns[n + 1][0].encode().startswith(history.encode())

    eos, block_size = tokenizer.eos_token_ids, engine.engine.config.block_size
    for (text, ids, out), (next_text, next_ids, next_out) in zip(turns, turns[1:]):
        assert next_text.encode().startswith((text + out.text).encode())
        reply_ids = list(out.token_ids)
        assert (reply_ids[-1] in eos) == (out.finish_reason == "stop")  # a stopped reply ends with its EOS
        assert next_ids[:len(ids) + len(reply_ids)] == ids + reply_ids
        assert next_out.num_cached_tokens >= (len(ids) + len(reply_ids) - 1) // block_size * block_size
    assert wait_idle(engine)


# --- tools ------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CALL_TOKENS = {"temperature": 0, "max_tokens": 60}


def test_session_tool_settings_are_checked_and_kept(server):
    http, _ = server
    session = create(http, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert session["settings"] == {"system_prompt": None, "sampling": {}, "tools": [WEATHER],
                                   "tool_choice": "required", "parallel_tool_calls": False}
    assert get(http, session["id"]) == session
    named = {"type": "function", "function": {"name": "get_time"}}
    assert "get_time" in assert_error(http.post("/v1/sessions", json={"tools": [WEATHER], "tool_choice": named}),
                                      400, "tool_choice")["message"]
    assert_error(http.post("/v1/sessions", json={"tool_choice": "required"}), 400, "tool_choice")
    assert_error(http.post("/v1/sessions", json={"tools": [{"type": "custom", "custom": {}}]}), 400, "tools")
    # a change is checked with the settings it leaves: no tools left for a required call
    url = f"/v1/sessions/{session['id']}"
    assert_error(http.patch(url, json={"tools": None}), 400, "tool_choice")
    assert get(http, session["id"])["settings"]["tools"] == [WEATHER]  # nothing changed
    changed = http.patch(url, json={"tool_choice": "auto"}).json()["settings"]
    assert changed["tool_choice"] == "auto" and changed["tools"] == [WEATHER]
    cleared = http.patch(url, json={"tools": None, "tool_choice": None, "parallel_tool_calls": None}).json()
    assert cleared["settings"] == {"system_prompt": None, "sampling": {}}
    # a tool result needs an open call, and a user message takes no tool_call_id
    messages = f"{url}/messages"
    assert_error(http.post(messages, json={"role": "tool", "content": "12 C"}), 400, "tool_call_id")
    assert_error(http.post(messages, json={"content": "hi", "tool_call_id": "call_1"}), 400, "tool_call_id")
    assert_error(http.post(messages, json={"role": "tool", "content": "12 C", "tool_call_id": "call_1"}),
                 400, "tool_call_id")
    assert_error(http.post(messages, json={"content": "hi", "tool_choice": "required"}), 400, "tool_choice")
    assert get(http, session["id"])["messages"] == []


def test_a_tool_conversation_in_a_session(server, engine):
    """Call (forced, so its arguments validate even on a 135M model) -> the client's result -> the answer; stored
    with the calls, rendered as /v1/chat/completions renders the same conversation."""
    import jsonschema

    http, _ = server
    session = create(http, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, sampling=CALL_TOKENS)
    question = "What is the weather like in Paris today?"
    whole = post_whole(http, session["id"], content=question)
    user, reply = whole["user"], whole["message"]
    assert reply["finish_reason"] == "tool_calls" and reply["content"] == "", reply
    [call] = reply["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert get(http, session["id"])["messages"] == [user, reply]

    # the result (streamed reply) answers the call; this reply may answer in prose
    result = json.dumps({"city": "Paris", "temperature": 21, "sky": "sunny"})
    url = f"/v1/sessions/{session['id']}/messages"
    assert_error(http.post(url, json={"role": "tool", "content": result, "tool_call_id": "call_other"}),
                 400, "tool_call_id")
    events = post_stream(http, session["id"], role="tool", content=result, tool_call_id=call["id"],
                         tool_choice="none")
    assert [e if isinstance(e, str) else e["type"] for e in (events[0], events[-2], events[-1])] == [
        "tool", "done", "[DONE]"], events
    posted, answer = events[0]["message"], events[-2]["message"]
    assert (posted["role"], posted["content"], posted["tool_call_id"]) == ("tool", result, call["id"])
    assert answer["role"] == "assistant" and answer["content"] and "tool_calls" not in answer
    assert answer["content"] == "".join(e.get("content", "") for e in events[1:-2])
    assert get(http, session["id"])["messages"] == [user, reply, posted, answer]
    assert_error(http.post(url, json={"role": "tool", "content": result, "tool_call_id": call["id"]}),
                 400, "tool_call_id")  # answered already

    # the same conversation sent whole to /v1/chat/completions: the same prompt and reply
    history = [{"role": "user", "content": question},
               {"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]},
               {"role": "tool", "content": result, "tool_call_id": call["id"]}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "tools": [WEATHER],
                                                "tool_choice": "none", **CALL_TOKENS})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == posted["prompt_tokens"] == answer["prompt_tokens"]
    assert r.json()["choices"][0]["message"]["content"] == answer["content"]
    assert wait_idle(engine)


def test_a_reply_with_parallel_calls_waits_for_every_result(server, engine):
    """A reply that made two calls: the first result is stored and the reply waits; the second starts it."""
    http, app = server
    session = create(http, tools=[WEATHER], sampling=GREEDY)
    conversations = app.state.chat.conversations
    conversations.add_message(session["id"], "user", "Weather in Oslo and Rome?")
    calls = [{"id": f"call_{city}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
             for city in ("oslo", "rome")]
    conversations.add_message(session["id"], "assistant", "", tool_calls=calls, finish_reason="tool_calls")
    url = f"/v1/sessions/{session['id']}/messages"
    first = post_whole(http, session["id"], role="tool", content="3 C", tool_call_id="call_oslo")
    assert first["awaiting_tool_results"] == ["call_rome"] and "message" not in first
    assert first["tool"]["tool_call_id"] == "call_oslo"
    assert_error(http.post(url, json={"role": "tool", "content": "3 C", "tool_call_id": "call_oslo"}),
                 400, "tool_call_id")
    events = post_stream(http, session["id"], role="tool", content="19 C", tool_call_id="call_rome")
    assert events[0]["type"] == "tool" and events[-2]["type"] == "done"
    stored = get(http, session["id"])["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in stored] == [
        ("user", None), ("assistant", None), ("tool", "call_oslo"), ("tool", "call_rome"), ("assistant", None)]
    # a streamed first result says the same
    conversations.add_message(session["id"], "assistant", "", tool_calls=calls[:1] + [dict(calls[1], id="call_b")])
    waiting = post_stream(http, session["id"], role="tool", content="4 C", tool_call_id="call_oslo")
    assert [e if isinstance(e, str) else e["type"] for e in waiting] == ["tool", "awaiting_tool_results", "[DONE]"]
    assert waiting[1]["tool_call_ids"] == ["call_b"]
    assert wait_idle(engine)


# --- branches ---------------------------------------------------------------------------------------------

SHORT = {"temperature": 0, "max_tokens": 6}


def test_edit_switch_back_and_regenerate_keep_every_branch(sqlite_server, engine):
    """Edit the second message (a new branch), switch back to the first branch: its messages are intact and the
    next message there finds the branch's whole history in the prefix cache; regenerated replies are siblings."""
    http, _ = sqlite_server
    session = create(http, sampling=SHORT)
    sid, url = session["id"], f"/v1/sessions/{session['id']}"
    block_size = engine.engine.config.block_size
    post_whole(http, sid, content="What is the capital of France?")
    second = post_whole(http, sid, content="And the capital of Italy?")
    first_branch = get(http, sid)["messages"]
    u1, a1, u2, a2 = first_branch
    assert [m["parent_id"] for m in first_branch] == [None, u1["id"], a1["id"], u2["id"]]
    assert all(m["siblings"] == [m["id"]] for m in first_branch)

    # edit the second message: the new text follows a1, beside u2; it and its reply are shown
    edit = post_stream(http, sid, content="And the capital of Spain?", parent_id=a1["id"])
    done = check_reply_events(edit, "And the capital of Spain?")
    u2b, a2b = edit[0]["message"], done["message"]
    assert (u2b["parent_id"], u2b["siblings"]) == (a1["id"], [u2["id"], u2b["id"]])
    assert (a2b["parent_id"], a2b["siblings"]) == (u2b["id"], [a2b["id"]])
    edited = get(http, sid)
    assert edited["messages"] == [u1, a1, u2b, a2b] and edited["current_message_id"] == a2b["id"]
    assert done["usage"]["prompt_tokens"] < second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"]

    # back to the first branch (through u2: down to its reply a2), intact
    switched = http.patch(url, json={"current_message_id": u2["id"]})
    assert switched.status_code == 200, switched.text
    u2_now = {**u2, "siblings": [u2["id"], u2b["id"]]}
    assert switched.json()["messages"] == [u1, a1, u2_now, a2] and switched.json()["current_message_id"] == a2["id"]
    assert http.get(f"{url}/messages").json()["data"] == [u1, a1, u2_now, a2]
    third = post_whole(http, sid, content="Which of the two is larger?")
    assert third["user"]["parent_id"] == a2["id"]
    previous, usage = second["usage"], third["usage"]
    # the first branch's prompt and reply (but the reply's last token) are this prompt's prefix, cached
    assert usage["prompt_tokens"] > previous["prompt_tokens"] + previous["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (
        previous["prompt_tokens"] + previous["completion_tokens"] - 1) // block_size * block_size > 0
    u3, a3 = third["user"], third["message"]
    assert get(http, sid)["messages"] == [u1, a1, u2_now, a2, u3, a3]

    # regenerate a3 (an empty body: streamed, the session's sampling): another reply to u3, beside a3
    with http.stream("POST", f"{url}/messages/{a3['id']}/regenerate") as r:
        assert r.status_code == 200, r.read().decode()
        events = parse_sse(r.iter_lines())
    assert [e if isinstance(e, str) else e["type"] for e in (events[0], events[-2], events[-1])] == [
        "delta", "done", "[DONE]"], events
    again = events[-2]["message"]
    assert again["content"] == "".join(e["content"] for e in events[:-2])
    assert (again["parent_id"], again["siblings"]) == (u3["id"], [a3["id"], again["id"]])
    redo = events[-2]["usage"]
    assert redo["prompt_tokens"] == usage["prompt_tokens"]  # the same history: its whole prompt is cached
    assert redo["prompt_tokens_details"]["cached_tokens"] >= (redo["prompt_tokens"] - 1) // block_size * block_size
    # regenerate the user message u3 itself, not streamed: a third reply
    r = http.post(f"{url}/messages/{u3['id']}/regenerate", json={"stream": False, "max_tokens": 3})
    assert r.status_code == 200, r.text
    whole = r.json()
    assert {"message", "usage", "timings"} <= set(whole) and "user" not in whole
    assert whole["message"]["siblings"] == [a3["id"], again["id"], whole["message"]["id"]]
    assert whole["usage"]["completion_tokens"] <= 3
    assert get(http, sid)["messages"] == [u1, a1, u2_now, a2, u3, whole["message"]]

    # edit the first message: a new root
    root = post_whole(http, sid, content="Hello!", parent_id=None, max_tokens=2)
    assert (root["user"]["parent_id"], root["user"]["siblings"]) == (None, [u1["id"], root["user"]["id"]])
    assert [m["id"] for m in get(http, sid)["messages"]] == [root["user"]["id"], root["message"]["id"]]
    every = http.get(f"{url}/messages", params={"branches": "all"}).json()["data"]
    assert [m["id"] for m in every] == sorted(m["id"] for m in every)
    by_id = {m["id"]: m for m in every}
    for message in (u1, a1, u2, a2, u2b, a2b, u3, a3, again):  # as they were stored (siblings came since)
        assert by_id[message["id"]] == {**message, "siblings": by_id[message["id"]]["siblings"]}
    assert by_id[a3["id"]]["siblings"] == [a3["id"], again["id"], whole["message"]["id"]]
    assert len(every) == 12 and get(http, sid)["title"] == "What is the capital of France?"
    assert wait_idle(engine)


def test_bad_branch_requests_are_refused_and_change_nothing(server, engine):
    http, app = server
    conversations = app.state.chat.conversations
    session, other = create(http, sampling=SHORT), create(http)
    sid, url = session["id"], f"/v1/sessions/{session['id']}"
    u1 = conversations.add_message(sid, "user", "Hi")
    conversations.add_message(sid, "assistant", "Hello! How can I help?")
    foreign = conversations.add_message(other["id"], "user", "theirs")
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for n in (1, 2)]
    conversations.add_message(sid, "user", "Call both.")
    conversations.add_message(sid, "assistant", "", tool_calls=calls, finish_reason="tool_calls")
    half = conversations.add_message(sid, "tool", "one", tool_call_id="call_1")  # call_2 still open
    before = get(http, sid)
    every = http.get(f"{url}/messages", params={"branches": "all"}).json()["data"]

    for body in ({"parent_id": 10**6}, {"parent_id": foreign.id}, {"parent_id": "first"},
                 {"parent_id": u1.id}):  # a user message under a user message
        assert "parent_id" in assert_error(http.post(f"{url}/messages", json={"content": "x", **body}),
                                           400, "parent_id")["message"]
    for body in ({"current_message_id": 10**6}, {"current_message_id": foreign.id},
                 {"current_message_id": None}, {"current_message_id": "x"},
                 {"title": "Renamed", "current_message_id": 10**6}):
        assert_error(http.patch(url, json=body), 400, "current_message_id")
    for message_id in (10**6, foreign.id):
        error = assert_error(http.post(f"{url}/messages/{message_id}/regenerate", json={}), 404, "message_id")
        assert error["code"] == "message_not_found"
    assert_error(http.post(f"{url}/messages/{half.id}/regenerate", json={}), 400, "message_id")  # call_2 open
    assert_error(http.post(f"{url}/messages/first/regenerate", json={}), 400, "message_id")
    assert_error(http.post(f"{url}/messages/{u1.id}/regenerate", json={"n": 2}), 400, "n")
    assert_error(http.post(f"{url}/messages/{u1.id}/regenerate", json={"temperature": 9}), 400, "temperature")
    assert_error(http.post(f"{url}/messages/{u1.id}/regenerate", json={"bogus": 1}), 400, "bogus")
    assert_error(http.post("/v1/sessions/nope/messages/1/regenerate", json={}), 404, "session_id")
    assert_error(http.get(f"{url}/messages", params={"branches": "some"}), 400, "branches")

    assert get(http, sid) == before  # nothing stored, renamed or switched
    assert http.get(f"{url}/messages", params={"branches": "all"}).json()["data"] == every
    assert wait_idle(engine)


# --- sampling settings ------------------------------------------------------------------------------------

def test_message_fields_override_the_session_sampling(sqlite_server, engine):
    http, _ = sqlite_server
    # ignore_eos makes the reply run to its limit, so the limit in force is visible exactly
    session = create(http, sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    first = post_whole(http, session["id"], content="Tell me a long story about a dragon.")
    assert first["usage"]["completion_tokens"] == 5 and first["message"]["finish_reason"] == "length"
    # max_tokens 3 from the message; the session's other settings (ignore_eos, temperature) still apply
    second = post_whole(http, session["id"], content="Go on.", max_tokens=3)
    assert second["usage"]["completion_tokens"] == 3 and second["message"]["finish_reason"] == "length"
    # the override was for that message only: the session's settings are unchanged
    assert get(http, session["id"])["settings"]["sampling"] == {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    # a changed setting applies to the next message (streamed this time)
    r = http.patch(f"/v1/sessions/{session['id']}", json={"sampling": {"temperature": 0, "max_tokens": 2,
                                                                       "ignore_eos": True}})
    assert r.status_code == 200, r.text
    done = check_reply_events(post_stream(http, session["id"], content="Again."), "Again.")
    assert done["usage"]["completion_tokens"] == 2
    assert len(get(http, session["id"])["messages"]) == 6
    assert wait_idle(engine)


# --- long conversations ---------------------------------------------------------------------------------

def test_a_session_longer_than_the_context_leaves_its_oldest_turns_out_and_says_so(sqlite_server, engine):
    """A session outgrows the 512-token context: its reply's prompt leaves the oldest whole turns out (they stay
    stored) instead of a 400, the reply says so (the done event's context_truncated, the header), the next turn keeps
    that start (its prompt read from the prefix cache), and the browser UI's chat shows a notice."""
    from kvforge.app.generate.context_fit import FIELD, HEADER

    http, app = sqlite_server
    session = create(http, system_prompt="You are terse.", sampling={"temperature": 0, "max_tokens": 4})
    url = f"/v1/sessions/{session['id']}/messages"
    asked = 0
    for asked in range(1, 9):
        r = http.post(url, json={"content": f"Question {asked}: " + "describe the box, its colour and size. " * 10,
                                 "stream": False})
        assert r.status_code == 200, r.text
        if FIELD in r.json():
            break
    cut = r.json()[FIELD]
    assert asked > 2 and cut["dropped_messages"] == 2 * cut["dropped_turns"] > 0  # whole turns (question, reply)
    assert int(r.headers[HEADER]) == cut["dropped_messages"] and r.json()["usage"]["prompt_tokens"] < MAX_MODEL_LEN
    assert len(get(http, session["id"])["messages"]) == 2 * asked  # nothing left out of the store

    with http.stream("POST", url, json={"content": "And its history?"}) as streamed:
        assert streamed.headers[HEADER] == r.headers[HEADER]
        done = parse_sse(streamed.iter_lines())[-2]
    assert done[FIELD] == cut and done["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        r.json()["usage"]["prompt_tokens"] - engine.engine.config.block_size

    from kvforge.ui.chat import ChatHandlers
    from kvforge.ui.service import UIService

    handlers = ChatHandlers(UIService(app.state.chat, None))

    async def send() -> list[tuple]:
        return [shown async for shown in handlers.send("Thanks.", session["id"], "You are terse.", 0.0, 1.0, 4,
                                                       False)]

    shown = asyncio.run(send())
    assert "Older messages were left out of the model's context" in shown[0][2]  # from the reply's start
    assert shown[-1][2].startswith("Last reply:") and "left out" in shown[-1][2]

    # the replies keep what their prompts left out: the API returns it, and the chat says it again once reloaded
    replies = [m for m in get(http, session["id"])["messages"] if m["role"] == "assistant"]
    assert replies[-2][FIELD] == cut and FIELD not in replies[0]
    reloaded = handlers.show(session["id"])
    assert reloaded[3] == shown[-1][2]  # the stats and the notice, as when the reply ended
    assert "older messages left out" in json.loads(
        reloaded[-1].split('data-titles="')[1].split('"')[0].replace("&quot;", '"'))[-1]  # the reply's tooltip
    assert wait_idle(engine)


def test_a_session_fits_its_turns_to_its_num_ctx(sqlite_server, engine):
    """num_ctx, Ollama's option, as a session's setting and a reply's field: the session's turns are fitted to that
    window (the oldest whole turns left out, the reply saying so), a reply's num_ctx wins over the session's, a newest
    turn that cannot fit is a 400 naming num_ctx with nothing stored, and bad values are a 400 naming num_ctx."""
    from kvforge.app.generate.context_fit import FIELD, HEADER

    http, _ = sqlite_server
    for bad in (0, -5, "many", 1.5):
        assert_error(http.post("/v1/sessions", json={"num_ctx": bad}), 400, "num_ctx")
    window = 128
    session = create(http, system_prompt="You are terse.", num_ctx=window,
                     sampling={"temperature": 0, "max_tokens": 4})
    assert session["settings"]["num_ctx"] == window
    url = f"/v1/sessions/{session['id']}/messages"

    def ask(n: int, **fields) -> httpx.Response:
        return http.post(url, json={"content": f"Question {n}: " + "describe the box, its colour and size. " * 3,
                                    "stream": False, **fields})

    replies = [ask(n) for n in range(3)]  # about 50 tokens a turn: the third outgrows the window
    assert all(r.status_code == 200 for r in replies), replies[-1].text
    assert FIELD not in replies[0].json() and HEADER not in replies[0].headers
    cut = replies[-1].json()[FIELD]
    assert cut["dropped_messages"] == 2 * cut["dropped_turns"] > 0 and int(replies[-1].headers[HEADER]) == \
        cut["dropped_messages"]
    assert replies[-1].json()["usage"]["prompt_tokens"] <= window - 4

    whole = ask(3, num_ctx=MAX_MODEL_LEN)  # this reply's window instead of the session's: the history fits it
    assert whole.status_code == 200 and FIELD not in whole.json(), whole.text
    assert whole.json()["usage"]["prompt_tokens"] > window
    stored = len(get(http, session["id"])["messages"])
    error = assert_error(ask(4, num_ctx=20), 400, "num_ctx")  # not even the newest turn fits
    assert error["code"] == "context_length_exceeded" and len(get(http, session["id"])["messages"]) == stored
    assert_error(ask(4, num_ctx=0), 400, "num_ctx")
    last = get(http, session["id"])["messages"][-1]["id"]
    assert_error(http.post(f"{url}/{last}/regenerate", json={"num_ctx": "big"}), 400, "num_ctx")
    again = http.post(f"{url}/{last}/regenerate", json={"stream": False})  # the session's window again
    assert again.status_code == 200 and again.json()[FIELD]["dropped_turns"] > 0, again.text

    assert_error(http.patch(f"/v1/sessions/{session['id']}", json={"num_ctx": 0}), 400, "num_ctx")
    r = http.patch(f"/v1/sessions/{session['id']}", json={"num_ctx": None})  # null: the model's context again
    assert r.status_code == 200 and "num_ctx" not in r.json()["settings"], r.text
    assert wait_idle(engine)


# --- disconnect -------------------------------------------------------------------------------------------

def test_disconnect_mid_reply_keeps_the_partial_reply(server, engine):
    http, app = server
    session = create(http, sampling={"temperature": 0})
    question = "Write a long story about a dragon."
    body = {"content": question, "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=str(http.base_url), timeout=60) as own_connection:
        with own_connection.stream("POST", f"/v1/sessions/{session['id']}/messages", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                events += parse_sse([line])
                if events and events[-1]["type"] == "delta":
                    break  # hang up after the first piece of the reply
    user, first_delta = events[0]["message"], events[-1]["content"]
    assert [e["type"] for e in events] == ["user", "delta"]

    assert wait_idle(engine), f"the abandoned reply still runs or holds {engine.engine.block_pool.num_used} blocks"
    assert_idle(engine)  # every KV block back in the pool
    messages = wait_for(lambda: len(m := get(http, session["id"])["messages"]) == 2 and m)
    assert messages, "the partial reply was not stored"
    assert messages[0] == user
    partial = messages[1]
    assert partial["role"] == "assistant" and partial["finish_reason"] == "abort"
    assert partial["content"].startswith(first_delta) and partial["content"]
    assert len(engine.tokenizer.encode(partial["content"])) < 200
    assert wait_for(lambda: app.state.host.in_flight == 0), "the aborted reply still holds the model"

    # the conversation goes on after the partial reply, which is part of the next prompt
    follow_up = post_whole(http, session["id"], content="Please finish it.", max_tokens=2)
    assert follow_up["user"]["prompt_tokens"] > user["prompt_tokens"] + len(engine.tokenizer.encode(partial["content"]))
    assert [m["id"] for m in get(http, session["id"])["messages"]] == [
        user["id"], partial["id"], follow_up["user"]["id"], follow_up["message"]["id"]]


# --- concurrency ------------------------------------------------------------------------------------------

COUNTRIES = ["France", "Germany", "Japan", "Egypt"]


async def generate_alone(engine: AsyncEngine, messages: list[dict]):
    """The greedy reply to `messages` on an otherwise idle engine, with each position's top-5 logprobs."""
    params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], logprobs=5)
    async for out in engine.add_request(engine.tokenizer.apply_chat_template(messages), params):
        final = out
    return final


def test_concurrent_sessions_burst(server, engine):
    http, _ = server
    sessions = [create(http, sampling=GREEDY)["id"] for _ in COUNTRIES]

    async def post(client: httpx.AsyncClient, session_id: str, question: str) -> list:
        async with client.stream("POST", f"/v1/sessions/{session_id}/messages", json={"content": question}) as r:
            assert r.status_code == 200
            return parse_sse([line async for line in r.aiter_lines()])

    async def burst() -> list[list]:
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=120) as client:
            return await asyncio.gather(*(post(client, s, f"What is the capital of {c}?")
                                          for s, c in zip(sessions, COUNTRIES)))

    results = asyncio.run(burst())
    for session_id, country, events in zip(sessions, COUNTRIES, results):
        question = f"What is the capital of {country}?"
        done = check_reply_events(events, question)
        reply = done["message"]["content"]
        assert not any(other in reply for other in COUNTRIES if other != country), reply  # no cross-talk
        # the reply the same question gets alone (in bf16 up to a near-tie: batched matmuls round otherwise)
        alone = asyncio.run(generate_alone(engine, [{"role": "user", "content": question}]))
        if engine.engine.config.torch_dtype == torch.float32:
            assert done["token_ids"] == alone.token_ids, country
        else:
            assert same_or_near_tie(done["token_ids"], alone, country) is None
        assert done["message"]["finish_reason"] in ("stop", "length")
        stored = get(http, session_id)
        assert stored["messages"] == [events[0]["message"], done["message"]]
        assert stored["title"] == question
    assert wait_idle(engine)
