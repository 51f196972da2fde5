"""ModelHost: the models the server is serving -- its own model, swapped without a process restart, and the models
that requests load on demand by name.

The server's own model (the one it starts with, or loads over /admin and the UI's settings) answers requests that
name no model or its name; it stays loaded. A swap (load / unload / change of dtype, quant or decoding plugin,
tensor-parallel ranks) stops admitting new requests (they wait), lets the in-flight ones finish, builds the new
engine off the event loop, then resumes. A failed load keeps the old model, except when the old and the new model
are both tensor-parallel (tp > 1): the old one is closed before the new one is built, so a failed load leaves no
model loaded.

A request naming another model of the models directory (a GGUF file or checkpoint directory by name, or an alias
from the settings) loads it on demand, with the server's settings and one rank. Such models stay resident while
they are used and for their keep-alive after (the server's --keep-alive, or the last request's Ollama keep_alive);
at most --max-loaded-models models (the server's own included) and --models-memory-gb of weights + KV pools are
resident at once: the least recently used idle one is unloaded to make room, and when every resident model is busy
the request waits until one is idle. Requests in flight always finish on the engine they started on.

Model paths given over the API are confined to the models directory, and so is a decoding plugin's draft model
(its `model` option).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvforge.core.async_engine import AsyncEngine
from kvforge.core.config import engine_default
from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL
from kvforge.core.plugins import DECODING_GROUP, discover

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's five minutes
DEFAULT_MAX_LOADED_MODELS = 3  # Ollama's default on a CPU
FOREVER = math.inf


class NoModelLoaded(RuntimeError):
    pass


class ModelUnavailable(ValueError):
    """A model that can never be loaded on demand here (its memory or the count of resident models is taken by what
    cannot be unloaded); the message says which limit."""


def parse_keep_alive(value: float | int | str | None) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds or a duration ("5m", "1h30m", "45s", "250ms"); negative:
    forever (math.inf); 0: unload as soon as idle. None when not given. ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be seconds or a duration such as '5m', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        parts = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:ms|h|m|s))+|\d+(?:\.\d+)?)", text)
        if parts is None:
            raise ValueError(f"keep_alive must be seconds or a duration such as '5m', '1h30m', '-1', got {value!r}")
        units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
        amounts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)?", parts.group(2))
        seconds = sum(float(n) * units[u or "s"] for n, u in amounts) * (-1 if parts.group(1) else 1)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number")
    return FOREVER if seconds < 0 else seconds


@dataclass
class Resident:
    """A model loaded on demand."""

    name: str  # the models-directory entry it was loaded from (what requests name)
    spec: ModelSpec
    engine: AsyncEngine
    memory_bytes: int  # its weights and KV pool, measured once loaded
    keep_alive_s: float  # idle seconds before it is unloaded (math.inf: until room is needed)
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def expires_at(self) -> float | None:
        """When it will be unloaded (time.time()), if it stays idle; None while busy or kept forever."""
        if self.in_flight or self.keep_alive_s == FOREVER:
            return None
        return time.time() + max(0.0, self.last_used + self.keep_alive_s - time.monotonic())


@dataclass
class Lease:
    """What a request runs on: the engine and the name it answers under, until released (ModelHost.release)."""

    engine: AsyncEngine
    name: str
    resident: Resident | None  # None: the server's own model


class InvalidSpec(ValueError):
    """A load refused before anything is built or drained; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_decoding(decoding: str | None, options: dict[str, Any] | None) -> None:
    """Refuse an unknown decoding plugin, options its schema rejects (the message names the option), or
    options given with no plugin, before a model is loaded. The engine checks the rest (e.g. a draft
    model's tokenizer) as it builds the plugin."""
    if decoding in (None, "", "none"):
        if options:
            raise InvalidSpec(f"decoding options {', '.join(map(repr, sorted(options)))} given without a decoding "
                              "plugin (decoding is 'none')", "decoding_options")
        return
    registry = discover(DECODING_GROUP)
    try:
        cls = registry.get(decoding)
    except ValueError as exc:
        raise InvalidSpec(str(exc), "decoding") from None
    try:
        cls.validate_options(dict(options or {}))
    except ValueError as exc:
        raise InvalidSpec(str(exc), "decoding_options") from None


def max_tp_ranks() -> int:
    """One process per rank, each loading its share of the model: a request may start at most 8 of them, or one
    per CPU core or GPU where there are more."""
    import torch

    return max(8, os.cpu_count() or 1, torch.cuda.device_count())


