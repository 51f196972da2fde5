"""The UI's model settings against a real `kvforge serve` with two third-party quant plugins installed:
a memory estimate before applying, a swap to another quant plugin without a restart (a reply in flight
finishes first; the next uses the new plugin, shown in the dashboard and in /v1/models), a refusal
of a plugin that cannot run on this device (the old model keeps serving), a swap to speculative
decoding (n-gram) with its acceptance figures on the dashboard, the tensor-parallel ranks input, and the KV cache
type (the estimate counts it; applied, the pool holds more tokens in the same budget, shown on the dashboard)."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from kvforge.app.cli.cache import human_bytes
from kvforge.app.models.catalog import describe
from kvforge.core.config import DTYPES, kv_bytes_per_token
from kvforge.core.loader import EMBEDDED_MODEL, embedded_gguf_path
from tests.helpers.chromium import launch_browser
from tests.helpers.plugin_packages import build_and_install, toy_int8_site
from tests.helpers.server_process import ServeProcess
from tests.ui.ui_helpers import apply_and_wait, choose, model_card, served_quant

GPU_ONLY_SOURCE = '''
from kvforge.plugins.quant.dense import DenseMethod


class GpuOnlyMethod(DenseMethod):
    name = "toy-gpu-only"
    description = "A method with CUDA kernels only (test plugin)."
    devices = ("cuda",)
'''
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_path):
    # Not README command 1: its twin on the default configuration is tests/ui/test_default_setup.py (a quant swap
    # from the settings and back, with chats, on an empty, automatic KV budget; no "Error" on the page). This one
    # needs two third-party quant plugins installed, a toy int8 with a declared option and a CUDA-only one: plugin
    # discovery, rendered options and a refusal on this device cannot be shown with the built-in plugins alone; and
    # --kv-cache-gb 0.25 to cover a configured KV budget: the settings show it and a swap keeps it.
    sites = [toy_int8_site(tmp_path_factory.mktemp("toy-int8")),
             build_and_install(tmp_path_factory.mktemp("gpu-only"), "kvforge-toy-gpu-only", "0.1",
                               "kvforge_toy_gpu_only", GPU_ONLY_SOURCE,
                               {"toy-gpu-only": "kvforge_toy_gpu_only:GpuOnlyMethod"})]
    pythonpath = os.pathsep.join([*map(str, sites), os.environ.get("PYTHONPATH", "")])
    process = ServeProcess("--data-dir", str(tmp_path_factory.mktemp("data")), "--kv-cache-gb", "0.25",
                           env={"PYTHONPATH": pythonpath})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def page(server):
    with launch_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url)
        page.wait_for_selector("#message textarea")
        page.get_by_text("Model settings").click()
        yield page


def test_memory_estimate_is_shown_before_applying(page, server):
    """The running model, the embedded GGUF, is estimated as `kvforge models` does (its own blocks)."""
    dtype = model_card(server)["dtype"]  # the settings start from the running model's (the default: auto, resolved)
    entry = describe(EMBEDDED_MODEL, embedded_gguf_path(), 8192, dtype)
    weights, total = entry.weights_bytes, entry.memory_bytes
    estimate = page.locator("#settings-estimate")
    estimate.filter(has_text=human_bytes(total)).wait_for()
    text = estimate.inner_text()
    assert human_bytes(weights) in text and human_bytes(total - weights) in text and "Q4_1" in text

    page.fill("#settings-context input", "1024")
    page.locator("#settings-context input").press("Enter")
    smaller = describe(EMBEDDED_MODEL, embedded_gguf_path(), 1024, dtype).memory_bytes
    estimate.filter(has_text=human_bytes(smaller - weights)).wait_for()  # KV scales with the context


def test_swap_quant_plugin_without_restart_in_flight_reply_finishes(page, server):
    assert served_quant(server) == "gguf"  # the embedded GGUF from its own blocks
    kv_bytes = model_card(server)["memory"]["kv_cache_bytes"]
    assert kv_bytes <= 0.25 * (1 << 30)
    page.wait_for_function("document.querySelector('#settings-kv-gb input').value === '0.25'")  # --kv-cache-gb
    choose(page, "settings-quant", "toy-int8")
    page.locator("#settings-quant-help").filter(has_text="test plugin").wait_for()
    # the plugin's declared option is rendered as an input of its type, with its default
    floor = page.locator("#quant-option-scale_floor input")
    floor.wait_for()
    assert float(floor.input_value()) == 1e-12
    floor.fill("0.000001")
    floor.press("Enter")
    page.wait_for_function("document.querySelector('#settings-quant-options textarea').value.includes('1e-06')")

    finished: dict = {}
    started = threading.Event()

    def long_reply() -> None:  # in flight while the swap is applied
        payload = {"prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True, "stream": True,
                   "temperature": 0}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=300) as r:
            for line in r.iter_lines():
                started.set()
                if '"finish_reason": "' in line:
                    finished.update(json.loads(line[6:])["choices"][0])

    reader = threading.Thread(target=long_reply)
    reader.start()
    assert started.wait(120)
    status = apply_and_wait(page)
    reader.join(timeout=300)
    assert finished.get("finish_reason") == "length", finished  # it ran to the end, not aborted
    assert status.startswith("Loaded") and "toy-int8" in status, status
    assert served_quant(server) == "toy-int8"
    card = model_card(server)
    assert card["quant_options"] == {"scale_floor": 1e-06}
    assert card["memory"]["kv_cache_bytes"] == kv_bytes  # the configured budget is kept (same dtype)

    page.fill("#message textarea", "What is the capital of France?")
    page.click("#send")
    page.locator("#reply-stats").filter(has_text="Last reply").wait_for()
    page.locator("#dashboard").filter(has_text="quant toy-int8").wait_for()
    stats = httpx.get(f"{server.url}/v1/sessions", timeout=10).json()["data"]
    assert stats and stats[0]["model"] is not None


def test_a_plugin_that_cannot_run_here_is_refused_and_the_old_model_keeps_serving(page, server):
    before = served_quant(server)
    choose(page, "settings-quant", "toy-gpu-only")
    # the options box follows the choice (toy-int8's options do not apply; the dense method's, inherited, do): wait
    # for it before applying
    page.wait_for_function("(v => v.includes('weights') && !v.includes('scale_floor'))"
                           "(document.querySelector('#settings-quant-options textarea').value)")
    status = apply_and_wait(page)
    assert status.startswith("Refused") and "cuda" in status and "keeps serving" in status, status
    assert served_quant(server) == before
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_swap_to_ngram_decoding_then_the_engine_speculates(page, server):
    assert httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["decoding"] == "none"
    choose(page, "settings-decoding", "ngram")
    page.locator("#settings-decoding-help").filter(has_text="prompt lookup").wait_for()
    # the options box holds the plugin's declared defaults; its inputs edit them
    page.wait_for_function("document.querySelector('#settings-decoding-options textarea').value.includes('max_n')")
    min_n = page.locator("#decoding-option-min_n input")
    min_n.fill("1")
    min_n.press("Enter")
    page.wait_for_function("document.querySelector('#settings-decoding-options textarea').value"
                           ".includes('\"min_n\": 1')")
    status = apply_and_wait(page)
    assert status.startswith("Loaded") and "decoding ngram" in status, status
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["decoding"] == "ngram" and card["decoding_options"]["min_n"] == 1, card

    page.click("#new-chat")  # clears the last reply's stats: the next ones are this reply's
    page.wait_for_function("!document.querySelector('#reply-stats').innerText.includes('Last reply')")
    page.fill("#message textarea", "Repeat exactly: the quick brown fox jumps over the lazy dog.")
    page.click("#send")
    page.locator("#reply-stats").filter(has_text="Last reply").wait_for()
    assert server.metric("spec_drafted_tokens") > 0  # the engine drafts and verifies
    page.locator("#dashboard").filter(has_text="decoding ngram").wait_for()
    page.locator("#dashboard").filter(has_text="Mean accepted length").wait_for()



def test_tensor_parallel_ranks_show_the_running_value_and_below_one_is_refused(page, server):
    page.wait_for_function("document.querySelector('#settings-tp input').value === '1'")
    before = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert before["tp"] == 1
    page.locator("#dashboard").filter(has_text="decoding").wait_for()
    assert "· tp" not in page.locator("#dashboard").inner_text()  # named on the dashboard only when > 1
    tp = page.locator("#settings-tp input")
    tp.fill("0")
    tp.press("Enter")
    page.click("#settings-apply")
    page.get_by_text("less than minimum value 1").wait_for()  # refused by the input before any swap
    after = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert {k: after[k] for k in ("id", "tp", "quant", "decoding")} == {k: before[k] for k in ("id", "tp", "quant",
                                                                                             "decoding")}
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
    assert reply.status_code == 200
    tp.fill("1")
    tp.press("Enter")


def estimated_kv_bytes(page) -> float:
    """The estimate's KV figure: "+ KV 22.5 MiB (int8) = ..." -> bytes."""
    value, unit = page.locator("#settings-estimate").inner_text().split("+ KV ", 1)[1].split()[:2]
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_kv_cache_type_changes_the_estimate_and_applied_the_pool_holds_more_tokens(page, server):
    """int8 chosen: the estimate's KV shrinks by int8's bytes against the model's dtype; applied (the --kv-cache-gb
    budget kept), the card and the dashboard show int8 and the tokens the pool holds, about twice bf16's."""
    before = model_card(server)
    assert before["kv_cache_dtype"] == "auto"
    page.wait_for_function("document.querySelector('#settings-kv-cache-dtype input[value=auto]').checked")
    page.locator("#settings-estimate").filter(has_text="Estimate for").wait_for()
    auto_kv = estimated_kv_bytes(page)
    page.locator("#settings-kv-cache-dtype label").filter(has_text="int8").click()
    page.locator("#settings-estimate").filter(has_text="(int8) =").wait_for()
    int8_per_token = kv_bytes_per_token(30, 3, 64, DTYPES[before["dtype"]], "int8")  # the embedded model's shape
    ratio = int8_per_token / before["memory"]["kv_bytes_per_token"]
    assert estimated_kv_bytes(page) / auto_kv == pytest.approx(ratio, rel=0.02)

    status = apply_and_wait(page)
    assert status.startswith("Loaded") and "KV cache int8" in status, status
    card = model_card(server)
    assert card["kv_cache_dtype"] == "int8" and card["memory"]["kv_bytes_per_token"] == int8_per_token, card
    tokens = card["memory"]["kv_cache_tokens"]
    assert card["memory"]["kv_cache_bytes"] <= 0.25 * (1 << 30)  # the configured budget is kept
    assert tokens == pytest.approx(before["memory"]["kv_cache_tokens"] / ratio, abs=32)  # whole blocks of 16
    page.locator("#dashboard").filter(has_text=f"int8 / {tokens:,} tokens").wait_for()
    page.wait_for_function("document.querySelector('#settings-kv-cache-dtype input[value=int8]').checked")
