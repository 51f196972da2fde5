"""A conversation survives a restart of `kvforge serve` — a crash (kill -9) on SQLite, graceful (SIGTERM)
on PostgreSQL: the history is intact, the next turn is served from the persisted KV
(>= 90% of the history cached), and its greedy reply equals the same conversation with every cache off.

A crash mid-reply leaves a user message that nothing answered: the next message is merged with it into one user
turn (app/sessions/service.py), so a template that requires alternating turns (Gemma's, on a tiny random model) renders
the conversation after the restart. And stopping ends the process within its deadline whatever its threads do: a
download stuck on a Hub that never answers (Ctrl-C), a thread that holds the interpreter (SIGTERM; the exit
watchdog kills it)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvforge.app.cli.serve import GRACEFUL_SHUTDOWN_S, SHUTDOWN_DEADLINE_S
from kvforge.core.chat_templates import GEMMA
from tests.helpers.parity import same_or_near_tie
from tests.helpers.server_process import ServeProcess
from tests.helpers.tiny_models import save_tiny_model, tiny_configs

USER_MESSAGES = [
    "I am planning a vegetable garden on a small balcony that gets about five hours of direct sun in the "
    "afternoon. I would like to grow tomatoes, basil and some lettuce. What should I think about first when I "
    "choose containers and soil, and how often should I water them during a warm summer?",
    "Thanks. The balcony is on the fourth floor and it can be quite windy in spring. Which of those plants "
    "will cope best with the wind, and is there anything simple I can build or buy to protect the tomatoes "
    "without blocking too much of the light they need?",
    "Good ideas. Last year my basil flowered very early and the leaves became bitter. What did I do wrong, "
    "and how should I harvest it so that the plants keep producing fresh leaves for the whole season?",
    "Finally, could you give me a short weekly checklist for the garden that covers watering, feeding, "
    "pruning and checking for pests, so that I do not forget anything important when I am busy?",
]
SYSTEM_PROMPT = "You are a friendly gardening assistant. Answer in a few clear sentences."
UNANSWERED = "Tell me a very long story about a gardener."  # the message a crash leaves without a reply
MAX_TOKENS = 16


class Server(ServeProcess):
    def __init__(self, data_dir, db_url: str) -> None:
        # README command 1 but for --db, the store under test (SQLite, PostgreSQL)
        super().__init__("--data-dir", str(data_dir), "--db", db_url)

    def wait_persisted(self) -> None:
        """The background writer has written every block queued so far."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.metric("kv_disk_pending") == 0 and self.metric("kv_disk_blocks") > 0:
                return
            time.sleep(0.1)
        raise AssertionError("persisted KV writes did not finish")

    def turn(self, session_id: str, content: str) -> dict:
        payload = {"content": content, "max_tokens": MAX_TOKENS}
        with httpx.stream("POST", f"{self.url}/v1/sessions/{session_id}/messages", json=payload, timeout=120) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["type"] == "done", events[-1]
        return events[-1]


def stream_until_first_delta(server: ServeProcess, session_id: str, max_tokens: int) -> threading.Thread:
    """A long reply streaming in a thread (which ends when the server does), returned once its first delta came."""
    first_delta = threading.Event()

    def stream() -> None:
        payload = {"content": UNANSWERED, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/sessions/{session_id}/messages", json=payload,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if '"delta"' in line:
                        first_delta.set()
        except httpx.HTTPError:
            pass  # the server died under us: expected

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_delta.wait(60)
    return reader


def kill_mid_reply(server: ServeProcess, session_id: str) -> None:
    """kill -9 while a long reply streams and its KV blocks are being written."""
    reader = stream_until_first_delta(server, session_id, max_tokens=400)
    time.sleep(0.5)  # mid-reply: some blocks written, some queued
    server.stop("sigkill")
    reader.join(timeout=30)


@pytest.fixture(scope="module")
def reference_llm(embedded_path):
    from kvforge.core import LLM

    return LLM(str(embedded_path), progress=False, enable_prefix_caching=False, kv_cache_bytes=128 << 20)


# Each database with one way of stopping (the four pairs cost two minutes of CI for little more): a crash on
# SQLite, whose file is then checked for integrity, and a graceful stop on PostgreSQL.
@pytest.mark.parametrize("db_url, how", [("sqlite", "sigkill"), ("postgresql", "sigterm")], indirect=["db_url"])
def test_conversation_survives_restart(how, tmp_path, db_url, reference_llm):
    from kvforge.core.sampling import SamplingParams

    server = Server(tmp_path / "data", db_url)
    try:
        session = httpx.post(f"{server.url}/v1/sessions", json={
            "system_prompt": SYSTEM_PROMPT, "sampling": {"temperature": 0}}, timeout=10).json()
        for content in USER_MESSAGES[:3]:
            server.turn(session["id"], content)
        before = httpx.get(f"{server.url}/v1/sessions/{session['id']}", timeout=10).json()["messages"]
        if how == "sigkill":
            server.wait_persisted()  # a crash loses what is still queued; a graceful stop writes it first
            kill_mid_reply(server, session["id"])
        else:
            server.stop(how)
    finally:
        if server.process.poll() is None:
            server.process.kill()

    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.removeprefix("sqlite:///")) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    server = Server(tmp_path / "data", db_url)
    try:
        history = httpx.get(f"{server.url}/v1/sessions/{session['id']}", timeout=10).json()["messages"]
        assert [(m["role"], m["content"]) for m in history[:6]] == [(m["role"], m["content"]) for m in before]
        if how == "sigkill":  # the interrupted turn: its user message was stored, its reply kept or not at all
            assert history[6]["role"] == "user" and len(history) in (7, 8)
        done = server.turn(session["id"], USER_MESSAGES[3])
        assert server.metric("kv_disk_loaded_blocks") > 0

        tokenizer = reference_llm.tokenizer
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] + [
            {"role": m["role"], "content": m["content"]} for m in history]
        history_tokens = len(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * history_tokens, (cached, history_tokens)

        if messages[-1]["role"] == "user":  # the crash left it unanswered: the next message joins it in one turn
            asked = messages[:-1] + [{"role": "user", "content": f"{messages[-1]['content']}\n\n{USER_MESSAGES[3]}"}]
        else:
            asked = messages + [{"role": "user", "content": USER_MESSAGES[3]}]
        prompt = tokenizer.apply_chat_template(asked)
        assert done["usage"]["prompt_tokens"] == len(prompt)
        expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5))[0]
        if reference_llm.engine.config.dtype == "float32":
            assert done["token_ids"] == expected.token_ids
            assert done["message"]["content"] == expected.text
        else:  # the default on a CPU with native bf16: a near-tie may round either way (tests/core/test_dtypes.py)
            assert same_or_near_tie(done["token_ids"], expected, "after the restart") is None
    finally:
        server.stop("sigterm")


