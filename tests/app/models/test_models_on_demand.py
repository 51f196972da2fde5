"""Models loaded on demand by a real `kvforge serve`: three tiny random checkpoints in --models-dir beside the
embedded model (the server's own), at most three models resident: requests naming a model load it, a request while
every other resident model is busy waits for one to be idle (the least recently used idle one is unloaded), and
keep-alives unload idle ones; driven by the official openai and ollama clients. The limits hold under a burst of
requests naming eight models at once, an unloaded model's memory goes back to the system at once, and keep_alive
is bounded and parsed as Ollama parses it (/api/ps never fails)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import threading
import time
from datetime import UTC, datetime

import httpx
import numpy as np
import ollama
import openai
import psutil
import pytest

from tests.app.conftest import TINY_MODELS
from tests.app.test_agent_api import MODEL
from tests.helpers.health_watch import HealthWatch


@pytest.fixture(scope="module")
def server(models_server):  # tests/app/conftest.py
    return models_server


def loaded(server) -> dict[str, dict]:
    models = httpx.get(f"{server.url}/api/ps", timeout=30).json()["models"]
    return {m["name"].removesuffix(":latest"): m for m in models}  # Ollama lists names with a tag


def complete(server, model: str, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 6,
                                                                "temperature": 0, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_naming_a_model_loads_it_and_the_lists_say_so(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) >= {MODEL, *TINY_MODELS, "broken"} and listed[MODEL].loaded and not listed["tiny-a"].loaded
    first = client.completions.create(model="tiny-a", prompt="Hello", max_tokens=6, temperature=0)
    assert first.model == "tiny-a" and first.usage.completion_tokens == 6
    again = complete(server, "tiny-a:latest")  # Ollama's tag: the same model
    other = complete(server, "tiny-b")
    assert again["choices"][0]["text"] == first.choices[0].text != other["choices"][0]["text"]  # its own weights
    resident = loaded(server)
    assert set(resident) == {MODEL, "tiny-a", "tiny-b"}
    assert resident[MODEL]["expires_at"].startswith("23")  # the server's own stays loaded: Ollama's forever
    assert resident["tiny-a"]["size"] > 0 and resident["tiny-a"]["expires_at"].endswith("Z")
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
    assert cards["tiny-a"]["loaded"] and cards["tiny-a"]["memory"]["kv_cache_bytes"] > 0
    chat = client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "tiny-b" and chat.usage.completion_tokens == 3
    assert len(client.embeddings.create(model="tiny-a", input="Hi").data[0].embedding) == 64
    tags = [m.model.removesuffix(":latest") for m in ollama.Client(host=server.url).list().models]
    assert set(tags) >= {MODEL, *TINY_MODELS}


def test_a_request_waits_while_every_resident_model_is_busy(server):
    """tiny-a and tiny-b busy (long streams held open) with the embedded model: three resident, the limit. A request
    for tiny-c waits; once tiny-a's stream ends, tiny-a (idle, least recently used) is unloaded and tiny-c served."""
    # a small receive buffer (no autotuning): the server cannot send far ahead of what the test reads
    small_buffer = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)]
    busy = {name: httpx.Client(timeout=300, transport=httpx.HTTPTransport(socket_options=small_buffer))
            for name in ("tiny-a", "tiny-b")}
    streams, lines = {}, {}
    try:
        for name, http in busy.items():
            # 16 samples of 4000 tokens (~12 MB of events): more than the sockets buffer, so the response stays
            # unsent (the request in flight) until the stream is closed, however fast the CPU generates
            request = http.build_request("POST", f"{server.url}/v1/completions", json={
                "model": name, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True, "n": 16,
                "temperature": 1})
            streams[name] = http.send(request, stream=True)
            assert streams[name].status_code == 200
            lines[name] = streams[name].iter_lines()  # kept: dropping the iterator would close the connection
            assert next(lines[name]).startswith("data: ")  # generating
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete, server, "fast")  # the alias of tiny-c
            time.sleep(2)
            assert not waiting.done(), waiting.exception()
            assert set(loaded(server)) == {MODEL, "tiny-a", "tiny-b"}
            assert complete(server, MODEL)["model"] == MODEL  # the server's own model still answers meanwhile
            streams["tiny-a"].close()  # the client goes: its request is aborted, tiny-a idle
            assert waiting.result(timeout=120)["model"] == "tiny-c"  # answered under its own name
        assert set(loaded(server)) == {MODEL, "tiny-b", "tiny-c"}
    finally:
        for name, http in busy.items():
            if name in streams:
                streams[name].close()
            http.close()


