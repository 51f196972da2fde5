"""Bounded work on a real `kvforge serve` with small limits (--max-pending 1, --header-timeout 1,
--request-timeout): admission is one gate for every entry point (OpenAI routes, the sessions API, the
browser UI through the official gradio_client), 503 with Retry-After when full; half-open connections are
closed; a request past its wall-clock limit is aborted and its KV freed.

Why not the default configuration: 256 admitted requests, a 10 s header timeout and no request timeout
are too large to reach in a test. The same gate runs with the defaults in every other server test; the
default header timeout is checked in test_security_default.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.api_checks import assert_openai_error
from tests.helpers.server_process import ServeProcess

REQUEST_TIMEOUT_S = 4  # the embedded model streams its first tokens well within it on a 2-core AVX2 CPU
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": 4000, "ignore_eos": True, "temperature": 0.7}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess("--data-dir", str(tmp_path_factory.mktemp("data")), "--max-pending", "1",
                       "--header-timeout", "1", "--request-timeout", str(REQUEST_TIMEOUT_S))
    yield srv
    srv.stop()


def wait_quiet(server: ServeProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["requests_admitted"] == m["requests_running"] == m["kv_blocks_used"] == 0:
            return
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.1)


def assert_busy(response: httpx.Response) -> None:
    assert response.status_code == 503, (response.status_code, response.text[:300])
    assert_openai_error(response)
    assert response.json()["error"]["code"] == "queue_full" and response.headers["retry-after"] == "1"


def test_every_entry_point_passes_one_admission(server):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gradio_client import Client

    ui = Client(f"{server.url}/", verbose=False)  # before the slot is taken: construction makes requests too
    session = httpx.post(f"{server.url}/v1/sessions", json={"title": "queue"}, timeout=30).json()["id"]
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                       json={**LONG, "stream": True}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # generating: the one slot is taken
        assert_busy(http.post(f"{server.url}/v1/chat/completions", json={**LONG, "max_tokens": 2}))
        assert_busy(http.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        for stream in (True, False):
            assert_busy(http.post(f"{server.url}/v1/sessions/{session}/messages",
                                  json={"content": "Hi", "max_tokens": 2, "stream": stream}))
        stored = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]
        with pytest.raises(Exception, match="busy"):
            # the chat box's value (text and pictures), system prompt, sampling, search
            ui.predict({"text": "Hi", "files": []}, "", 0.0, 1.0, 2, True, "", api_name="/send")
        assert httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"] == stored, "the UI stored a chat"
        assert server.metric("requests_admitted") == 1
    wait_quiet(server)
    assert httpx.get(f"{server.url}/v1/sessions/{session}", timeout=30).json()["messages"] == [], \
        "a refused turn stored its message"
    ok = httpx.post(f"{server.url}/v1/sessions/{session}/messages", timeout=60,
                    json={"content": "Hi", "max_tokens": 2, "stream": False})
    assert ok.status_code == 200, ok.text


def test_four_concurrent_session_messages_one_admitted(server):
    """The issue's case: four at once on the sessions API gave 4 x 200; now one runs and three are told to retry."""
    session = httpx.post(f"{server.url}/v1/sessions", json={"title": "four"}, timeout=30).json()["id"]
    barrier, results = threading.Barrier(4), []

    def post():
        barrier.wait()
        results.append(httpx.post(f"{server.url}/v1/sessions/{session}/messages", timeout=120,
                                  json={"content": "Count to twenty.", "max_tokens": 16, "ignore_eos": True,
                                        "stream": False}))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.status_code for r in results) == [200, 503, 503, 503], [r.text[:100] for r in results]
    for r in results:
        if r.status_code == 503:
            assert_busy(r)
    wait_quiet(server)


def test_half_open_connections_are_closed_after_the_header_timeout(server):
    sockets = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        if i % 3:  # part of a request head, then nothing; or nothing at all
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        sockets.append(s)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    closed = 0
    for s in sockets:
        try:
            closed += s.recv(1024) == b""  # the server closed it without an answer
        except ConnectionResetError:
            closed += 1
        finally:
            s.close()
    assert closed == len(sockets)
    # a slow but complete request still gets its answer
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    time.sleep(0.3)
    s.sendall(b"\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.close()


def test_a_request_past_the_timeout_is_aborted_and_frees_its_kv(server):
    start = time.monotonic()
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=120)
    assert whole.status_code == 504, whole.text[:300]
    assert_openai_error(whole)
    assert whole.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - start >= REQUEST_TIMEOUT_S
    wait_quiet(server)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout", events[-3:]
    assert any(json.loads(e)["choices"] and json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2])
    wait_quiet(server)
    # a conversation keeps the reply generated until the limit, marked as such
    session = httpx.post(f"{server.url}/v1/sessions", json={"title": "timeout"}, timeout=30).json()["id"]
    turn = httpx.post(f"{server.url}/v1/sessions/{session}/messages", timeout=120,
                      json={"content": LONG["messages"][0]["content"], "max_tokens": 4000, "ignore_eos": True,
                            "stream": False})
    assert turn.status_code == 504 and turn.json()["error"]["code"] == "request_timeout"
    stored = httpx.get(f"{server.url}/v1/sessions/{session}", timeout=30).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["finish_reason"] == "timeout"
    assert stored[1]["content"]
    wait_quiet(server)
