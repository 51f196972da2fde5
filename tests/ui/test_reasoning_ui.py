"""A reasoning model's reply in the browser chat (Chromium on a real `kvforge serve` with the UI): its thinking is
shown in a collapsible "Reasoning" bubble, stored apart from the answer (the sessions API's `reasoning_content`),
and shown the same way after a reload. The model is tests/app/generate/test_reasoning_serve.py's "thinking" variant of
the
embedded one: its template opens the think block, and without a logit bias it never closes it, so the whole
reply is reasoning and the answer is empty."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server_process import ServeProcess
from tests.helpers.thinking_model import thinking_model
from tests.ui.ui_helpers import chat_messages, send, set_slider, wait_reply

TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory, embedded_path):  # after the browser check: a missing browser skips first
    model = thinking_model(tmp_path_factory.mktemp("thinker") / "model")
    process = ServeProcess("--model", str(model), "--dtype", "float32", "--no-persist-kv", "--kv-cache-gb", "0.25",
                           "--data-dir", str(tmp_path_factory.mktemp("data")))
    yield process
    process.stop()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    tab.goto(server.url)
    tab.wait_for_selector("#message textarea")
    yield tab
    context.close()


def thought(page):
    return page.locator("#chat .thought-group")


def test_the_thinking_is_a_collapsible_bubble_stored_apart(page, server):
    set_slider(page, "max-tokens", 24)
    set_slider(page, "temperature", 0)
    send(page, "What is 2 + 3?")
    wait_reply(page, server)

    [session] = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]
    stored = httpx.get(f"{server.url}/v1/sessions/{session['id']}", timeout=30).json()["messages"]
    reply = stored[-1]
    assert reply["role"] == "assistant" and reply["reasoning_content"] and reply["content"] == "", reply
    assert "<think>" not in reply["reasoning_content"] and "</think>" not in reply["reasoning_content"]

    # one bubble for the reply: the thinking, titled and collapsed; no answer bubble (the answer is empty)
    assert chat_messages(page) == [("user", "What is 2 + 3?"), ("assistant", reply["reasoning_content"])]
    assert thought(page).count() == 1
    assert thought(page).locator(".title").inner_text().strip() == "Reasoning"
    content = thought(page).locator(".content")
    assert content.get_attribute("inert") is not None  # collapsed
    thought(page).locator(".title").click()
    page.wait_for_function("() => !document.querySelector('#chat .thought-group .content').hasAttribute('inert')")

    page.reload()  # rebuilt from the store
    page.wait_for_selector("#chat .thought-group")
    assert chat_messages(page) == [("user", "What is 2 + 3?"), ("assistant", reply["reasoning_content"])]
