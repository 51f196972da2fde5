"""ModelHost's memory budget for models loaded on demand (--models-memory-gb), with real engines of tiny checkpoints
in-process: what fits beside the server's own model stays, the least recently used idle model goes to make room,
a model that could never fit is refused before anything loads, the budget holds under six loads at once, an
unloaded engine is garbage at once, and the keep-alive parses Ollama's durations."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import shutil
import weakref

import pytest

from kvforge.app.models.factory import build_async_engine
from kvforge.app.models.host import ModelHost
from kvforge.app.models.keep_alive import LONGEST_KEEP_ALIVE_S, parse_keep_alive
from kvforge.app.models.residents import ModelUnavailable
from kvforge.app.models.spec import ModelSpec
from tests.helpers.tiny_models import save_tiny_model

KV_BYTES = 4 << 20


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, embedded_path):
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("one", "two", "three")):
        save_tiny_model("llama3", root / name, embedded_path, seed=seed)
    for i in range(6):  # six more names for one model: its files hard-linked
        shutil.copytree(root / "two", root / f"copy-{i}", copy_function=os.link)
    return root


def factory(spec: ModelSpec):
    # the spec's dtype (auto: bf16 on a CPU with native bf16), the one ModelHost's estimate reads; a dtype forced
    # here would load models twice the size of what the host counts for them
    return build_async_engine(spec, progress=False, kv_cache_bytes=KV_BYTES)


def test_the_memory_budget_unloads_the_least_recently_used_idle_model(models_dir):
    async def scenario() -> None:
        own = factory(ModelSpec(model=str(models_dir / "one")))
        host = ModelHost(factory, ModelSpec(model=str(models_dir / "one")), own, models_dir, max_loaded_models=10,
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


def test_six_loads_at_once_stay_within_the_budget_and_unloaded_engines_are_freed(models_dir):
    """Six requests naming six models at once, with bytes for the server's own model and two more: each is served
    (waiting for room), the bytes counted at once (resident, loading and closing) never exceed the budget; unloaded
    with keep-alives of 10 minutes pending, each engine is garbage at once (no timer, closure or table keeps it). A
    request that leaves while its model loads leaves the model idle once loaded."""
    names = [f"copy-{i}" for i in range(6)]

    async def scenario() -> None:
        own = factory(ModelSpec(model=str(models_dir / "one")))
        host = ModelHost(factory, ModelSpec(model=str(models_dir / "one")), own, models_dir, max_loaded_models=10,
                         kv_bytes=KV_BYTES, keep_alive_s=600)
        try:
            host.models_memory_bytes = int(3.5 * host.memory_of(own))

            async def use(name: str) -> str:
                lease = await host.acquire(name)
                await asyncio.sleep(0.05)
                host.release(lease)
                return lease.name

            assert await asyncio.gather(*map(use, names)) == names
            assert host.peak_bytes <= host.models_memory_bytes and host.peak_loaded == 3
            engines = [weakref.ref(engine) for name, engine, *_ in host.loaded() if name != "one"]
            assert len(engines) == 2
            for name in list(host.on_demand):
                assert await host.unload_on_demand(name)
            gc.collect()
            assert [ref() for ref in engines] == [None, None]
            assert host.occupancy() == (1, host.memory_of(own))
            # a request that leaves while its model loads: the load ends, and the model is idle (not held by it)
            leaving = asyncio.ensure_future(host.acquire("copy-0"))
            await asyncio.sleep(0.1)
            leaving.cancel()
            while "copy-0" not in host.on_demand:
                await asyncio.sleep(0.05)
            assert host.on_demand["copy-0"].in_flight == 0 and host.on_demand["copy-0"].timer is not None
        finally:
            await asyncio.to_thread(host.close)

    asyncio.run(scenario())


def test_keep_alive_durations():
    """As Ollama's Duration.UnmarshalJSON: numbers are seconds, strings Go durations, negative is forever; bounded by
    Go's longest duration (~292 years); booleans and other types refused."""
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0 and parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    assert parse_keep_alive(None) is None and parse_keep_alive("45") == 45 and parse_keep_alive(2.5) == 2.5
    assert parse_keep_alive("1.5h") == 5400 and parse_keep_alive("+5m") == 300 and parse_keep_alive(".5s") == 0.5
    assert parse_keep_alive("1h2m3s4ms5us6ns") == pytest.approx(3723.004005006)
    assert parse_keep_alive("1\u00b5s") == parse_keep_alive("1\u03bcs") == pytest.approx(1e-6)
    assert parse_keep_alive("0") == 0 and parse_keep_alive(-float("inf")) == math.inf and parse_keep_alive(-10**400)
    assert parse_keep_alive(9e9) == 9e9 and parse_keep_alive("2562047h") == 2562047 * 3600  # Go's longest in hours
    assert LONGEST_KEEP_ALIVE_S == pytest.approx(9223372036.854776)
    for bad in ("soon", "5 minutes", " 5m", "1d", "1e3h", "", "h", ".s", "5m-3s", True, False, [5], {"s": 5},
                float("nan"), float("inf"), 1e308, 10**400, "2562048h", "9223372037s"):
        with pytest.raises(ValueError, match="must be"):
            parse_keep_alive(bad)
