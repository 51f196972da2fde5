"""Models loaded on demand by a real `kvforge serve`: three tiny random checkpoints in --models-dir beside the
embedded model (the server's own), at most three models resident: requests naming a model load it, a request while
every other resident model is busy waits for one to be idle (the least recently used idle one is unloaded), and
keep-alives unload idle ones; driven by the official openai and ollama clients."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.app.conftest import TINY_MODELS
from tests.app.test_agent_api import MODEL


@pytest.fixture(scope="module")
def server(models_server):  # tests/app/conftest.py
    return models_server


def loaded(server) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(f"{server.url}/api/ps", timeout=30).json()["models"]}


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
    assert resident[MODEL]["expires_at"] is None  # the server's own stays loaded
    assert resident["tiny-a"]["size"] > 0 and resident["tiny-a"]["expires_at"].endswith("Z")
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
    assert cards["tiny-a"]["loaded"] and cards["tiny-a"]["memory"]["kv_cache_bytes"] > 0
    chat = client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "tiny-b" and chat.usage.completion_tokens == 3
    assert len(client.embeddings.create(model="tiny-a", input="Hi").data[0].embedding) == 64
    tags = [m.model for m in ollama.Client(host=server.url).list().models]
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
