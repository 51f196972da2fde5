"""Closed doors on the default setup — `kvforge serve` as README command 1 starts it (no key, bound to
127.0.0.1; only --port and --data-dir added) — probed as a hostile web page or local program would: a
foreign Host (DNS rebinding, also in Chromium), foreign Origins and preflights (no CORS headers, Gradio's
included), a cross-origin page in Chromium, the body cap before parsing, /health answered while a
maximal request is tokenized, validation errors in words, and private data files."""

from __future__ import annotations

import http.server
import json
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvforge.app.dialects.openai.fields import MAX_MESSAGES, MAX_SYSTEM_PROMPT_CHARS
from kvforge.app.http.limits import DEFAULT_MAX_REQUEST_BYTES
from kvforge.core.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvforge.core.tokenizer import Tokenizer
from tests.helpers.api_checks import assert_openai_error
from tests.helpers.chromium import launch_browser
from tests.helpers.server_process import ServeProcess

REBINDING_NAME = "rebind.attacker.example"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    path.chmod(0o755)  # as an older version (or the default umask) left it: the server tightens it
    return path


@pytest.fixture(scope="module")
def server(data_dir):
    srv = ServeProcess("--data-dir", str(data_dir))
    yield srv
    srv.stop()


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


# --- Host: DNS rebinding -------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost.evil.example",
                                  "127.0.0.1.nip.example", "", "{port}"])
def test_a_foreign_host_is_refused_on_every_kind_of_route(server, host):
    host = host.format(port=server.port)
    for method, path in [("GET", "/v1/sessions"), ("GET", "/admin/models"), ("POST", "/admin/models/unload"),
                         ("GET", "/"), ("GET", "/config"), ("GET", "/gradio_api/info"), ("GET", "/metrics"),
                         ("GET", "/openapi.json"), ("GET", "/health")]:
        r = httpx.request(method, f"{server.url}{path}", headers={"Host": host}, timeout=30)
        assert r.status_code == 403, (method, path, host, r.status_code, r.text[:200])
        assert_openai_error(r)
        assert r.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in r.json()["error"]["message"]
        assert not cors_headers(r)
    assert httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"], "the model was unloaded"


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST:{port}",
                                  "kvforge.localhost:{port}", "localhost."])
def test_loopback_names_and_addresses_are_served(server, host):
    r = httpx.get(f"{server.url}/v1/sessions", headers={"Host": host.format(port=server.port)}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_rebinding_page_in_chromium_gets_403_and_no_data(server):
    """Chromium resolves the attacker's name to 127.0.0.1, as a rebinding DNS server would make it."""
    created = httpx.post(f"{server.url}/v1/sessions", json={"title": "private plans"}, timeout=30).json()
    with launch_browser(to_loopback=(REBINDING_NAME,)) as browser:
        page = browser.new_page()
        for path in ("/v1/sessions", f"/v1/sessions/{created['id']}", "/"):
            response = page.goto(f"http://{REBINDING_NAME}:{server.port}{path}")
            assert response.status == 403, (path, response.status)
            assert "private plans" not in page.content() and "is not allowed" in page.content()


# --- Origin: cross-origin pages, CORS -------------------------------------------------------------------

@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://evil.example", "null",
                                    "http://127.0.0.1:{other}", "https://127.0.0.1:{port}"])
def test_a_foreign_origin_is_refused_and_gets_no_cors_headers(server, origin):
    origin = origin.format(port=server.port, other=server.port + 1)
    for path in ("/v1/sessions", "/v1/chat/completions", "/gradio_api/queue/join", "/config", "/admin/models/load"):
        preflight = httpx.options(f"{server.url}{path}", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})
        assert preflight.status_code == 403 and not cors_headers(preflight), (path, preflight.headers)
        assert_openai_error(preflight)
        assert preflight.json()["error"]["code"] == "origin_not_allowed"
        simple = httpx.post(f"{server.url}{path}", content=b'{"title": "csrf"}', timeout=30,
                            headers={"Origin": origin, "content-type": "text/plain"})
        assert simple.status_code == 403 and not cors_headers(simple), (path, simple.status_code)
    titles = [s["title"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]]
    assert "csrf" not in titles


def test_same_origin_requests_pass_without_cors_headers(server):
    r = httpx.get(f"{server.url}/v1/sessions", headers={"Origin": server.url}, timeout=30)
    assert r.status_code == 200 and not cors_headers(r)
    page = httpx.get(f"{server.url}/", headers={"Origin": server.url}, timeout=30)  # Gradio's CORS layer is gone too
    assert page.status_code == 200 and not cors_headers(page)


