"""The browser UI, driven by headless Chromium (Playwright) against one real `kvforge serve` per module, started
as README command 1 (the default configuration; only a port and a fresh data dir added):
a streamed reply and its stats, Stop, conversations (new, switch, rename, delete), a reload, the live
dashboard, no request to anything but 127.0.0.1, and the screenshot in docs/ui.png.

Tests share the server, so each one makes its own conversations and never assumes it is alone. Waits
use Playwright's (generous timeouts: the machine is slow and shared); nothing asserts a duration.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_process import ServeProcess
from tests.ui.ui_helpers import chat_messages, last_reply_text, send, set_slider, wait_reply

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "ui.png"
TIMEOUT_MS = 90_000
LONG_MAX_TOKENS = 2000
SHORT_MAX_TOKENS = 16
LONG_PROMPT = "Write a very long story, with many chapters, about a lighthouse keeper and a lost ship."

# every URL any page of this module requested (checked by the last test)
REQUESTS: list[str] = []


class Server(ServeProcess):
    """`kvforge serve` (UI at /) on the default configuration with a fresh data dir, read through the sessions
    API and /metrics."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__("--data-dir", str(data_dir))  # README command 1 (a port, a fresh data dir)

    def sessions(self) -> list[dict]:
        return httpx.get(f"{self.url}/v1/sessions", timeout=30).json()["data"]

    def session(self, session_id: str) -> dict:
        r = httpx.get(f"{self.url}/v1/sessions/{session_id}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 90) -> dict[str, float]:
        """No request running or waiting and no KV block in use (cached blocks may stay)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["requests_running"] == m["requests_waiting"] == m["kv_blocks_used"] == 0:
                return m
            assert time.monotonic() < deadline, f"the engine did not go idle: {m}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):  # after the browser check: a missing browser skips before the model loads
    srv = Server(tmp_path_factory.mktemp("kvforge-ui"))
    yield srv
    srv.stop()


@pytest.fixture
def page(browser, server):
    """A fresh tab on the UI, its requests recorded in REQUESTS."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    tab.on("request", lambda request: REQUESTS.append(request.url))
    tab.on("websocket", lambda ws: REQUESTS.append(ws.url))
    tab.goto(server.url)
    tab.wait_for_selector("#message textarea")
    yield tab
    context.close()


# ---- reading and driving the page -------------------------------------------------------------------

def stored_messages(server: Server, session_id: str) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in server.session(session_id)["messages"]]


def selected_id(page) -> str | None:
    checked = page.locator("#conversations input:checked")
    return checked.get_attribute("value") if checked.count() else None


def conversation(page, session_id: str):
    """The entry of one conversation in the #conversations list."""
    return page.locator(f"#conversations label:has(input[value='{session_id}'])")


def new_chat(page, server: Server) -> str:
    """Click New chat; the id of the conversation it creates (selected, with an empty chat)."""
    before = {s["id"] for s in server.sessions()}
    page.click("#new-chat")
    page.wait_for_function(
        """([ids]) => { const c = document.querySelector('#conversations input:checked');
                        return c && !ids.includes(c.value)
                               && document.querySelectorAll('#chat [data-testid=bot]').length === 0; }""",
        arg=[list(before)])
    session_id = selected_id(page)
    assert session_id in {s["id"] for s in server.sessions()}
    return session_id


def wait_partial_reply(page) -> str:
    page.wait_for_function(
        """() => { const b = document.querySelectorAll('#chat [data-testid=bot]');
                   return b.length && b[b.length - 1].getAttribute('aria-label').split("'s message: ")[1].length; }""")
    return last_reply_text(page)


def dashboard(page) -> dict[str, str]:
    """The dashboard table as {row name: value}."""
    rows = {}
    for line in page.locator("#dashboard").inner_text().splitlines():
        name, _, value = line.partition("\t")
        if value.strip():
            rows[name.strip()] = value.strip()
    return rows