@dataclass(frozen=True)
class ModelSpec:
    """Which model is served and how it is loaded; what it leaves open is EngineConfig's default (or, under
    `kvforge serve`, the server's setting). Built into an engine by app/engine_factory.py."""

    model: str | None = engine_default("model")  # None: the embedded default
    dtype: str = engine_default("dtype")
    quant: str = engine_default("quant")
    quant_options: dict[str, Any] = field(default_factory=dict)
    served_name: str | None = None
    kv_cache_gb: float | None = None  # None: the server's --kv-cache-gb
    decoding: str = engine_default("decoding")  # speculative decoding plugin; "none": off
    decoding_options: dict[str, Any] = field(default_factory=dict)
    tp: int = engine_default("tp_size")  # tensor-parallel ranks, one process each

    @property
    def entry(self) -> str:
        """The model's models-directory entry (file or directory name; the embedded model's name)."""
        return EMBEDDED_MODEL if self.model in EMBEDDED_ALIASES else Path(self.model).name

    @property
    def name(self) -> str:
        return self.served_name or self.entry


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
        self.default_tp = spec.tp  # the server's --tp: what a load that names no tp uses
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
        self._loading: dict[str, tuple[asyncio.Future, int]] = {}  # name -> (its load, its estimated bytes)
        self._changed = asyncio.Event()  # set (and replaced) whenever a model is released, loaded or unloaded
        self._memory: dict[int, int] = {}  # id(engine) -> its measured bytes

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

    def confine(self, model: str | None) -> str | None:
        """The embedded default, or a path inside the models directory; anything else is refused."""
        if model in EMBEDDED_ALIASES:
            return None
        if self.models_dir is None:
            raise ValueError("no models directory is configured (--models-dir); only the embedded model can be loaded")
        path = (self.models_dir / model).resolve()
        if not path.is_relative_to(self.models_dir):
            raise ValueError(f"model path {model!r} is outside the models directory")
        if not path.exists():
            raise ValueError(f"model {model!r} not found in the models directory")
        if not (path.is_file() or path.is_dir()):  # a FIFO, device or socket: its open would block or act
            raise ValueError(f"model {model!r} is not a regular file or a checkpoint directory")
        return str(path)

    def check(self, spec: ModelSpec) -> ModelSpec:
        """The spec with its paths confined to the models directory (the model, and a decoding plugin's
        draft model, option `model`), its tensor-parallel ranks and its decoding plugin checked; InvalidSpec
        when refused."""
        if isinstance(spec.tp, bool) or not isinstance(spec.tp, int) or spec.tp < 1:
            raise InvalidSpec(f"tp (tensor-parallel ranks) must be an integer >= 1, got {spec.tp!r}", "tp")
        most = max_tp_ranks()
        if spec.tp > most:
            raise InvalidSpec(f"tp (tensor-parallel ranks) must be at most {most} on this machine, got {spec.tp}",
                              "tp")
        try:
            model = self.confine(spec.model)
        except ValueError as exc:
            raise InvalidSpec(str(exc), "model") from None
        check_decoding(spec.decoding, spec.decoding_options)
        options = dict(spec.decoding_options or {})
        draft = options.get("model")
        if isinstance(draft, str) and draft:
            try:  # the embedded model keeps its alias (the option must stay a non-empty string)
                options["model"] = self.confine(draft) or draft
            except ValueError as exc:
                raise InvalidSpec(f"decoding option 'model': {exc}", "decoding_options") from None
        return replace(spec, model=model, decoding_options=options)

    def available(self) -> list[str]:
        """What a load may name: the list `kvforge models` describes (app/model_catalog.py)."""
        from kvforge.app.model_catalog import model_names

        return model_names(self.models_dir)

    async def load(self, spec: ModelSpec) -> None:
        spec = self.check(spec)
        async with self._swap_lock:
            await self._drain()
            try:
                if self.engine is not None and self.spec.tp > 1 and spec.tp > 1:
                    # Two tensor-parallel engines cannot coexist in one process: each owns the process's one
                    # torch.distributed default process group. So the old one goes first; if the new build
                    # then fails, no model is loaded (as after unload) and last_error says why.
                    old, self.engine = self.engine, None
                    await asyncio.to_thread(old.close)
                new = await asyncio.to_thread(self.factory, spec)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._ready.set()
                raise
            old, self.engine, self.spec = self.engine, new, spec
            self.last_error = None
            self._ready.set()
        if old is not None:
            await asyncio.to_thread(old.close)

    async def unload(self) -> None:
        async with self._swap_lock:
            await self._drain()
            old, self.engine = self.engine, None
            self._ready.set()
        if old is not None:
            await asyncio.to_thread(old.close)

    async def _drain(self) -> None:
        self._ready.clear()  # new requests wait from here on
        while self.in_flight > 0:
            await asyncio.sleep(0.05)

    def close(self) -> None:
        for resident in list(self.on_demand.values()):
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
        resident = await self._resident(entry)
        resident.in_flight += 1
        if keep_alive_s is not None:
            resident.keep_alive_s = keep_alive_s
        return Lease(resident.engine, entry, resident)

    def release(self, lease: Lease | None = None) -> None:
        resident = lease.resident if lease is not None else None
        if resident is None:
            self.in_flight -= 1
            return
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
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_change(self) -> None:
        await self._changed.wait()

    def _expire_later(self, resident: Resident) -> None:
        if resident.keep_alive_s == FOREVER:
            return
        stamp = resident.last_used

        def expire() -> None:
            if resident.last_used == stamp:  # not used since (_unload checks that it is still resident and idle)
                asyncio.ensure_future(self._unload(resident))

        asyncio.get_running_loop().call_later(resident.keep_alive_s, expire)

    def _detach(self, resident: Resident) -> bool:
        """Take an idle resident model out of the table (nobody acquires it from here on); False when it is gone
        already or in use again."""
        if self.on_demand.get(resident.name) is not resident or resident.in_flight:
            return False
        del self.on_demand[resident.name]
        self._memory.pop(id(resident.engine), None)
        return True

    async def _unload(self, *residents: Resident) -> None:
        """Unload idle resident models: all taken out of the table at once, then closed off the event loop."""
        detached = [r for r in residents if self._detach(r)]
        if detached:
            await asyncio.gather(*(asyncio.to_thread(r.engine.close) for r in detached))
            self._notify()

    async def _resident(self, entry: str) -> Resident:
        while True:
            resident = self.on_demand.get(entry)
            if resident is not None:
                return resident
            if entry in self._loading:  # another request is loading it: wait for that load (its error is ours)
                await asyncio.shield(self._loading[entry][0])
                continue
            spec = replace(self.check(ModelSpec(model=entry, tp=1)), served_name=entry)
            need = await asyncio.to_thread(self._estimate, entry)
            if entry in self.on_demand or entry in self._loading:
                continue  # it changed while the estimate ran
            if await self._make_room(entry, need):
                return await self._load_on_demand(entry, spec, need)

    async def _load_on_demand(self, entry: str, spec: ModelSpec, need: int) -> Resident:
        done = asyncio.get_running_loop().create_future()
        self._loading[entry] = (done, need)
        try:
            engine = await asyncio.to_thread(self.factory, spec)
        except Exception as exc:
            error = ModelUnavailable(f"model {entry!r} could not be loaded: {type(exc).__name__}: {exc}")
            done.set_exception(error)
            done.exception()  # retrieved: a load nobody else waited for is not an unhandled error
            raise error from exc
        finally:
            del self._loading[entry]
            self._notify()
        resident = Resident(entry, spec, engine, self.memory_of(engine), self.keep_alive_s)
        self.on_demand[entry] = resident
        done.set_result(None)
        self._expire_later(resident)  # unloaded after its keep-alive unless a request uses it
        return resident

    def _estimate(self, entry: str) -> int:
        """Bytes a model of the models directory will take once loaded: its weights as kvforge holds them (the
        catalog's estimate) and a KV pool."""
        from kvforge.app.model_catalog import describe
        from kvforge.core.loader import embedded_gguf_path

        path = embedded_gguf_path() if entry == EMBEDDED_MODEL else self.models_dir / entry
        weights = describe(entry, path, context=0).weights_bytes
        return (weights or 0) + self.kv_bytes

    async def _make_room(self, entry: str, need: int) -> bool:
        """Unload the least recently used idle models until one more of `need` bytes fits; True when it does, False
        after waiting for a change (every resident model that would have to go is busy): look again."""
        budget = self.models_memory_bytes if self.models_memory_bytes is not None else math.inf
        pinned = self.memory_of(self.engine) if self.engine is not None else 0
        fixed = int(self.engine is not None)  # the server's own model is never unloaded to make room
        if fixed + 1 > self.max_loaded_models or pinned + need > budget:
            raise ModelUnavailable(
                f"model {entry!r} cannot be loaded: it needs about {need / 2**30:.2f} GiB, and the server's own model "
                f"takes {fixed} of --max-loaded-models {self.max_loaded_models} and {pinned / 2**30:.2f} GiB of "
                f"--models-memory-gb {budget / 2**30:.2f}")
        count = fixed + len(self.on_demand) + len(self._loading)
        used = pinned + sum(r.memory_bytes for r in self.on_demand.values()) + sum(n for _, n in self._loading.values())
        idle = sorted((r for r in self.on_demand.values() if not r.in_flight), key=lambda r: r.last_used)
        victims = []
        while (count + 1 > self.max_loaded_models or used + need > budget) and idle:
            victim = idle.pop(0)
            victims.append(victim)
            count, used = count - 1, used - victim.memory_bytes
        if count + 1 > self.max_loaded_models or used + need > budget:
            await self._wait_for_change()  # a request finishing, a load ending, a model unloaded
            return False
        await self._unload(*victims)
        return True
