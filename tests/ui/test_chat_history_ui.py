"""The chat as a desktop chat app's, in headless Chromium against a real `kvforge serve` started as README command 1
(the default configuration: the embedded model at its own sampling defaults; only a port and a data dir added):
the newcomer's first question, per-reply figures in a tooltip, export -> import round trip (and a code block's copy
button), search by a word of a third message, system-prompt presets, and a branch made by editing a message that
survives a restart, switching back to the first branch then hitting the prefix cache (the persisted tier).

The tests share one server and run in order (the last one restarts it); each makes its own conversations."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_process import readme_serve
from tests.ui.ui_helpers import chat_messages, choose, fill_box, send, set_slider, wait_reply

TIMEOUT_MS = 120_000
FIRST_QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvforge-history")


@pytest.fixture(scope="module")
def server(browser, data_dir):  # after the browser check: a missing browser skips before the model loads
    holder = {"process": readme_serve(data_dir)}  # the restart test replaces it
    yield holder
    holder["process"].stop()


def open_page(browser, url: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#message textarea")
    return page


@pytest.fixture
def page(browser, server):
    tab = open_page(browser, server["process"].url)
    yield tab
    tab.context.close()


def api(server, method: str, path: str, **kwargs) -> httpx.Response:
    response = httpx.request(method, f"{server['process'].url}{path}", timeout=120, **kwargs)
    assert response.status_code == 200, response.text
    return response


def new_chat(page) -> None:
    page.click("#new-chat")
    page.wait_for_function("document.querySelectorAll('#chat [data-testid=bot]').length === 0")


def selected_id(page) -> str:
    page.wait_for_function("document.querySelector('#conversations input:checked') !== null")
    return page.locator("#conversations input:checked").get_attribute("value")


def turn(page, server, text: str) -> str:
    """Send a message, wait for its reply to finish; the reply's text. (Sending clears the last reply's stats.)"""
    send(page, text)
    return wait_reply(page, server["process"])


def conversation_titles(page) -> list[str]:
    return [t.strip() for t in page.locator("#conversations label:has(input)").all_inner_texts()]


def search(page, words: str) -> None:
    box = page.locator("#search input")
    box.fill("")
    box.press_sequentially(words)  # typed, as a user does: each key an input event


def test_the_newcomers_first_question_gets_a_sane_short_answer(page, server):
    """The default settings (the model's: greedy for the embedded model, the repetition guard on) answer the README's
    question with the fact, as the greedy reference through the API does, and stop by themselves."""
    reference = api(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": FIRST_QUESTION}], "temperature": 0, "max_tokens": 64}).json()
    greedy = reference["choices"][0]["message"]["content"]
    assert "Paris" in greedy
    reply = turn(page, server, FIRST_QUESTION)
    assert reply == greedy and len(reply.split()) < 40
    stats = page.inner_text("#reply-stats")
    assert "max tokens reached" not in stats and "repeated" not in stats, stats
    # the reply's figures, kept with the message, in its bubble's tooltip
    stored = api(server, "GET", f"/v1/sessions/{selected_id(page)}").json()["messages"][-1]
    page.wait_for_function("document.querySelector('#chat [data-testid=bot]').title.includes('tok/s')")
    title = page.locator("#chat [data-testid=bot]").last.get_attribute("title")
    assert title.startswith(f"{stored['completion_tokens']} tokens") and "TTFT" in title, title
    assert f"{stored['cached_tokens']} cached tokens" in title
    # the generation settings show the model's defaults
    page.get_by_text("Generation settings", exact=True).click()
    assert "Model defaults: temperature 0" in page.inner_text("#model-defaults")
    assert page.locator("#temperature input[type=number]").input_value() == "0"
    assert page.locator("#repetition-guard input").is_checked()


def test_export_then_import_round_trip(page, server, tmp_path):
    new_chat(page)
    set_slider(page, "max-tokens", 12)
    turn(page, server, "Name a fruit.")
    turn(page, server, "Name a color.")
    original_id = selected_id(page)
    original = api(server, "GET", f"/v1/sessions/{original_id}").json()
    page.get_by_text("Export / import", exact=True).click()
    page.click("#export")
    page.wait_for_selector("#export-file a", state="attached")
    with page.expect_download() as download:
        page.locator("#export-file a").first.click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["format"] == "kvforge.conversation" and len(exported["messages"]) == 4
    assert [m["completion_tokens"] for m in exported["messages"]] == [
        m.get("completion_tokens") for m in original["messages"]]
    # imported back: a new conversation, shown and selected, with the same messages and figures
    exported["messages"][-1]["content"] += "\n```python\nprint('copied')\n```"  # and a code block to copy
    upload = tmp_path / "conversation.json"
    upload.write_text(json.dumps(exported))
    with page.expect_file_chooser() as chooser:
        page.click("#import")
    chooser.value.set_files(str(upload))
    page.wait_for_function("id => { const c = document.querySelector('#conversations input:checked');"
                           " return c && c.value !== id; }", arg=original_id)
    imported = api(server, "GET", f"/v1/sessions/{selected_id(page)}").json()
    keep = ("role", "content", "completion_tokens", "cached_tokens", "ttft_s", "tokens_per_s", "finish_reason")
    assert [{k: m.get(k) for k in keep} for m in imported["messages"]][:-1] == [
        {k: m.get(k) for k in keep} for m in original["messages"]][:-1]
    assert imported["title"] == original["title"]
    assert [role for role, _ in chat_messages(page)] == ["user", "assistant"] * 2
    copy = page.locator("#chat .copy_code_button")  # a code block has its own copy button
    assert copy.count() == 1
    # Markdown: the branch shown, a section per message
    page.locator("#export-format label", has_text="Markdown").click()
    page.click("#export")
    page.wait_for_function("document.querySelector('#export-file a') && "
                           "document.querySelector('#export-file a').href.endsWith('.md')")
    with page.expect_download() as download:
        page.locator("#export-file a").first.click()
    markdown = Path(download.value.path()).read_text()
    assert "### User\n\nName a fruit." in markdown and "print('copied')" in markdown


def test_search_finds_a_conversation_by_a_word_of_its_third_message(page, server):
    new_chat(page)
    set_slider(page, "max-tokens", 8)
    for text in ("Hello there.", "Tell me about tea.", "Do you like marmalade on toast?"):
        turn(page, server, text)
    wanted = selected_id(page)
    new_chat(page)
    turn(page, server, "Hello again.")  # another conversation, without the word
    search(page, "marmal")  # the start of a word finds it
    page.wait_for_function("n => document.querySelectorAll('#conversations input').length === n", arg=1)
    assert page.locator("#conversations input").get_attribute("value") == wanted
    search(page, "quetzalcoatl")
    page.wait_for_selector("#no-conversations")
    search(page, "")
    page.wait_for_function("n => document.querySelectorAll('#conversations input').length >= n", arg=2)


def test_system_prompt_presets(page, server):
    page.get_by_text("Generation settings", exact=True).click()
    fill_box(page, "#system-prompt textarea", "You answer like a pirate.")
    fill_box(page, "#preset-name input", "Pirate")
    page.click("#save-preset")
    page.wait_for_function("document.querySelector('#preset-name input').value === ''")
    assert {"name": "Pirate", "content": "You answer like a pirate."}.items() <= \
        api(server, "GET", "/v1/system_prompts").json()["data"][0].items()
    new_chat(page)
    fill_box(page, "#system-prompt textarea", "")
    choose(page, "presets", "Pirate")
    page.wait_for_function("document.querySelector('#system-prompt textarea').value === 'You answer like a pirate.'")


def test_an_edited_branch_survives_a_restart_and_switching_back_hits_the_cache(browser, server, data_dir):
    page = open_page(browser, server["process"].url)
    new_chat(page)
    set_slider(page, "max-tokens", 16)
    turn(page, server, "Name a fruit.")
    turn(page, server, "Name a color.")
    session_id = selected_id(page)
    first_branch = api(server, "GET", f"/v1/sessions/{session_id}").json()["messages"]
    # Edit the second message in the chat: a branch beside it
    page.locator("#chat [data-testid=user]").last.hover()
    page.locator("#chat button[aria-label=Edit]").last.click()
    page.locator("#chat textarea").first.fill("Name an animal.")
    page.locator("#chat button[aria-label=Submit]").first.click()
    page.wait_for_function("document.querySelector('#branch-0') && "
                           "document.querySelector('#branch-0').innerText.includes('2/2')")
    assert [text for _, text in chat_messages(page)][2] == "Name an animal."
    # a restart: the same data directory, a new process, a new page
    page.context.close()
    server["process"].stop()
    server["process"] = readme_serve(data_dir)
    page = open_page(browser, server["process"].url)
    try:
        page.locator(f"#conversations label:has(input[value='{session_id}'])").click()
        page.wait_for_function("document.querySelector('#branch-0') && "
                               "document.querySelector('#branch-0').innerText.includes('2/2')")
        page.click("#branch-previous-0")
        page.wait_for_function("document.querySelector('#branch-0').innerText.includes('1/2')")
        assert [text for _, text in chat_messages(page)] == [m["content"] for m in first_branch]
        turn(page, server, "Thanks.")
        shown = api(server, "GET", f"/v1/sessions/{session_id}").json()["messages"]
        assert [m["content"] for m in shown[:4]] == [m["content"] for m in first_branch]
        # the new turn's prompt starts with the first branch's whole prompt and reply: served from the persisted KV
        # (its last token's KV was never computed; the cache holds the full blocks of the rest: 16 tokens each)
        history = first_branch[-1]["prompt_tokens"] + first_branch[-1]["completion_tokens"] - 1
        assert shown[-1]["cached_tokens"] >= history // 16 * 16 > 0, (shown[-1], history)
    finally:
        page.context.close()