class _PageHandler(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args):
        pass


def test_a_page_on_another_origin_in_chromium_cannot_read_or_write(server):
    """A page served from another port of 127.0.0.1 (another origin) tries to read the conversations and
    to create one with a CORS-free "simple" POST (the classic CSRF): the read fails in the browser, the
    write is refused by the server."""
    httpx.post(f"{server.url}/v1/sessions", json={"title": "only mine"}, timeout=30)
    script = f"""<!doctype html><title>attacker</title><script>
      const kv = "{server.url}";
      window.result = (async () => {{
        let read;
        try {{ read = "read: " + await (await fetch(kv + "/v1/sessions")).text(); }}
        catch (e) {{ read = "blocked: " + e.name; }}
        await fetch(kv + "/v1/sessions", {{method: "POST", mode: "no-cors", headers: {{"content-type": "text/plain"}},
                                           body: JSON.stringify({{title: "written by attacker"}})}});
        return read;
      }})();
    </script>"""
    handler = type("Page", (_PageHandler,), {"page": script.encode()})
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        with launch_browser() as browser:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/")
            outcome = page.evaluate("window.result")
    finally:
        attacker.shutdown()
    assert outcome.startswith("blocked: TypeError"), outcome
    titles = [s["title"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]]
    assert "only mine" in titles and "written by attacker" not in titles


# --- bounded work ---------------------------------------------------------------------------------------

def test_a_body_over_the_cap_is_413_before_it_is_parsed(server):
    too_big = b'{"messages": [{"role": "user", "content": "' + b"a" * DEFAULT_MAX_REQUEST_BYTES + b'"}]}'
    for path in ("/v1/chat/completions", "/v1/sessions", "/gradio_api/queue/join"):
        r = httpx.post(f"{server.url}{path}", content=too_big, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert_openai_error(r)
        assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused once the streamed body passes the cap
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // (1 << 16) + 2):
            yield b" " * (1 << 16)

    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:200]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module", autouse=True)
def half_open(server):
    """Eight connections that send part of a request head or nothing, opened as the module's first test starts (the
    server answering /health beside them): the default header timeout runs out while the tests before
    test_half_open_connections_are_closed_by_the_default_header_timeout run, instead of in a wait of its own."""
    import socket

    sockets = [socket.create_connection(("127.0.0.1", server.port), timeout=120) for _ in range(8)]
    for s in sockets[::2]:
        s.sendall(b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: ")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    yield sockets
    for s in sockets:
        s.close()


def test_half_open_connections_are_closed_by_the_default_header_timeout(half_open):
    """test_limits.py checks this with a 1 s timeout; here the default (10 s) does it too."""
    for s in half_open:
        try:
            assert s.recv(1024) == b""  # closed by the server, unanswered
        except ConnectionResetError:
            pass
        finally:
            s.close()


@pytest.fixture(scope="module")
def char_bound(embedded_path) -> int:
    """The longest prompt in characters that could still fit the context (Tokenizer.max_token_chars)."""
    from kvforge.core.loader import load_config

    context = load_config(embedded_path).max_position_embeddings
    return context * Tokenizer(embedded_path).max_token_chars


def test_a_prompt_that_cannot_fit_is_refused_by_its_length_before_tokenizing(server, char_bound):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "x" * (char_bound + 1)}]})
    assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"], r.text[:300]
    assert r.json()["error"]["param"] == "messages" and r.json()["error"]["code"] == "context_length_exceeded"


