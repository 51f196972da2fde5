"""ModelHost: the models the server is serving -- its own model, swapped without a process restart, and the models
that requests load on demand by name.

The server's own model (the one it starts with, or loads over /admin and the UI's settings) answers requests that
name no model or its name; it stays loaded. A swap (load / unload / change of dtype, quant or decoding plugin,
tensor-parallel ranks) stops admitting new requests (they wait), lets the in-flight ones finish, builds the new
engine off the event loop, then resumes. A failed load keeps the old model, except when the old and the new model
both run in several processes (tp or pp > 1): the old one is closed before the new one is built, so a failed load
leaves no model loaded.

A request naming another model of the models directory (a GGUF file or checkpoint directory by name, or an alias
from the settings) loads it on demand, with the server's settings and one rank. Such models stay resident while
they are used and for their keep-alive after (the server's --keep-alive, or the last request's Ollama keep_alive);
at most --max-loaded-models models (the server's own included) and --models-memory-gb of weights + KV pools are
resident at once, counting those still loading or closing, however many requests come at once (a load takes its
place in the same event-loop step as it decides there is room): the least recently used idle one is unloaded to make
room, and when every resident model is busy the request waits until one is idle. A model loaded for waiting requests
is theirs first (in flight for each). Requests in flight always finish on the engine they started on. An unloaded
engine is closed and its memory given back to the system at once (no timer or table keeps it; gc, malloc_trim).

Model paths given over the API are confined to the models directory, and so is a decoding plugin's draft model
(its `model` option).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvforge.app.models.keep_alive import FOREVER, parse_keep_alive
from kvforge.app.models.residents import Lease, Loading, ModelUnavailable, Resident, close_and_free
from kvforge.app.models.spec import ModelSpec, checked
from kvforge.app.settings import serve_default
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.loader import EMBEDDED_MODEL

log = logging.getLogger(__name__)

DEFAULT_MAX_LOADED_MODELS = serve_default("max_loaded_models")  # --max-loaded-models' (Ollama's default on a CPU)
DEFAULT_KEEP_ALIVE_S = parse_keep_alive(serve_default("keep_alive"))  # --keep-alive's (Ollama's five minutes)


class NoModelLoaded(RuntimeError):
    pass


class ModelHost:
    def __init__(self, factory: Callable[[ModelSpec], AsyncEngine], spec: ModelSpec,
                 engine: AsyncEngine | None = None, models_dir: Path | None = None, *,
                 max_loaded_models: int = DEFAULT_MAX_LOADED_MODELS, models_memory_bytes: int | None = None,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, aliases: dict[str, str] | None = None,
                 kv_bytes: int | None = None, embedding_model: str | None = None) -> None:
        """`max_loaded_models`, `models_memory_bytes` (None: no byte limit), `keep_alive_s`: the limits of the models
        loaded on demand (see the module's docstring); `aliases`: request names -> models-directory entries;
        `kv_bytes`: the KV pool an engine gets (for the memory estimate before a load); `embedding_model`: the entry
        that embeds for requests naming no model or the server's own (None: the server's own model does)."""
        self.factory, self.spec, self.engine = factory, spec, engine
        # the server's --tp / --pp / --cpu-experts: for a load naming none of them
        self.default_tp, self.default_pp, self.default_cpu_experts = spec.tp, spec.pp, spec.cpu_experts
        self.models_dir = models_dir.resolve() if models_dir else None
        self.in_flight = 0
        self._ready = asyncio.Event()
        self._ready.set()
        self._swap_lock = asyncio.Lock()
        self.last_error: str | None = None
        self.max_loaded_models, self.models_memory_bytes = max_loaded_models, models_memory_bytes
        self.keep_alive_s, self.aliases = keep_alive_s, dict(aliases or {})
        from kvforge.core.config import CPU_KV_CACHE_BYTES

        self.kv_bytes = kv_bytes or CPU_KV_CACHE_BYTES
        self.embedding_model = embedding_model
        if embedding_model is not None and self.aliases.get(embedding_model, embedding_model) not in self.available():
            raise ValueError(f"embedding model {embedding_model!r} is not in the models directory ({self.models_dir})")
        self.on_demand: dict[str, Resident] = {}  # by name
        self._loading: dict[str, Loading] = {}  # by name
        self._closing: dict[int, int] = {}  # id(engine) -> its bytes, for engines unloaded and not yet closed
        self._changed = asyncio.Event()  # set (and replaced) whenever a model is released, loaded or unloaded
        self._memory: dict[int, int] = {}  # id(engine) -> its measured bytes
        self._tasks: set[asyncio.Task] = set()  # loads and unloads under way (asyncio keeps only weak references)
        self.peak_loaded, self.peak_bytes = self.occupancy()  # the most models (and bytes) counted at once

    @property
    def name(self) -> str | None:
        return self.spec.name if self.engine is not None else None

    @property
    def default_entry(self) -> str:
        """The models-directory entry (file or directory name; the embedded model's name) of the server's own model,
        which may be served under another name."""
        return self.spec.entry

    @property
    def swapping(self) -> bool:
        """A load or unload is in progress: new requests wait for it."""
        return not self._ready.is_set()

    def current(self) -> AsyncEngine:
        if self.engine is None:
            raise NoModelLoaded("no model is loaded; load one with POST /admin/models/load")
        return self.engine

    def check(self, spec: ModelSpec) -> ModelSpec:
        """The spec with its paths confined to the models directory, checked (app/models/spec.py); InvalidSpec when
        refused."""
        return checked(spec, self.models_dir)

    def available(self) -> list[str]:
        """What a load may name: the list `kvforge models` describes (app/models/catalog.py)."""
        from kvforge.app.models.catalog import model_names

        return model_names(self.models_dir)

    async def load(self, spec: ModelSpec) -> None:
        spec = self.check(spec)
        async with self._swap_lock:
            await self._drain()
            try:
                if self.engine is not None and self.spec.processes > 1 and spec.processes > 1:
                    # Two multi-process engines cannot coexist in one process: each owns the process's one
                    # torch.distributed default process group. So the old one goes first; if the new build
                    # then fails, no model is loaded (as after unload) and last_error says why.
                    await self._retire_own()
                new = await asyncio.to_thread(self.factory, spec)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._ready.set()
                raise
            retired = [self.engine] if self.engine is not None else []
            self.engine, self.spec = new, spec
            self.last_error = None
            self._ready.set()
            del new
        await self._retire(retired)
        self._notify()

    async def unload(self) -> None:
        async with self._swap_lock:
            await self._drain()
            await self._retire_own()
            self._ready.set()

    async def _retire_own(self) -> None:
        """Close the server's own model (drained) and free its memory; no model is loaded after."""
        retired = [self.engine] if self.engine is not None else []
        self.engine = None
        await self._retire(retired)
        self._notify()

    async def _drain(self) -> None:
        self._ready.clear()  # new requests wait from here on
        while self.in_flight > 0:
            await asyncio.sleep(0.05)

    def close(self) -> None:
        for resident in list(self.on_demand.values()):
            if resident.timer is not None:
                resident.timer.cancel()
            resident.engine.close()
        self.on_demand.clear()
        if self.engine is not None:
            self.engine.close()

    # --- models loaded on demand ------------------------------------------------------------------------------

    def entry_for(self, name: str | None) -> str | None:
        """The models-directory entry a request's model name loads on demand, or None for the server's own model (no
        name, "", its name; Ollama's ":latest" tag is dropped). LookupError when it names no model here."""
        if name in (None, ""):
            return None
        base = name.removesuffix(":latest")
        if base == self.name or (self.engine is None and base == self.spec.name) or self.swapping:
            return None  # during a swap the served name is changing: the request waits for the new model
        if base in self.on_demand:
            return base
        base = self.aliases.get(base, base)
        if base == self.default_entry and self.engine is not None:
            return None
        if base in self.available():
            return base
        raise LookupError(f"model {name!r} does not exist; this server serves {self.name!r} and loads the models of "
                          "its models directory by name (GET /v1/models lists them)")

    async def acquire(self, name: str | None = None, keep_alive_s: float | None = None) -> Lease:
        """The engine a request for `name` runs on, counted as in flight until release(). The server's own model:
        after a swap in progress. Another: loaded first if it is not resident (waiting for room while every
        resident model is busy); `keep_alive_s` (None: as it is, or the server's) becomes its keep-alive."""
        entry = self.entry_for(name)
        if entry is None:
            await self._ready.wait()
            engine = self.current()
            self.in_flight += 1
            return Lease(engine, self.spec.name, None)
        resident = await self._resident(entry)  # counted in flight: no unload can take it from here on
        self._expire_later(resident)  # busy: no expiry
        if keep_alive_s is not None:
            resident.keep_alive_s = keep_alive_s
        return Lease(resident.engine, entry, resident)

    def release(self, lease: Lease | None = None) -> None:
        resident = lease.resident if lease is not None else None
        if resident is None:
            self.in_flight -= 1
            return
        self._release_resident(resident)

    def _release_resident(self, resident: Resident) -> None:
        resident.in_flight -= 1
        resident.last_used = time.monotonic()
        if resident.in_flight == 0:
            self._expire_later(resident)
        self._notify()

    def loaded(self) -> list[tuple[str, AsyncEngine, int, Resident | None]]:
        """Every resident model: its name, engine, measured bytes and (for one loaded on demand) its Resident."""
        models = [(self.spec.name, self.engine, self.memory_of(self.engine), None)] if self.engine is not None else []
        return models + [(r.name, r.engine, r.memory_bytes, r) for r in self.on_demand.values()]

    def memory_of(self, engine: AsyncEngine) -> int:
        """An engine's weights and KV pool (on this process's rank), measured once."""
        if id(engine) not in self._memory:
            runtime = engine.engine.runtime()
            self._memory[id(engine)] = runtime.weight_bytes + runtime.kv_cache_bytes
        return self._memory[id(engine)]

    def occupancy(self) -> tuple[int, int]:
        """The models holding memory now, the server's own included, and their bytes: resident (measured), loading
        (estimated, once the models unloaded to make room for them are closed) or unloaded and still closing. What
        --max-loaded-models and --models-memory-gb bound."""
        own = [self.memory_of(self.engine)] if self.engine is not None else []
        sizes = [*own, *(r.memory_bytes for r in self.on_demand.values()), *self._closing.values(),
                 *(load.need for load in self._loading.values() if load.counted)]
        return len(sizes), sum(sizes)

    async def unload_on_demand(self, name: str) -> bool:
        """Unload a model loaded on demand once its requests have finished (Ollama's keep_alive 0 with no prompt);
        False when it is not resident."""
        resident = self.on_demand.get(name)
        if resident is None:
            return False
        resident.keep_alive_s = 0
        while resident.in_flight and self.on_demand.get(name) is resident:
            await self._wait_for_change()
        if self.on_demand.get(name) is resident:
            await self._unload(resident)
        return True

    def _notify(self) -> None:
        count, used = self.occupancy()
        self.peak_loaded, self.peak_bytes = max(self.peak_loaded, count), max(self.peak_bytes, used)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_change(self) -> None:
        await self._changed.wait()

    def _background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task that runs to its end whoever awaits it (a request that leaves does not cancel a load half way)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error nobody awaited is not logged
        return task

    def _expire_later(self, resident: Resident) -> None:
        """(Re)start an idle resident model's keep-alive; stop it while the model is busy or kept forever. One timer
        per model, cancelled when it is unloaded: a pending timer would keep its engine's memory alive."""
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        if resident.in_flight or resident.keep_alive_s == FOREVER or self.on_demand.get(resident.name) is not resident:
            return
        resident.timer = asyncio.get_running_loop().call_later(resident.keep_alive_s, self._expire, resident)

    def _expire(self, resident: Resident) -> None:
        resident.timer = None
        self._background(self._unload(resident))  # _detach checks that it is still resident and idle

    def _detach(self, resident: Resident) -> AsyncEngine | None:
        """Take an idle resident model out of the table (nobody acquires it from here on) and its engine out of it
        (counted as closing until _retire); None when it is gone already or in use again."""
        if self.on_demand.get(resident.name) is not resident or resident.in_flight:
            return None
        del self.on_demand[resident.name]
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        engine, resident.engine = resident.engine, None
        self._memory.pop(id(engine), None)
        self._closing[id(engine)] = resident.memory_bytes
        return engine

    async def _retire(self, engines: list[AsyncEngine]) -> None:
        """Close engines taken out of use and give their memory back (close_and_free, off the event loop; the list
        is emptied there so that no reference here outlives the close)."""
        keys = [id(engine) for engine in engines]
        try:
            if engines:
                await asyncio.to_thread(close_and_free, engines)
        finally:
            for key in keys:
                self._closing.pop(key, None)
                self._memory.pop(key, None)

    async def _unload(self, *residents: Resident) -> None:
        """Unload idle resident models: all taken out of the table at once, then closed off the event loop (to the
        end even if the caller is cancelled)."""
        engines = [engine for engine in map(self._detach, residents) if engine is not None]
        if engines:
            await asyncio.shield(self._background(self._unloaded(engines)))

    async def _unloaded(self, engines: list[AsyncEngine]) -> None:
        try:
            await self._retire(engines)
        finally:
            self._notify()

    async def _resident(self, entry: str) -> Resident:
        """The resident model of `entry`, counted in flight for the caller; loaded first (after room is made) if it
        is not resident. A model loaded for waiting requests is theirs when it is ready: counted in flight for
        each, so that no other request unloads it to make room before they run (which could go on forever)."""
        resident = self.on_demand.get(entry)
        if resident is not None:
            resident.in_flight += 1
            return resident
        spec = replace(self.check(ModelSpec(model=entry, tp=1)), served_name=entry)
        need = await asyncio.to_thread(self._estimate, entry)
        while True:
            resident = self.on_demand.get(entry)
            if resident is not None:
                resident.in_flight += 1  # in the same step as the check: no unload can take it from here on
                return resident
            loading = self._loading.get(entry)
            if loading is None:
                victims = self._room_for(entry, need)
                if victims is None:
                    await self._wait_for_change()  # a request finishing, a load ending, a model unloaded or closed
                    continue
                # Its place is taken in this same step, so no other request counts the room it needs as free.
                engines = [engine for engine in map(self._detach, victims) if engine is not None]
                loading = self._loading[entry] = Loading(need, counted=not engines)
                loading.task = self._background(self._load_on_demand(entry, spec, loading, engines))
                self._notify()
            loading.waiters += 1
            try:
                return await asyncio.shield(loading.task)  # its error is ours (and every waiter's)
            except asyncio.CancelledError:  # the request left: its place in the load, or the model, goes back
                task = loading.task
                if task.done() and not task.cancelled() and task.exception() is None:
                    self._release_resident(task.result())
                else:
                    loading.waiters -= 1
                raise

    async def _load_on_demand(self, entry: str, spec: ModelSpec, loading: Loading,
                              victims: list[AsyncEngine]) -> Resident:
        """Close the models unloaded to make room, then build `entry`'s engine and make it resident, in flight for
        the requests waiting for it."""
        try:
            await self._retire(victims)
            loading.counted = True  # the victims' places and memory are this load's now
            self._notify()
            engine = await asyncio.to_thread(self.factory, spec)
        except Exception as exc:
            del self._loading[entry]
            self._notify()
            raise ModelUnavailable(f"model {entry!r} could not be loaded: {type(exc).__name__}: {exc}") from exc
        resident = Resident(entry, spec, engine, self.memory_of(engine), self.keep_alive_s, in_flight=loading.waiters)
        del self._loading[entry]
        self.on_demand[entry] = resident
        self._expire_later(resident)  # idle (every waiter left): unloaded after its keep-alive unless used
        self._notify()
        return resident

    def _estimate(self, entry: str) -> int:
        """Bytes a model of the models directory will take once loaded: its weights as kvforge holds them (the
        catalog's estimate) and a KV pool."""
        from kvforge.app.models.catalog import describe
        from kvforge.core.loader import embedded_gguf_path

        path = embedded_gguf_path() if entry == EMBEDDED_MODEL else self.models_dir / entry
        weights = describe(entry, path, context=0).weights_bytes
        return (weights or 0) + self.kv_bytes

    def _room_for(self, entry: str, need: int) -> list[Resident] | None:
        """The idle models to unload, least recently used first, so that one more model of `need` bytes fits beside
        everything occupancy() counts; None when it cannot fit until something changes (the models that would have
        to go are busy, loading or closing). ModelUnavailable when it never can."""
        budget = self.models_memory_bytes if self.models_memory_bytes is not None else math.inf
        pinned = self.memory_of(self.engine) if self.engine is not None else 0
        fixed = int(self.engine is not None)  # the server's own model is never unloaded to make room
        if fixed + 1 > self.max_loaded_models or pinned + need > budget:
            raise ModelUnavailable(
                f"model {entry!r} cannot be loaded: it needs about {need / 2**30:.2f} GiB, and the server's own model "
                f"takes {fixed} of --max-loaded-models {self.max_loaded_models} and {pinned / 2**30:.2f} GiB of "
                f"--models-memory-gb {budget / 2**30:.2f}")
        count, used = self.occupancy()
        idle = sorted((r for r in self.on_demand.values() if not r.in_flight), key=lambda r: r.last_used)
        victims = []
        while (count + 1 > self.max_loaded_models or used + need > budget) and idle:
            victim = idle.pop(0)
            victims.append(victim)
            count, used = count - 1, used - victim.memory_bytes
        if count + 1 > self.max_loaded_models or used + need > budget:
            return None
        return victims