def test_keep_alive_unloads_an_idle_model(server):
    client = ollama.Client(host=server.url, timeout=300)
    reply = client.generate(model="tiny-a", prompt="Hello", raw=True, options={"num_predict": 2}, keep_alive="1s")
    assert reply.eval_count == 2 and "tiny-a" in loaded(server)
    deadline = time.monotonic() + 30
    while "tiny-a" in loaded(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "tiny-a" not in loaded(server)
    assert "tiny-b" in loaded(server)  # the server's 10 minutes
    assert client.generate(model="tiny-b", prompt="", keep_alive=0).done_reason == "unload"  # Ollama's unload
    assert "tiny-b" not in loaded(server)
    assert client.generate(model="tiny-b", prompt="").done_reason == "load"  # and its load
    assert "tiny-b" in loaded(server)


def test_models_that_cannot_be_loaded_are_clear_errors(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "broken", "prompt": "x"}, timeout=120)
    assert response.status_code == 400 and "could not be loaded" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "../etc", "prompt": "x"}, timeout=60)
    assert response.status_code == 404
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url).generate(model="tiny-a", prompt="x", keep_alive="soon")
    assert refused.value.status_code == 400 and "keep_alive" in refused.value.error
    assert complete(server, "tiny-c")["model"] == "tiny-c"  # a failed load leaves the others serving