def test_health_answers_while_maximal_requests_are_being_tokenized(server, char_bound):
    """Prompts just under the character bound pass the cheap check and are tokenized (then refused as too
    many tokens): the event loop stays free meanwhile. An ordering assertion, not a timed one."""
    body = json.dumps({"messages": [{"role": "user", "content": "a " * (char_bound // 2 - 8)}]}).encode()
    assert len(body) < DEFAULT_MAX_REQUEST_BYTES
    results: list[httpx.Response] = []

    def post():
        results.append(httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=300,
                                  headers={"content-type": "application/json"}))

    threads = [threading.Thread(target=post) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while server.metric("requests_admitted") < 1:  # answered only when the loop is free
        assert time.monotonic() < deadline and len(results) < 3, "no request was seen in flight"
        time.sleep(0.005)
    assert httpx.get(f"{server.url}/health", timeout=300).status_code == 200
    assert len(results) < 3, "/health waited for every maximal request"
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [400] * 3
    assert all(r.json()["error"]["code"] == "context_length_exceeded" and "tokens" in r.json()["error"]["message"]
               for r in results)


# --- validation in words -------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("raw, param, fragment", [  # @HI: a valid messages list
    ('{"messages": @HI, "repetition_penalty": Infinity}', "repetition_penalty", "finite number"),
    ('{"messages": @HI, "repetition_penalty": 1e308}', "repetition_penalty", "less than or equal to 10"),
    ('{"messages": @HI, "repetition_penalty": 1e-308}', "repetition_penalty", "greater than or equal to 0.01"),
    ('{"messages": @HI, "temperature": NaN}', "temperature", "must be a finite number"),
    ('{"messages": @HI, "top_p": -Infinity}', "top_p", "must be a finite number"),
    ('{"messages": @HI, "presence_penalty": 1e999}', "presence_penalty", "must be a finite number"),
    ('{"messages": @HI, "stop": ' + json.dumps(["s"] * (MAX_STOP_STRINGS + 1)) + "}", "stop", "at most"),
    ('{"messages": @HI, "stop": "' + "s" * (MAX_STOP_CHARS + 1) + '"}', "stop", "at most"),
    ('{"messages": ' + json.dumps(HI * (MAX_MESSAGES + 1)) + "}", "messages", "at most"),
    ('{"messages": @HI, "max_tokens": 1', None, "invalid JSON at line 1 column"),
    ('{"messages": @HI,\n "max_tokens": }', None, "invalid JSON at line 2 column 16"),
])
def test_bad_values_are_400_in_words_naming_the_field(server, raw, param, fragment):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw.replace("@HI", json.dumps(HI)).encode(),
                   timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert_openai_error(r)
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_stored_and_per_turn_fields_are_capped(server):
    long_prompt = "x" * (MAX_SYSTEM_PROMPT_CHARS + 1)
    r = httpx.post(f"{server.url}/v1/sessions", json={"system_prompt": long_prompt}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "system_prompt", r.text[:300]
    huge = httpx.post(f"{server.url}/v1/sessions", json={"system_prompt": "x" * (20 << 20)}, timeout=60)
    assert huge.status_code == 413, huge.status_code
    session = httpx.post(f"{server.url}/v1/sessions", json={"title": "caps"}, timeout=60).json()
    patched = httpx.patch(f"{server.url}/v1/sessions/{session['id']}", json={"system_prompt": long_prompt}, timeout=60)
    assert patched.status_code == 400 and patched.json()["error"]["param"] == "system_prompt"
    sampled = httpx.post(f"{server.url}/v1/sessions/{session['id']}/messages", timeout=60,
                         content=b'{"content": "Hi", "temperature": NaN}', headers={"content-type": "application/json"})
    assert sampled.status_code == 400 and "finite" in sampled.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/sessions/{session['id']}", timeout=60).json()["messages"] == []
    for body in ({"kv_cache_gb": "NaN"}, {"tp": 10_000}):
        refused = httpx.post(f"{server.url}/admin/models/load", json=body, timeout=60)
        assert refused.status_code == 400, (body, refused.text)


# --- files ------------------------------------------------------------------------------------------------

def test_data_files_are_readable_by_their_owner_only(server, data_dir):
    session = httpx.post(f"{server.url}/v1/sessions", json={"title": "files"}, timeout=60).json()
    reply = httpx.post(f"{server.url}/v1/sessions/{session['id']}/messages", timeout=120,
                       json={"content": "Tell me a story about a lighthouse. " * 4, "stream": False, "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 60
    while not list((data_dir / "kv").rglob("*.kv")):  # written by a background thread
        assert time.monotonic() < deadline, "no KV block was persisted"
        time.sleep(0.1)

    def mode(path: Path) -> int:
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(data_dir) == 0o700
    files = [p for p in data_dir.rglob("*") if p.is_file()]
    assert any(p.name == "kvforge.db" for p in files) and any(p.suffix == ".kv" for p in files)
    assert {p.name: oct(mode(p)) for p in files if mode(p) != 0o600} == {}
    assert all(mode(p) == 0o700 for p in data_dir.rglob("*") if p.is_dir())
