"""The default path, as a newcomer meets it: `kvforge serve` started exactly as README command 1 does (no
flag but the port and a fresh data dir, no KVFORGE_* setting in its environment), the page opened in
Chromium, Model settings opened (the running values, the KV budget empty: automatic), the quantization
plugin switched to bnb-int8 and applied, a chat, then back to none, applied, another chat: /v1/models
reports the quant in use after each swap, the KV pool stays automatic, and no "Error" appears anywhere on
the page at any point (a recorder in the page sees every text and toast Gradio shows, also between our
checks) nor a traceback in the server's log.

The generation sliders (max tokens, temperature) are set as a user would, to keep the replies short; the
server's configuration is the default one throughout.
"""

from __future__ import annotations

import pytest

from kvforge.core.config import CPU_KV_CACHE_BYTES, EngineConfig
from tests.helpers.server_process import readme_serve
from tests.ui.ui_helpers import apply_and_wait, choose, model_card, send, served_quant, set_slider, wait_reply

TIMEOUT_MS = 120_000
APPLY_TIMEOUT_S = 300  # a deadline for the bnb-int8 load (quantized at load) on a slow shared machine

# Installed before the page's own scripts: records every text that contains "Error" and every toast, as
# they appear in the DOM (an error toast fades after a few seconds; a status shows "Error" until replaced).
RECORD_ERRORS = """
window.kvforgeProblems = [];
new MutationObserver(mutations => {
    const note = (what, text) => window.kvforgeProblems.push(what + ": " + (text || "").trim().slice(0, 500));
    for (const m of mutations) {
        for (const node of (m.type === "characterData" ? [m.target] : m.addedNodes)) {
            if (node.nodeType === Node.ELEMENT_NODE) {
                if (["SCRIPT", "STYLE", "LINK"].includes(node.nodeName)) continue;
                for (const toast of [node, ...node.querySelectorAll("[data-testid=toast-body]")]) {
                    if (toast.matches("[data-testid=toast-body]")) note("toast " + toast.className, toast.textContent);
                }
            }
            if ((node.textContent || "").includes("Error")) note("text", node.textContent);
        }
    }
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):  # after the browser check: a missing browser skips before the model loads
    process = readme_serve(tmp_path_factory.mktemp("data"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    tab.add_init_script(RECORD_ERRORS)
    tab.goto(server.url)
    tab.wait_for_selector("#message textarea")
    yield tab
    context.close()


def assert_no_error(page, where: str) -> None:
    """Nothing recorded so far, and nothing in the page's text now."""
    problems = page.evaluate("window.kvforgeProblems")
    assert not problems, f"{where}: {problems}"
    text = page.inner_text("body")
    assert "Error" not in text, f"{where}: {text}"


def wait_for(page, condition: str, where: str, arg=None) -> None:
    """Wait until the JavaScript expression `condition` (of `arg`) holds, or until a problem is recorded."""
    page.wait_for_function(f"arg => window.kvforgeProblems.length > 0 || ({condition})", arg=arg)
    assert_no_error(page, where)


def open_settings(page) -> None:
    if not page.locator("#settings-apply").is_visible():
        page.get_by_text("Model settings").click()
        page.locator("#settings-apply").wait_for(state="visible")


def wait_settings(page, quant: str) -> None:
    """Model settings shows the running model's values: the quant, and an empty (automatic) KV budget."""
    wait_for(page, "document.querySelector('#settings-quant input').value === arg", f"settings of {quant}", quant)
    wait_for(page, "document.querySelector('#settings-kv-gb input').placeholder.startsWith('automatic (')",
             f"KV budget of {quant}")
    kv = page.locator("#settings-kv-gb input")
    assert kv.input_value() == "", kv.input_value()


