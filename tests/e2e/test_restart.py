"""A conversation survives a restart of `kvforge serve` — a crash (kill -9) on SQLite, graceful (SIGTERM)
on PostgreSQL: the history is intact, the next turn is served from the persisted KV
(>= 90% of the history cached), and its greedy reply equals the same conversation with every cache off."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest

from tests.helpers.parity import same_or_near_tie
from tests.helpers.server_process import ServeProcess

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
MAX_TOKENS = 40


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


def kill_mid_reply(server: Server, session_id: str) -> None:
    """kill -9 while a long reply streams and its KV blocks are being written."""
    first_delta = threading.Event()

    def stream() -> None:
        payload = {"content": "Tell me a very long story about a gardener.", "max_tokens": 400, "ignore_eos": True}
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

        prompt = tokenizer.apply_chat_template(messages + [{"role": "user", "content": USER_MESSAGES[3]}])
        assert done["usage"]["prompt_tokens"] == len(prompt)
        expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5))[0]
        if reference_llm.engine.config.dtype == "float32":
            assert done["token_ids"] == expected.token_ids
            assert done["message"]["content"] == expected.text
        else:  # the default on a CPU with native bf16: a near-tie may round either way (tests/core/test_dtypes.py)
            assert same_or_near_tie(done["token_ids"], expected, "after the restart") is None
    finally:
        server.stop("sigterm")
