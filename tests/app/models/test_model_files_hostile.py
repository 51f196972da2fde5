"""Issue 40, finding 4: files in the models directory cannot exhaust, hang or leak through a real `kvforge serve`.

One server (README command 1 plus --models-dir) whose models directory holds, beside a good tiny GGUF: a GGUF whose
metadata claims an array of 2^62 items, a GGUF of a 300k-token vocabulary cut short (GGUFReader takes seconds per
read of it, and read it again on every listing), a FIFO named like a model (its open blocks), a symlink to a file
outside the directory, and a checkpoint directory whose weights file is a FIFO. The Ollama routes that read the
directory answer in seconds with the bad entries skipped or refused, the second listing comes from the cache,
loading a bad one by name is a 4xx naming the model field, the server's memory stays flat, and /health answers
in under a second throughout (watched from a thread for the whole module)."""

from __future__ import annotations

import json
import os
import time

import httpx
import ollama
import psutil
import pytest

from kvforge.app.models.catalog import LISTING_DEADLINE_S
from kvforge.core.loader import EMBEDDED_MODEL
from tests.helpers.health_watch import HealthWatch
from tests.helpers.hostile_files import huge_array_gguf, tiny_gguf, truncated_vocab_gguf
from tests.helpers.server_process import readme_serve

GOOD, HUGE, TRUNCATED, FIFO, OUTSIDE, FIFO_WEIGHTS = (
    "good.gguf", "huge-array.gguf", "truncated-vocab.gguf", "x.gguf", "passwd.gguf", "fifo-weights")
ROUTE_S = LISTING_DEADLINE_S + 3  # the listing deadline, and room for a busy machine
RSS_GROWTH = 300 << 20  # what the listings and failed loads may add (imports included); the finding grew GBs


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_path):
    root = tmp_path_factory.mktemp("models")
    tiny_gguf(root / GOOD)
    huge_array_gguf(root / HUGE)
    truncated_vocab_gguf(root / TRUNCATED, tokens=300_000)
    os.mkfifo(root / FIFO)
    os.symlink("/etc/passwd", root / OUTSIDE)
    (root / FIFO_WEIGHTS).mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # a load gets as far as the weights
        (root / FIFO_WEIGHTS / name).write_bytes((embedded_path / name).read_bytes())
    os.mkfifo(root / FIFO_WEIGHTS / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui", "--models-dir", str(models),
                           "--kv-cache-gb", "0.1")
    process.start_rss = psutil.Process(process.process.pid).memory_info().rss
    process.health = HealthWatch(process.url)
    yield process
    process.health.stop()
    process.stop(how="kill")  # on a server that regressed, a listing may be stuck growing its memory


def timed_get(url: str) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = httpx.get(url, timeout=ROUTE_S + 30)
    return response, time.monotonic() - start


def test_the_listing_answers_in_seconds_without_the_bad_entries_then_from_the_cache(server):
    tags, took = timed_get(f"{server.url}/api/tags")
    assert tags.status_code == 200 and took < ROUTE_S, took
    listed = {m["name"].removesuffix(":latest"): m for m in tags.json()["models"]}  # Ollama's tag on each name
    assert set(listed) == {EMBEDDED_MODEL, GOOD}  # the unreadable skipped; the FIFO and the symlink never listed
    assert listed[GOOD]["details"]["family"] == "llama" and listed[GOOD]["details"]["format"] == "gguf"
    again, took_again = timed_get(f"{server.url}/api/tags")
    assert again.json() == tags.json() and took_again < 1.0, took_again  # errors were cached: nothing re-read
    names = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert FIFO not in names and OUTSIDE not in names and GOOD in names
    assert [m.model.removesuffix(":latest") for m in ollama.Client(host=server.url, timeout=ROUTE_S).list().models
            ] == list(listed)


def test_show_and_ps_answer_in_seconds(server):
    client = ollama.Client(host=server.url, timeout=ROUTE_S)
    start = time.monotonic()
    assert client.show(GOOD).details.family == "llama"
    for name, status in ((HUGE, 400), (TRUNCATED, 400), (FIFO_WEIGHTS, 400), (FIFO, 404), (OUTSIDE, 404)):
        with pytest.raises(ollama.ResponseError) as refused:
            client.show(name)
        assert refused.value.status_code == status and "model" in refused.value.error, (name, refused.value)
    assert "passwd" not in json.dumps(httpx.post(f"{server.url}/api/show", json={"model": OUTSIDE}, timeout=30).json()
                                      ).replace(OUTSIDE, "")  # nothing of the file it points at
    assert [m.model for m in client.ps().models] == [f"{EMBEDDED_MODEL}:latest"]
    assert time.monotonic() - start < 2 * ROUTE_S


@pytest.mark.parametrize(("name", "status"), [(HUGE, 400), (TRUNCATED, 400), (FIFO_WEIGHTS, 400), (FIFO, 404),
                                              (OUTSIDE, 404)])
def test_loading_a_bad_file_by_name_is_a_4xx_naming_the_model(server, name, status):
    start = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2},
                          timeout=ROUTE_S + 30)
    assert response.status_code == status and response.json()["error"]["param"] == "model", response.text
    assert name in response.json()["error"]["message"]
    loaded = httpx.post(f"{server.url}/admin/models/load", json={"model": name}, timeout=ROUTE_S + 30)
    assert loaded.status_code == 400 and loaded.json()["error"]["param"] == "model", loaded.text
    assert time.monotonic() - start < ROUTE_S
    served = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert served.status_code == 200  # the server's own model kept serving


def test_memory_stays_flat_and_health_stayed_fast(server):
    try:  # listed once more (all cached by now), so this test reads every file even when run alone
        httpx.get(f"{server.url}/api/tags", timeout=ROUTE_S + 30)
    except httpx.TimeoutException:
        pass  # the memory figures below say why
    process = psutil.Process(server.process.pid)
    first = process.memory_info().rss
    time.sleep(1.0)
    last = process.memory_info().rss
    assert last - first < 32 << 20, "the server's memory is still growing after the requests ended"
    assert last - server.start_rss < RSS_GROWTH, (server.start_rss, last)
    deadline = time.monotonic() + 5  # the watch samples every 0.2 s: a quick run of the module took only ~10
    while server.health.samples <= 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health.samples > 10 and server.health.slowest < 1.0, server.health.slowest
