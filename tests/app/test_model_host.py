"""ModelHost's memory budget for models loaded on demand (--models-memory-gb), with real engines of tiny checkpoints
in-process: what fits beside the server's own model stays, the least recently used idle model goes to make room,
a model that could never fit is refused before anything loads, and the keep-alive parses Ollama's durations."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvforge.app.engine_factory import build_async_engine
from kvforge.app.models import ModelHost, ModelSpec, ModelUnavailable, parse_keep_alive
from tests.helpers.tiny_models import save_tiny_model

KV_BYTES = 4 << 20


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, embedded_path):
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("one", "two", "three")):
        save_tiny_model("llama3", root / name, embedded_path, seed=seed)
    return root


def factory(spec: ModelSpec):
    return build_async_engine(spec, progress=False, kv_cache_bytes=KV_BYTES, dtype="float32")


def test_the_memory_budget_unloads_the_least_recently_used_idle_model(models_dir):
    async def scenario() -> None:
        own = factory(ModelSpec(str(models_dir / "one")))
        host = ModelHost(factory, ModelSpec(str(models_dir / "one")), own, models_dir, max_loaded_models=10,
                         kv_bytes=KV_BYTES)
        try:
            one_model = host.memory_of(own)
            # room for the server's own model and one more: a second on demand must unload the first
            host.models_memory_bytes = int(2.5 * one_model)
            two = await host.acquire("two")
            host.release(two)
            three = await host.acquire("three")
            assert [name for name, *_ in host.loaded()] == ["one", "three"]
            # while "three" is busy, "two" waits for room; it is served once "three" is released
            waiting = asyncio.ensure_future(host.acquire("two"))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            host.release(three)
            host.release(await asyncio.wait_for(waiting, 60))
            assert [name for name, *_ in host.loaded()] == ["one", "two"]
            host.models_memory_bytes = int(1.5 * one_model)  # nothing fits beside the server's own model
            with pytest.raises(ModelUnavailable, match="--models-memory-gb"):
                await host.acquire("three")
        finally:
            await asyncio.to_thread(host.close)

    asyncio.run(scenario())


def test_keep_alive_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0 and parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    assert parse_keep_alive(None) is None and parse_keep_alive("45") == 45
    for bad in ("soon", "5 minutes", True, "1d", float("nan")):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)
