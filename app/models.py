"""ModelHost: the model the server is serving, swapped without a process restart.

A swap (load / unload / change of dtype, quant or decoding plugin, tensor-parallel ranks) stops admitting
new requests (they wait), lets the in-flight ones finish, builds the new engine off the event loop, then
resumes. A failed load keeps the old model, except when the old and the new model are both tensor-parallel
(tp > 1): the old one is closed before the new one is built, so a failed load leaves no model loaded.
Model paths given over the API are confined to the models directory, and so is a decoding plugin's draft
model (its `model` option).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvforge.core.async_engine import AsyncEngine
from kvforge.core.config import engine_default
from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL
from kvforge.core.plugins import DECODING_GROUP, discover


class NoModelLoaded(RuntimeError):
    pass


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
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        return EMBEDDED_MODEL if self.model in EMBEDDED_ALIASES else Path(self.model).name


class ModelHost:
    def __init__(self, factory: Callable[[ModelSpec], AsyncEngine], spec: ModelSpec,
                 engine: AsyncEngine | None = None, models_dir: Path | None = None) -> None:
        self.factory, self.spec, self.engine = factory, spec, engine
        self.default_tp = spec.tp  # the server's --tp: what a load that names no tp uses
        self.models_dir = models_dir.resolve() if models_dir else None
        self.in_flight = 0
        self._ready = asyncio.Event()
        self._ready.set()
        self._swap_lock = asyncio.Lock()
        self.last_error: str | None = None

    @property
    def name(self) -> str | None:
        return self.spec.name if self.engine is not None else None

    @property
    def swapping(self) -> bool:
        """A load or unload is in progress: new requests wait for it."""
        return not self._ready.is_set()

    def current(self) -> AsyncEngine:
        if self.engine is None:
            raise NoModelLoaded("no model is loaded; load one with POST /admin/models/load")
        return self.engine

    async def acquire(self) -> AsyncEngine:
        """Wait out a swap in progress, then count the caller as in flight (pair with release())."""
        await self._ready.wait()
        engine = self.current()
        self.in_flight += 1
        return engine

    def release(self) -> None:
        self.in_flight -= 1

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
        if self.engine is not None:
            self.engine.close()