def swap_quant(page, server, quant: str, options_ready: str) -> None:
    """Choose `quant` in Model settings, Apply, wait for Loaded; /v1/models and the dashboard say it is served,
    with the KV pool still sized automatically."""
    choose(page, "settings-quant", quant)
    # the options box follows the choice (the plugin's declared defaults): wait for it before applying
    page.wait_for_function(f"document.querySelector('#settings-quant-options textarea').value{options_ready}")
    status = apply_and_wait(page, APPLY_TIMEOUT_S)
    assert status.startswith("Loaded") and f"quant {quant}" in status, status
    assert served_quant(server) == quant
    dashboard = page.locator("#dashboard").filter(has_text=f"quant {quant}")
    dashboard.wait_for()
    assert "(automatic)" in dashboard.inner_text()  # Apply with an empty KV box kept the automatic budget
    wait_settings(page, quant)
    assert_no_error(page, f"after applying {quant}")


def chat(page, server, message: str) -> str:
    """A new conversation with one message; its reply."""
    page.click("#new-chat")  # clears the last reply's stats: the next ones are this reply's
    page.wait_for_function("!document.querySelector('#reply-stats').innerText.includes('Last reply')")
    send(page, message)
    reply = wait_reply(page, server)
    assert reply.strip(), reply
    assert_no_error(page, f"after the reply {reply!r}")
    return reply


def test_default_setup_swaps_quant_from_the_settings_and_chats_without_an_error(page, server):
    card = model_card(server)
    # the embedded GGUF from its own blocks (the gguf plugin); auto: bf16 where native
    assert card["quant"] == "gguf" and card["dtype"] == EngineConfig().dtype, card
    kv_bytes = card["memory"]["kv_cache_bytes"]
    if card["device"] == "cpu":  # automatic on CPU: 1 GiB (whole blocks)
        assert 0.99 * CPU_KV_CACHE_BYTES < kv_bytes <= CPU_KV_CACHE_BYTES, kv_bytes
    assert_no_error(page, "the page as loaded")

    open_settings(page)
    wait_settings(page, "gguf")
    page.locator("#settings-estimate").filter(has_text="Estimate for").wait_for()
    assert page.locator("#settings-model input").input_value() == card["id"]
    assert_no_error(page, "Model settings opened")

    set_slider(page, "max-tokens", 32)  # short replies; greedy, so the reply is the same on every run
    set_slider(page, "temperature", 0)

    swap_quant(page, server, "bnb-int8", ".includes('compute_dtype')")
    chat(page, server, "What is the capital of France?")

    swap_quant(page, server, "gguf", ".includes('kernel')")  # back to the GGUF's own blocks
    chat(page, server, "What is the capital of France?")

    if card["device"] == "cpu":  # same dtype, still automatic (on a GPU it depends on what the weights leave)
        assert model_card(server)["memory"]["kv_cache_bytes"] == kv_bytes
    assert_no_error(page, "at the end")
    log = server.output()
    assert "Traceback" not in log, log


def test_a_typed_kv_budget_is_applied_and_shown_and_clearing_it_goes_back_to_automatic(page, server):
    """The KV budget box: a value typed is applied and shown (the dashboard drops "automatic"); emptied again and
    applied, the pool is sized automatically again (ModelSpec.kv_cache_gb None: the server has no --kv-cache-gb)."""
    open_settings(page)
    wait_settings(page, "gguf")
    kv = page.locator("#settings-kv-gb input")
    kv.fill("0.125")
    kv.press("Enter")
    status = apply_and_wait(page, APPLY_TIMEOUT_S)
    assert status.startswith("Loaded"), status
    assert model_card(server)["memory"]["kv_cache_bytes"] <= (1 << 30) // 8
    wait_for(page, "document.querySelector('#settings-kv-gb input').value === '0.125'", "a typed KV budget")
    page.locator("#dashboard").filter(has_text="quant gguf").filter(has_not_text="(automatic)").wait_for()

    kv.fill("")
    kv.press("Enter")
    status = apply_and_wait(page, APPLY_TIMEOUT_S)
    assert status.startswith("Loaded"), status
    page.locator("#dashboard").filter(has_text="(automatic)").wait_for()
    card = model_card(server)
    if card["device"] == "cpu":
        assert 0.99 * CPU_KV_CACHE_BYTES < card["memory"]["kv_cache_bytes"] <= CPU_KV_CACHE_BYTES, card
    wait_settings(page, "gguf")
    assert_no_error(page, "after the KV budget round trip")