# --- a tiny model whose template requires alternating turns; stopping with stuck threads ----------------------------

NEXT = "Make it about a lighthouse keeper instead."
GIL_HOLDER = Path(__file__).parents[1] / "helpers" / "gil_holder"  # its sitecustomize.py: test-only


@pytest.fixture(scope="module")
def alternating_model(tmp_path_factory, embedded_path) -> Path:
    """A tiny random Gemma 3 with Gemma's chat template, which raises unless user and assistant turns alternate."""
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma"
    config = tiny_configs()["gemma3"]
    config.max_position_embeddings = 4096  # room for a reply long enough to be cut
    save_tiny_model("gemma3", path, embedded_path, seed=7, config=config)
    (path / "chat_template.jinja").write_text(GEMMA)
    return path


def tiny_server(model: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> ServeProcess:
    return ServeProcess("--model", str(model), "--no-ui", "--data-dir", str(data_dir), "--kv-cache-gb", "0.05", *args,
                        env=env)


def test_a_server_stuck_mid_reply_then_restarted_the_unanswered_message_joins_the_next(tmp_path, alternating_model):
    """A thread that holds the interpreter mid-reply (tests/helpers/gil_holder: no Python code of the server runs
    again, its signal handlers included): SIGTERM, and the exit watchdog kills the process (-9) at the deadline.
    Restarted on the same data: the cut turn's user message has no reply, and the next message joins it in one user
    turn, which Gemma's template renders. Then Ctrl-C while a pull waits on a Hub that never answers: the process
    ends after the graceful timeout without waiting for that thread."""
    trigger = tmp_path / "hold-the-interpreter"
    paths = [str(GIL_HOLDER), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    server = tiny_server(alternating_model, tmp_path / "data",
                         env={"PYTHONPATH": os.pathsep.join(paths), "KVFORGE_TEST_HOLD_GIL_FILE": str(trigger)})
    try:
        session = httpx.post(f"{server.url}/v1/sessions", json={"sampling": {"temperature": 0}}, timeout=30).json()
        reader = stream_until_first_delta(server, session["id"], max_tokens=4000)
        trigger.touch()
        time.sleep(0.3)
        with pytest.raises(httpx.TimeoutException):  # held: nothing answers
            httpx.get(f"{server.url}/health", timeout=1)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=SHUTDOWN_DEADLINE_S + 30)
        elapsed = time.monotonic() - start
        assert code == -signal.SIGKILL and elapsed < SHUTDOWN_DEADLINE_S + 2, (code, elapsed)
        assert f"still running {SHUTDOWN_DEADLINE_S} s after the signal to stop" in server.output()
        reader.join(timeout=30)
    finally:
        if server.process.poll() is None:
            server.process.kill()

    with socket.create_server(("127.0.0.1", 0)) as hub:  # a Hub endpoint that takes connections and never answers
        server = tiny_server(alternating_model, tmp_path / "data", "--models-dir", str(tmp_path / "models"),
                             env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}"})
        try:
            url = f"{server.url}/v1/sessions/{session['id']}/messages"
            stored = httpx.get(url, timeout=30).json()["data"]
            assert [(m["role"], m["content"]) for m in stored] == [("user", UNANSWERED)]  # no reply was kept
            reply = httpx.post(url, json={"content": NEXT, "stream": False, "max_tokens": 8}, timeout=120)
            assert reply.status_code == 200, reply.text  # before: 400, "Conversation roles must alternate"
            assert [m["role"] for m in httpx.get(url, timeout=30).json()["data"]] == ["user", "user", "assistant"]
            # the prompt was the two messages as one user turn: the same request through the chat route answers alike
            same = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"{UNANSWERED}\n\n{NEXT}"}], "temperature": 0,
                "max_tokens": 8}).json()
            assert reply.json()["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
            assert reply.json()["message"]["content"] == same["choices"][0]["message"]["content"]
            following = httpx.post(url, json={"content": "Thanks.", "stream": False, "max_tokens": 4}, timeout=120)
            assert following.status_code == 200, following.text  # and the turns alternate from there on

            pull = threading.Thread(target=lambda: httpx.post(f"{server.url}/api/pull", timeout=60,
                                                              json={"model": "owner/name", "stream": False}))
            pull.start()
            assert select.select([hub], [], [], 30)[0], "the pull never reached the Hub"
            start = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            code = server.process.wait(timeout=SHUTDOWN_DEADLINE_S + 20)
            elapsed = time.monotonic() - start
            assert code == -signal.SIGINT and elapsed < GRACEFUL_SHUTDOWN_S + 3, (code, elapsed, server.output())
            pull.join(timeout=30)
        finally:
            if server.process.poll() is None:
                server.process.kill()
