"""One authentication layer, deny by default: with an API key every route needs it — the APIs, /admin,
/metrics, /openapi.json, the UI page and every Gradio route — and only /health stays open. The routes
come from the app object itself, so a route added later is covered. Then a real `kvforge serve` bound to
0.0.0.0 with the key from a file: the official `gradio_client` without the key cannot read, post, delete
or apply settings; a browser logs in (an HttpOnly, SameSite=Strict cookie) and chats, and its logout ends that
session on the server (the cookie no longer opens anything); wrong keys are slowed per client address (429 with
Retry-After past five) while another address is served; allowed hosts and origins are served (CORS for the allowed
origin only); the key on the command line draws a warning.

The module's tests share one server, and one address's wrong keys lock it out for a while: the tests that send
wrong keys do it from loopback addresses of their own (127.0.0.x), or last."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from starlette.routing import Mount, Route, WebSocketRoute

from kvforge.app.http.access import COOKIE, AccessPolicy
from kvforge.app.http.key_throttle import KeyThrottle
from kvforge.app.http.threaded_server import free_port, serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine
from kvforge.core.store import Store
from kvforge.ui.app import mount_ui
from tests.helpers.api_checks import assert_api_error
from tests.helpers.chromium import launch_browser
from tests.helpers.server_process import ServeProcess

KEY = "kvforge-test-key-4f1c"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED_ORIGIN = "http://localhost:3000"
ALLOWED_HOST = "kvforge.test"
OPEN_ROUTES = {"/health"}


# --- every route of the app object ---------------------------------------------------------------------

def app_routes(app, prefix: str = ""):
    """(method, path) of every route, mounted apps (the Gradio UI) included; "WEBSOCKET" for websockets."""
    for route in app.routes:
        if hasattr(route, "original_router"):  # FastAPI's include_router(): the router's own routes
            yield from app_routes(route.original_router, prefix + (getattr(route.include_context, "prefix", "") or ""))
        elif isinstance(route, Mount):
            inner = getattr(route, "app", None)
            if hasattr(inner, "routes"):
                yield from app_routes(inner, prefix + route.path)
            else:  # a mounted ASGI app without a route table (static files): its whole subtree
                yield "GET", prefix + route.path + "/x"
        elif isinstance(route, WebSocketRoute):
            yield "WEBSOCKET", prefix + route.path
        elif isinstance(route, Route):
            for method in sorted(route.methods or {"GET"}):
                yield method, prefix + route.path


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path) or "/"


@pytest.fixture(scope="module")
def in_process_app(embedded_llm, tmp_path_factory):
    """The app exactly as `kvforge serve --api-key` builds it (the sessions API and the UI mounted)."""
    engine = AsyncEngine(embedded_llm.engine)
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('routes') / 'kvforge.db'}")
    # one wrong key per route below: the default throttle (tested on the real server) would answer 429 after five
    app = create_app(engine, "SmolLM2-135M-Instruct", store=store, ui=mount_ui,
                     access=AccessPolicy(api_key=KEY, bound_host="0.0.0.0", throttle=KeyThrottle(free_failures=10**6)))
    with serve_in_thread(app) as url:
        yield app, url
    engine.close()


def test_every_route_of_the_app_needs_the_key(in_process_app):
    app, url = in_process_app
    routes = sorted(set(app_routes(app)))
    paths = {path for _, path in routes}
    # the enumeration reaches every kind of route: the APIs, admin, metrics, the schema, the UI and Gradio's own
    for expected in ("/v1/chat/completions", "/v1/sessions/{session_id}/messages", "/admin/models/load", "/metrics",
                     "/openapi.json", "/health", "/config", "/gradio_api/queue/join", "/gradio_api/info"):
        assert expected in paths, expected
    assert len(routes) > 40, routes
    checked = 0
    with httpx.Client(base_url=url, timeout=60) as http:
        for method, path in routes:
            if method == "WEBSOCKET":
                continue  # below
            r = http.request(method, concrete(path), json={} if method in ("POST", "PUT", "PATCH") else None)
            if path in OPEN_ROUTES:
                assert r.status_code == 200, (method, path, r.status_code)
                continue
            if path in ("/login", "/logout"):  # Gradio's own: the guard serves its login form there instead
                expected = {"GET": 200, "POST": 401} if path == "/login" else {"GET": 303, "POST": 303}
                assert r.status_code == expected.get(method, 405), (method, path, r.status_code)
                assert path == "/logout" or method != "GET" or "This server needs its API key" in r.text
                continue
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
            if method != "HEAD":
                assert_api_error(r, path)
            assert r.headers["www-authenticate"] == "Bearer"
            wrong = http.request(method, concrete(path), headers={"Authorization": "Bearer wrong-key"})
            assert wrong.status_code == 401, (method, path, wrong.status_code)
            checked += 1
        # with the key the same routes answer (whatever their answer to an empty request is), never 401
        for method, path in routes:
            if method == "GET" and path in ("/v1/models", "/openapi.json", "/config", "/gradio_api/info", "/metrics"):
                assert http.get(path, headers=AUTH).status_code == 200, path
    assert checked > 40


def test_websocket_routes_refuse_a_handshake_without_the_key(in_process_app):
    """Gradio declares no websocket route today; any it adds goes through the same door, as a raw handshake
    to any path shows (401 before the app, 403 for a handshake the guard refuses)."""
    app, url = in_process_app
    paths = [concrete(p) for m, p in app_routes(app) if m == "WEBSOCKET"] or ["/gradio_api/queue/join", "/ws"]

    async def handshake(path: str) -> bytes:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        writer.close()
        return status

    for path in paths:
        status = asyncio.run(handshake(path))
        assert status.startswith(b"HTTP/1.1 403") or status.startswith(b"HTTP/1.1 401"), (path, status)


# --- a real server bound to every interface --------------------------------------------------------------

@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, key_file):
    srv = ServeProcess("--host", "0.0.0.0", "--api-key-file", str(key_file), "--data-dir",
                       str(tmp_path_factory.mktemp("data")), "--allowed-hosts", ALLOWED_HOST,
                       "--allowed-origins", ALLOWED_ORIGIN)
    yield srv
    srv.stop()


def test_the_key_file_is_enforced_and_the_key_is_not_on_the_command_line(server):
    assert KEY not in " ".join(server.process.args)
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert "warning" not in server.output()


def test_the_other_dialects_official_clients_need_the_key(server):
    """Anthropic's client sends it as x-api-key, Ollama's as a bearer from OLLAMA_API_KEY (or headers=); without it
    each raises its own 401 error."""
    import anthropic
    import ollama

    ask = [{"role": "user", "content": "Hi"}]
    keyed = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    assert keyed.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=ask).usage.output_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="SmolLM2-135M-Instruct", max_tokens=2, messages=ask)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OLLAMA_API_KEY", KEY)
        keyed_ollama = ollama.Client(host=server.url, timeout=120)
        assert keyed_ollama.chat(model="SmolLM2-135M-Instruct", messages=ask, options={"num_predict": 2}).eval_count
        assert keyed_ollama.embed(model="SmolLM2-135M-Instruct", input="Hi").embeddings
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url).list()
    assert refused.value.status_code == 401 and "API key" in refused.value.error


@pytest.fixture(scope="module")
def private_conversation(server):
    created = httpx.post(f"{server.url}/v1/sessions", headers=AUTH, timeout=30,
                         json={"title": "medical notes", "system_prompt": "The user's secret is 4417."})
    assert created.status_code == 200, created.text
    reply = httpx.post(f"{server.url}/v1/sessions/{created.json()['id']}/messages", headers=AUTH, timeout=120,
                       json={"content": "Remember my secret.", "stream": False, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return created.json()["id"]


def from_address(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (a loopback address: 127.0.0.2 ...)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def gradio_client(url: str, key: str | None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # or gradio_client looks for a hub at construction
    from gradio_client import Client

    return Client(f"{url}/", headers={"Authorization": f"Bearer {key}"} if key else None, verbose=False)


def test_a_browser_logs_in_with_a_strict_httponly_cookie_and_chats(server):
    with launch_browser() as browser:
        context = browser.new_context()
        context.set_default_timeout(120_000)
        page = context.new_page()
        page.goto(f"{server.url}/")
        assert page.url.startswith(f"{server.url}/login"), page.url
        page.fill("#key", "not the key")
        page.click("button[type=submit]")
        assert "Wrong API key." in page.content() and not context.cookies()
        page.fill("#key", KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("#message textarea")
        (cookie,) = context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
        assert page.evaluate("document.cookie") == ""  # scripts cannot read it
        page.fill("#message textarea", "Say hi.")
        page.press("#message textarea", "Enter")
        page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('Last reply')")
        assert page.locator("#chat [data-testid=bot]").count() >= 1
        # the cookie alone opens the API too (same origin), and logging out closes it again
        assert page.evaluate("fetch('/v1/sessions').then(r => r.status)") == 200
        page.goto(f"{server.url}/logout")
        assert page.url.startswith(f"{server.url}/login")
        assert page.evaluate("fetch('/v1/sessions').then(r => r.status)") == 401
        context.close()
    # the browser's cookie, copied before the logout and replayed, opens nothing: the session ended on the server
    assert httpx.get(f"{server.url}/v1/sessions", cookies={COOKIE: cookie["value"]}, timeout=30).status_code == 401


def test_logout_ends_the_session_on_the_server(server):
    """A cookie kept from before a logout (copied, or a browser that ignored the clearing) is refused afterwards;
    each login is its own session, and ending one leaves the others."""
    first, second = (httpx.post(f"{server.url}/login", data={"key": KEY}, timeout=30) for _ in range(2))
    assert first.status_code == second.status_code == 303
    first_id, second_id = first.cookies[COOKIE], second.cookies[COOKIE]
    assert first_id != second_id and len(first_id) >= 40  # a random id per login
    for session in (first_id, second_id):
        assert httpx.get(f"{server.url}/v1/sessions", cookies={COOKIE: session}, timeout=30).status_code == 200
    logout = httpx.get(f"{server.url}/logout", cookies={COOKIE: first_id}, timeout=30)
    assert logout.status_code == 303 and f"{COOKIE}=" in logout.headers["set-cookie"]
    replayed = httpx.get(f"{server.url}/v1/sessions", cookies={COOKIE: first_id}, timeout=30)
    assert replayed.status_code == 401, replayed.status_code
    page = httpx.get(f"{server.url}/", cookies={COOKIE: first_id}, headers={"Accept": "text/html"}, timeout=30)
    assert page.status_code == 303 and page.headers["location"].startswith("/login")
    assert httpx.get(f"{server.url}/v1/sessions", cookies={COOKIE: second_id}, timeout=30).status_code == 200
    forged = first_id[:-4] + "AAAA"
    assert httpx.get(f"{server.url}/v1/sessions", cookies={COOKIE: forged}, timeout=30).status_code == 401


def test_wrong_keys_are_slowed_per_address_while_another_is_served(server):
    """Five wrong keys from one address, then it waits: 1 s, then twice as long after each further one; while it
    waits its keys are not checked (429, Retry-After), the correct one included, whichever way it sends them, and
    X-Forwarded-For does not make a new address. The correct key from another address is answered at once."""
    models = f"{server.url}/v1/models"
    with from_address("127.0.0.3") as guesser, from_address("127.0.0.2") as other, \
            from_address("127.0.0.4") as forger:
        statuses = [guesser.get(models, headers={"Authorization": f"Bearer guess-{i}"}).status_code
                    for i in range(40)]
        assert statuses[:5] == [401] * 5 and statuses[5] == 429, statuses
        assert statuses.count(401) <= 6, statuses  # at most one more checked (a lockout of 1 s may end meanwhile)
        locked = guesser.get(models, headers={"x-api-key": "guess-x"})
        assert locked.status_code == 429 and 1 <= int(locked.headers["retry-after"]) <= 2
        assert_api_error(locked, "/v1/models")
        assert "too many wrong API keys" in locked.json()["error"]["message"]
        assert guesser.get(models, headers=AUTH).status_code == 429  # the right key is not checked either
        form = guesser.post(f"{server.url}/login", data={"key": KEY})
        assert form.status_code == 429 and "Too many wrong keys" in form.text and "retry-after" in form.headers
        assert guesser.get(f"{server.url}/health").status_code == 200
        start = time.monotonic()
        assert other.get(models, headers=AUTH).status_code == 200
        assert time.monotonic() - start < 1
        forged = [forger.get(models, headers={"Authorization": f"Bearer guess-{i}", "X-Forwarded-For": f"10.9.0.{i}"})
                  .status_code for i in range(10)]
        assert forged.count(401) == 5 and forged[5:] == [429] * 5, forged
        time.sleep(int(locked.headers["retry-after"]) + 0.1)  # the lockout over: one more check, then a longer wait
        assert guesser.get(models, headers={"Authorization": "Bearer guess-41"}).status_code == 401
        longer = guesser.get(models, headers={"Authorization": "Bearer guess-42"})
        assert longer.status_code == 429 and int(longer.headers["retry-after"]) >= 2, longer.headers


def test_login_goes_back_to_a_local_page_only(server):
    for target, expected in (("/v1/models", "/v1/models"), ("//evil.example/", "/"), ("https://evil.example", "/"),
                             ("/\\evil.example", "/")):
        r = httpx.post(f"{server.url}/login", data={"key": KEY, "next": target}, timeout=30)
        assert r.status_code == 303 and r.headers["location"] == expected, (target, r.headers.get("location"))


def test_allowed_hosts_and_ip_addresses_are_served_with_the_key(server):
    for host in (ALLOWED_HOST, f"{ALLOWED_HOST}:{server.port}", f"192.168.7.7:{server.port}", "[fd00::7]"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host}, timeout=30).status_code == 401, host
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host, **AUTH}, timeout=30).status_code == 200
    refused = httpx.get(f"{server.url}/v1/models", headers={"Host": "evil.example", **AUTH}, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed"


def test_cors_only_for_the_allowed_origin(server):
    preflight = httpx.options(f"{server.url}/v1/chat/completions", timeout=30, headers={
        "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in preflight.headers  # the key travels in a header, not a cookie
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ALLOWED_ORIGIN, **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert httpx.get(f"{server.url}/v1/models", headers={"Origin": ALLOWED_ORIGIN}, timeout=30).status_code == 401
    other = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://localhost:3001", **AUTH}, timeout=30)
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_gradio_client_without_the_key_cannot_read_post_delete_or_apply(server, private_conversation):
    """Last of the tests on the module's server: its wrong keys lock 127.0.0.1 out (the checks after them come from
    another address)."""
    from gradio_client.exceptions import AuthenticationError

    with pytest.raises(AuthenticationError):
        gradio_client(server.url, None)
    # with the key, the UI's functions do read the private conversation: the endpoints below are real ...
    client = gradio_client(server.url, KEY)
    shown = client.predict(api_name="/on_load")  # the page's first call: the newest conversation, shown
    assert "4417" in str(shown) and "Remember my secret." in str(shown)
    model_before = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    listed = httpx.get(f"{server.url}/v1/sessions", headers=AUTH, timeout=30).json()["data"]
    titles_before = [s["title"] for s in listed]
    assert "medical notes" in titles_before
    # ... and the same client, its key taken away, can do none of it
    client.headers["Authorization"] = "Bearer wrong"
    calls = [("/on_load", ()), ("/search", ("secret",)),
             ("/send", ({"text": "And tell everyone.", "files": []}, "", 0.0, 1.0, 4, True, "")),
             ("/delete", (private_conversation,)),
             ("/new_conversation", ("injected system prompt",)),
             ("/apply_settings", ("SmolLM2-135M-Instruct", "float16", "none", "{}", "none", "{}", None, 1))]
    for api_name, args in calls:
        with pytest.raises(Exception) as failure:
            client.predict(*args, api_name=api_name)
        refusal = str(failure.value)  # 401, or 429 once this address has sent five wrong keys
        assert any(sign in refusal for sign in ("401", "429", "API key")), (api_name, refusal)
        assert "4417" not in refusal
    with from_address("127.0.0.5") as http:
        after = http.get(f"{server.url}/v1/sessions/{private_conversation}", headers=AUTH)
        assert after.status_code == 200, "the conversation was deleted"
        assert [m["content"] for m in after.json()["messages"]][0] == "Remember my secret."
        assert len(after.json()["messages"]) == 2, "a message was posted"
        titles = [s["title"] for s in http.get(f"{server.url}/v1/sessions", headers=AUTH).json()["data"]]
        assert titles == titles_before, titles  # no conversation was created
        model_after = http.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert model_after["dtype"] == model_before["dtype"] != "float16", "the settings were applied"


# --- where the key comes from ---------------------------------------------------------------------------

def serve_until(args: list[str], env: dict[str, str], marker: str, timeout_s: float = 120) -> str:
    """Start `kvforge serve`, read its output until `marker` (or its exit), stop it; the output so far."""
    process = subprocess.Popen([sys.executable, "-m", "kvforge.app.cli", "serve", "--port", str(free_port()), *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, deadline = "", time.monotonic() + timeout_s
    try:
        for line in process.stdout:
            output += line
            if marker in line or time.monotonic() > deadline:
                break
    finally:
        process.kill()
        process.wait(timeout=30)
    return output


def test_a_key_on_the_command_line_or_in_a_readable_file_draws_a_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_API_KEY"} | {"HF_HUB_OFFLINE": "1"}
    data = ["--data-dir", str(tmp_path / "data")]
    output = serve_until(["--api-key", KEY, *data], env, "warning")
    assert "--api-key on the command line is visible to other users" in output, output
    loose = tmp_path / "key"
    loose.write_text(KEY)
    loose.chmod(0o644)
    output = serve_until(["--api-key-file", str(loose), *data], env, "warning")
    assert "is readable by other users" in output, output
    # no key at all on 0.0.0.0: refused (tests/app/cli/test_cli.py,
    # test_serve_refuses_a_public_address_without_an_api_key)