def numbers(value: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", value)]


def wait_dashboard(page, predicate, what: str, timeout_s: float = TIMEOUT_MS / 1000) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = dashboard(page)
        try:
            if predicate(rows):
                return rows
        except (KeyError, IndexError, ValueError):
            pass  # not rendered yet
        assert time.monotonic() < deadline, f"the dashboard never showed {what}: {rows}"
        page.wait_for_timeout(200)


def running(rows) -> list[float]:
    return numbers(rows["Requests running / waiting"])


def kv_used(rows) -> float:
    return numbers(rows["KV blocks used / cached / free"])[0]


# ---- the tests --------------------------------------------------------------------------------------

def test_reply_streams_and_matches_the_store(page, server):
    session_id = new_chat(page, server)
    # every text the reply bubble shows, recorded in the page as the DOM changes
    page.evaluate("""() => {
        window.replyTexts = [];
        new MutationObserver(() => {
            const b = document.querySelectorAll('#chat [data-testid=bot]');
            if (!b.length) return;
            const text = b[b.length - 1].getAttribute('aria-label').split("'s message: ")[1];
            if (window.replyTexts[window.replyTexts.length - 1] !== text) window.replyTexts.push(text);
        }).observe(document.querySelector('#chat'), {subtree: true, childList: true, attributes: true,
                                                      characterData: true});
    }""")
    message = "Describe the water cycle in four or five sentences."
    send(page, message)
    final = wait_reply(page, server)
    shown = page.evaluate("window.replyTexts")
    assert final and shown[-1] == final
    partials = [t for t in shown if 0 < len(t) < len(final)]
    assert partials, f"no partial reply was shown before the final one: {shown}"
    assert any(final.startswith(t) for t in partials), (partials, final)

    # the conversation in GET /v1/sessions (named after the message) is the one selected, with the same history
    [listed] = [s for s in server.sessions() if s["title"] == message]
    assert listed["id"] == session_id == selected_id(page)
    stored = server.session(session_id)["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [("user", message), ("assistant", final)]
    assert chat_messages(page) == [("user", message), ("assistant", final)]
    assert conversation(page, session_id).inner_text().strip() == message

    stats = page.locator("#reply-stats").inner_text()
    match = re.search(r"(\d+) tokens · ([\d.]+) tok/s · TTFT (\d+) ms · (\d+) cached tokens", stats)
    assert match, stats
    reply = stored[-1]
    assert int(match[1]) == reply["completion_tokens"] > 1
    assert float(match[2]) > 0 and int(match[3]) >= 0
    assert int(match[4]) == reply["cached_tokens"]
    assert reply["finish_reason"] == "stop"


def test_stop_ends_the_generation(page, server):
    session_id = new_chat(page, server)
    set_slider(page, "max-tokens", LONG_MAX_TOKENS)
    send(page, LONG_PROMPT)
    wait_partial_reply(page)
    page.click("#stop")

    # the server keeps the partial reply, marked as stopped, far short of max tokens
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(messages := server.session(session_id)["messages"]) < 2:
        assert time.monotonic() < deadline, f"the stopped reply was not stored: {messages}"
        time.sleep(0.2)
    reply = messages[-1]
    assert reply["role"] == "assistant" and reply["finish_reason"] == "abort", reply
    # well before max tokens, with its token counts
    assert 0 < reply["completion_tokens"] < LONG_MAX_TOKENS, reply
    assert reply["cached_tokens"] >= 0 and reply["prompt_tokens"] > 0, reply
    server.wait_idle()
    # the page says so under the chat
    stats = page.locator("#reply-stats")
    stats.filter(has_text="stopped").wait_for()
    count = reply["completion_tokens"]
    assert f"{count} token{'s' if count != 1 else ''} " in stats.inner_text()  # "1 token" when stopped that early

    # the reply in the page stopped growing, and is what the server kept up to where the stop arrived
    shown = last_reply_text(page)
    page.wait_for_timeout(2000)
    assert last_reply_text(page) == shown
    assert shown and reply["content"].startswith(shown), (shown, reply["content"])
    assert server.metrics()["requests_running"] == 0


def test_regenerate_and_edit_the_last_message(page, server):
    session_id = new_chat(page, server)  # first: a new conversation shows the model's defaults in the sliders
    set_slider(page, "max-tokens", SHORT_MAX_TOKENS)
    set_slider(page, "temperature", 0)  # greedy: a regenerated reply is the same reply
    send(page, "Name three colours of the rainbow.")
    first = wait_reply(page, server)

    page.click("#regenerate")  # the last turn is dropped and its message sent again
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('Last reply') === false")
    again = wait_reply(page, server)
    assert again == first
    assert stored_messages(server, session_id) == [("user", "Name three colours of the rainbow."),
                                                   ("assistant", first)]
    assert chat_messages(page) == stored_messages(server, session_id)

    page.click("#edit-last")  # the last message goes back to the box, its turn leaves the conversation
    page.wait_for_function("document.querySelector('#message textarea').value.includes('rainbow')")
    assert stored_messages(server, session_id) == [] and chat_messages(page) == []
    page.fill("#message textarea", "Name three planets.")
    page.press("#message textarea", "Enter")
    reply = wait_reply(page, server)
    assert stored_messages(server, session_id) == [("user", "Name three planets."), ("assistant", reply)]


def test_conversations_new_switch_rename_delete(page, server):
    from playwright.sync_api import expect

    first = new_chat(page, server)
    expect(conversation(page, first)).to_have_text("New chat")
    set_slider(page, "max-tokens", SHORT_MAX_TOKENS)  # the replies' length does not matter here
    send(page, "My favourite colour is teal. Say hello.")
    wait_reply(page, server)
    expect(conversation(page, first)).to_have_text("My favourite colour is teal. Say hello.")

    second = new_chat(page, server)
    assert chat_messages(page) == []
    set_slider(page, "max-tokens", SHORT_MAX_TOKENS)  # a new conversation starts at the model's defaults again
    send(page, "Name three planets.")
    wait_reply(page, server)

    # switch: the chat shows the clicked conversation's history, as stored
    for session_id in (first, second, first):
        conversation(page, session_id).click()
        expected = stored_messages(server, session_id)
        page.wait_for_function("([n, first]) => { const u = document.querySelectorAll('#chat [data-testid=user]');"
                               "return u.length * 2 === n && u[0].getAttribute('aria-label').endsWith(first); }",
                               arg=[len(expected), expected[0][1]])
        assert selected_id(page) == session_id
        assert chat_messages(page) == expected

    # rename the selected one: the list and the API show the new title
    page.fill("#rename-title input", "Teal notes")
    page.click("#rename")
    expect(conversation(page, first)).to_have_text("Teal notes")
    expect(page.locator("#rename-title input")).to_have_value("")
    assert server.session(first)["title"] == "Teal notes"
    assert selected_id(page) == first
    expect(conversation(page, second)).to_have_text("Name three planets.")

    # delete it: gone from the list and from the API; another conversation is shown
    page.click("#delete")
    expect(conversation(page, first)).to_have_count(0)
    assert httpx.get(f"{server.url}/v1/sessions/{first}", timeout=30).status_code == 404
    assert first not in {s["id"] for s in server.sessions()}
    page.wait_for_function("first => { const c = document.querySelector('#conversations input:checked');"
                           "return c && c.value !== first; }", arg=first)
    shown = selected_id(page)
    page.wait_for_function("n => document.querySelectorAll('#chat [data-testid=user], #chat [data-testid=bot]')"
                           ".length === n", arg=len(stored_messages(server, shown)))
    assert chat_messages(page) == stored_messages(server, shown)


def test_reload_shows_the_same_conversations(page, server):
    new_chat(page, server)
    set_slider(page, "max-tokens", SHORT_MAX_TOKENS)
    send(page, "What is the capital of France?")
    wait_reply(page, server)
    listed = server.sessions()
    assert len(listed) >= 1

    page.reload()
    page.wait_for_selector("#message textarea")
    assert httpx.head(server.url, timeout=30).status_code == 200  # the UI answers Claude Code's probe too
    page.wait_for_function("n => document.querySelectorAll('#conversations input').length === n", arg=len(listed))
    ids = page.locator("#conversations input").evaluate_all("els => els.map(e => e.value)")
    titles = [t.strip() for t in page.locator("#conversations label").all_inner_texts()]
    assert ids == [s["id"] for s in listed] and titles == [s["title"] for s in listed]

    # the selected conversation (the latest) with its history and the stats of its last reply
    page.wait_for_function("document.querySelector('#conversations input:checked') !== null")
    assert selected_id(page) == listed[0]["id"]
    expected = stored_messages(server, listed[0]["id"])
    assert expected[-1][0] == "assistant"
    page.wait_for_function("n => document.querySelectorAll('#chat [data-testid=user], #chat [data-testid=bot]')"
                           ".length === n", arg=len(expected))
    assert chat_messages(page) == expected
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('Last reply')")


def test_tool_calls_and_results_are_shown(page, server):
    """A conversation whose reply called a tool (made through the sessions API, where tools are set): the call and
    its result each in a titled bubble, the answer after them."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"], "additionalProperties": False}}}
    session = httpx.post(f"{server.url}/v1/sessions", timeout=30, json={
        "tools": [weather], "tool_choice": "required", "parallel_tool_calls": False,
        "sampling": {"temperature": 0, "max_tokens": 40}}).json()
    url = f"{server.url}/v1/sessions/{session['id']}/messages"
    call = httpx.post(url, timeout=120, json={"content": "Weather in Paris?", "stream": False}).json()["message"]
    [tool_call] = call["tool_calls"]
    answer = httpx.post(url, timeout=120, json={"role": "tool", "content": "21 C, sunny", "stream": False,
                                                "tool_call_id": tool_call["id"], "tool_choice": "none"}).json()
    page.reload()  # the newest conversation is the one shown
    page.wait_for_function("document.querySelectorAll('#chat .thought-group').length === 2")
    titles = [t.strip() for t in page.locator("#chat .thought-group .title").all_inner_texts()]
    assert titles == ["Tool call: get_weather", "Tool result: get_weather"]
    shown = chat_messages(page)
    assert shown[0] == ("user", "Weather in Paris?") and shown[-1] == ("assistant", answer["message"]["content"])
    assert tool_call["function"]["arguments"] in shown[1][1] and shown[2][1] == "21 C, sunny", shown


def test_dashboard_changes_while_generating(page, server):
    server.wait_idle()
    idle = wait_dashboard(page, lambda r: running(r) == [0, 0] and kv_used(r) == 0, "an idle engine")
    assert "Generation tok/s" in idle and "KV pool" in idle

    new_chat(page, server)
    set_slider(page, "max-tokens", LONG_MAX_TOKENS)
    send(page, LONG_PROMPT)
    busy = wait_dashboard(page, lambda r: running(r)[0] >= 1, "a running request")
    assert running(busy) == [1, 0] and kv_used(busy) > 0, busy

    page.click("#stop")
    server.wait_idle()
    wait_dashboard(page, lambda r: running(r) == [0, 0] and kv_used(r) == 0, "an idle engine after Stop")


def test_screenshot(page, server):
    """docs/ui.png: the chat after a reply, with the dashboard and its plot."""
    new_chat(page, server)
    set_slider(page, "max-tokens", 120)
    send(page, "In three short sentences, what is a KV cache in a language model?")
    wait_reply(page, server)
    page.wait_for_selector("#tokens-plot svg.marks")
    server.wait_idle()  # the dashboard samples every second: let it catch up with the finished reply
    wait_dashboard(page, lambda r: running(r) == [0, 0] and "Generation tok/s" in r, "an idle engine")
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    data = SCREENSHOT.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_no_request_leaves_loopback(page, server):
    """Last in the module: every URL this module's pages requested was the server's (or data:/blob:)."""
    wait_dashboard(page, lambda r: "Generation tok/s" in r, "its figures")  # this page too, with a few ticks
    assert REQUESTS, "no request was recorded"
    local = re.compile(rf"^(http|ws)://127\.0\.0\.1:{server.port}/|^(data|blob):")
    outside = [url for url in REQUESTS if not local.match(url)]
    assert not outside, outside