def test_the_embedding_model_embeds_for_requests_naming_the_servers_own(server):
    """--embedding-model tiny-embed: embeddings asked of the server's own model (or of no model) come from it, loaded
    on demand and pooled as its sentence-transformers config says; chat stays with the server's own model."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
    default = client.embeddings.create(model=MODEL, input=["Hello there", "x"], encoding_format="float")
    named = client.embeddings.create(model="tiny-embed", input=["Hello there", "x"], encoding_format="float")
    assert default.model == named.model == "tiny-embed" and len(default.data[0].embedding) == 64
    assert np.allclose([d.embedding for d in default.data], [d.embedding for d in named.data], atol=1e-5)
    no_model = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, timeout=120).json()
    assert no_model["model"] == "tiny-embed"
    assert np.allclose(no_model["data"][0]["embedding"], named.data[1].embedding, atol=1e-5)
    assert complete(server, MODEL)["model"] == MODEL


def unload_all_on_demand(server) -> None:
    """Ollama's unload (an empty request with keep_alive 0) for every resident model but the server's own."""
    for name in set(loaded(server)) - {MODEL}:
        response = httpx.post(f"{server.url}/api/generate", json={"model": name, "keep_alive": 0}, timeout=120)
        assert response.json()["done_reason"] == "unload", response.text
    assert set(loaded(server)) == {MODEL}


@pytest.fixture
def burst_models(server):
    """Eight more models of the directory: tiny-a's files hard-linked under eight names (no copies); unloaded and
    removed after."""
    names = [f"burst-{i}" for i in range(8)]
    for name in names:
        shutil.copytree(server.models / "tiny-a", server.models / name, copy_function=os.link)
    yield names
    unload_all_on_demand(server)
    for name in names:
        shutil.rmtree(server.models / name)


class ResidentWatch:
    """Polls the server from a thread while a test runs: the most models /api/ps lists and the most the server counts
    (/metrics models_loaded: loading and closing ones included) at any moment."""

    def __init__(self, server) -> None:
        self.server, self.listed, self.counted, self.polls = server, 0, 0, 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        try:
            while not self._stop.is_set():
                self.listed = max(self.listed, len(loaded(self.server)))
                self.counted = max(self.counted, self.server.metric("models_loaded"))
                self.polls += 1
        except BaseException as exc:  # raised again by stop(), in the test's thread
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.error is not None:
            raise self.error


def test_eight_models_at_once_never_exceed_the_resident_limit(server, burst_models):
    """Eight requests naming eight models at once, three slots (the server's own model holds one): every request is
    answered by its own model (waiting while the slots are busy), and at no moment are more than three models
    resident, as /api/ps lists them and as the server counts them (loading and closing ones included)."""
    watch, health = ResidentWatch(server), HealthWatch(server.url)

    def chat(name: str) -> str:
        if name.endswith(("1", "3", "5", "7")):
            reply = ollama.Client(host=server.url, timeout=300).chat(
                model=name, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4})
            assert reply.done and reply.eval_count == 4
            return reply.model
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4
        return reply.model

    try:
        with concurrent.futures.ThreadPoolExecutor(len(burst_models)) as pool:
            answered = list(pool.map(chat, burst_models))
    finally:
        watch.stop()
        health.stop()
    assert answered == burst_models  # every request answered, by the model it named
    assert watch.polls >= 5 and watch.listed <= 3 and watch.counted <= 3, vars(watch)
    assert server.metric("models_loaded_peak") <= 3  # the most the server counted at once since it started
    assert health.samples >= 5 and health.slowest < 1 and server.process.poll() is None


def test_an_unloaded_model_gives_its_memory_back_at_once(server):
    """Three load / use / unload cycles (a constrained chat each: a compiled grammar too) with the server's
    keep-alive of 10 minutes: the server's RSS stays where it was with only its own model loaded, within less than
    one tiny model's weights and KV pool (each cycle's model kept alive until its timer fired added that much)."""
    process = psutil.Process(server.process.pid)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)

    def cycle(name: str) -> int:
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                               response_format={"type": "json_object"})
        assert reply.model == name
        size = loaded(server)[name]["size"]
        unloaded = httpx.post(f"{server.url}/api/generate", json={"model": name, "keep_alive": 0}, timeout=120)
        assert unloaded.json()["done_reason"] == "unload"
        assert set(loaded(server)) == {MODEL}
        return size

    unload_all_on_demand(server)
    cycle("tiny-a")  # once first: what the first load of a process sets up for good is not counted
    baseline = process.memory_info().rss
    sizes, rss = [], []
    for name in TINY_MODELS:
        sizes.append(cycle(name))
        rss.append(process.memory_info().rss)
    grown, model = max(rss) - baseline, min(sizes)
    assert grown < model, f"RSS {baseline >> 20} MiB -> {[r >> 20 for r in rss]} MiB; one model: {model >> 20} MiB"


# keep_alive values as JSON texts that Ollama refuses or that overflow its Go duration (~292 years): booleans (true
# was taken as 1 s), other types, strings that are no Go duration, numbers beyond it (1e308 made /api/ps fail)
REFUSED_KEEP_ALIVES = ["true", "false", "[]", "{}", '""', '"5 minutes"', '"1e3h"', '"1d"', '"9223372037s"',
                       "9223372037", "1e308", "1e400", "Infinity", "NaN", "1" + "0" * 30]


def test_keep_alive_is_bounded_and_parsed_as_ollama_parses_it(server):
    """Ollama's Duration: numbers are seconds, strings Go durations, negative is forever (expires_at ~292 years on,
    as Ollama shows it); anything else is a 400 naming keep_alive, on each route that takes it; /api/ps answers
    after each, every expires_at a timestamp the official client reads."""
    for route, fields in {"generate": '"prompt": ""', "chat": '"messages": []', "embed": '"input": "x"'}.items():
        for keep_alive in REFUSED_KEEP_ALIVES:
            response = httpx.post(f"{server.url}/api/{route}", timeout=60,
                                  content=f'{{"model": "tiny-a", {fields}, "keep_alive": {keep_alive}}}')
            assert response.status_code == 400 and "keep_alive" in response.json()["error"], (route, response.text)
    assert httpx.get(f"{server.url}/api/ps", timeout=30).status_code == 200
    client = ollama.Client(host=server.url, timeout=300)

    def expires_in(name: str, keep_alive) -> float:
        assert client.generate(model=name, prompt="", keep_alive=keep_alive).done_reason == "load"
        running = {m.model.removesuffix(":latest"): m for m in client.ps().models}  # it parses every expires_at
        return (running[name].expires_at - datetime.now(UTC)).total_seconds()

    forever = 292 * 365.25 * 86400
    assert expires_in("tiny-a", -1) == pytest.approx(forever, rel=1e-3)  # Ollama's forever
    assert expires_in("tiny-b", 9e9) == pytest.approx(9e9, rel=1e-6)  # just under Go's longest duration
    assert expires_in("tiny-b", "1h30m") == pytest.approx(5400, abs=60)
    assert expires_in("tiny-b", "1.5h") == pytest.approx(5400, abs=60)  # Go's fractions
    running = {m.model.removesuffix(":latest"): m for m in client.ps().models}
    assert (running[MODEL].expires_at - datetime.now(UTC)).total_seconds() == pytest.approx(forever, rel=1e-3)
    assert expires_in("tiny-b", "+1500ms") < 2  # Go's sign and units: unloaded once idle for 1.5 s
    deadline = time.monotonic() + 30
    while "tiny-b" in loaded(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "tiny-b" not in loaded(server)
    unload_all_on_demand(server)
