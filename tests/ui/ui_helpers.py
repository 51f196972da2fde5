"""Reading and driving the kvforge page in the browser tests (Playwright pages on a real `kvforge serve`):
the chat (send, wait for a reply, read the messages), the generation sliders, the Model settings panel
(choose a dropdown entry, Apply and wait for its outcome) and what /v1/models says is served.

Waits are Playwright's or polls with generous deadlines (the machines are slow and shared); nothing asserts
a duration."""

from __future__ import annotations

import time

import httpx

WAIT_S = 120  # the default deadline of the polls below, seconds


# ---- the chat ---------------------------------------------------------------------------------------

def chat_messages(page) -> list[tuple[str, str]]:
    """(role, content) of every message in #chat; the content is the raw text (Gradio's aria-label)."""
    labels = page.locator("#chat [data-testid=user], #chat [data-testid=bot]").evaluate_all(
        "els => els.map(e => [e.dataset.testid, e.getAttribute('aria-label')])")
    return [("user" if who == "user" else "assistant", label.split("'s message: ", 1)[1]) for who, label in labels]


def last_reply_text(page) -> str:
    messages = chat_messages(page)
    assert messages and messages[-1][0] == "assistant", messages
    return messages[-1][1]


def send(page, text: str) -> None:
    """Type a message and press Enter; returns once its (empty) reply bubble is shown."""
    replies = page.locator("#chat [data-testid=bot]").count()
    page.fill("#message textarea", text)
    page.press("#message textarea", "Enter")
    page.wait_for_function("n => document.querySelectorAll('#chat [data-testid=bot]').length > n", arg=replies)


def wait_reply(page, server) -> str:
    """Wait for the reply being generated to finish (its stats shown); its text. `server`: a ServeProcess."""
    from playwright.sync_api import TimeoutError

    try:
        page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('Last reply')")
    except TimeoutError:
        raise AssertionError(f"the reply did not finish: {chat_messages(page)[-2:]}, "
                             f"{page.locator('#reply-stats').inner_text()!r}, {server.metrics()}") from None
    return last_reply_text(page)


def fill_box(page, selector: str, text: str, timeout_s: float = WAIT_S) -> None:
    """Type into a text box until it holds the text (typed while an accordion still renders, it may not take)."""
    box = page.locator(selector)
    deadline = time.monotonic() + timeout_s
    while True:
        box.fill(text)
        page.wait_for_timeout(300)
        if box.input_value() == text:
            return
        assert time.monotonic() < deadline, f"{selector} did not take {text!r}"


def set_slider(page, elem_id: str, value: int | float, timeout_s: float = WAIT_S) -> None:
    """Type into a slider's number box (opening the Generation settings accordion if it is closed)."""
    slider = page.locator(f"#{elem_id}")
    if not slider.is_visible():
        page.get_by_text("Generation settings", exact=True).click()
        slider.wait_for(state="visible")
    box, track = slider.locator("input[type=number]"), slider.locator("input[type=range]")
    deadline = time.monotonic() + timeout_s
    while track.input_value() != str(value):  # typed while the accordion still renders, it may not take
        assert time.monotonic() < deadline, f"#{elem_id} stayed at {track.input_value()}"
        box.fill(str(value))
        box.press("Enter")
        page.wait_for_timeout(300)


# ---- Model settings ---------------------------------------------------------------------------------

def choose(page, dropdown_id: str, option: str) -> None:
    box = page.locator(f"#{dropdown_id} input")
    box.fill(option)  # the list is filtered by the box's text: type the choice, then pick it
    page.get_by_role("option", name=option, exact=True).click()
    page.wait_for_function(f"document.querySelector('#{dropdown_id} input').value === '{option}'")


def apply_and_wait(page, timeout_s: float = WAIT_S) -> str:
    """Click Apply; the status line that ends this apply (not the one left by an earlier apply)."""
    status = page.locator("#settings-status")

    def outcome() -> str | None:  # the status shows a progress timer around the text while busy
        text = status.inner_text()
        found = [text.index(word) for word in ("Loaded", "Refused") if word in text]
        return text[min(found):] if found else None

    before = outcome()
    page.click("#settings-apply")
    deadline = time.monotonic() + timeout_s
    busy = False  # seen "Applying…" (no outcome) since the click: a later outcome is this apply's, even one that
    # reads as the last one did (the same choice loaded in as many tenths of a second)
    while time.monotonic() < deadline:
        now = outcome()
        busy = busy or now is None
        if now is not None and (now != before or busy):
            return now
        time.sleep(0.2)
    raise AssertionError(f"apply did not finish: {status.inner_text()!r}")


def model_card(server) -> dict:
    """The served model's entry in /v1/models. `server`: a ServeProcess."""
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]


def served_quant(server) -> str:
    return model_card(server)["quant"]
