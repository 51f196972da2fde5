"""The models loaded on demand as ModelHost (app/models/host.py) keeps them: a Resident per model (its engine,
measured bytes, keep-alive, requests in flight), a Lease per request, a Loading per model being built, and
close_and_free, which closes unloaded engines and gives their memory back at once."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field

from kvforge.app.models.keep_alive import FOREVER, forever_from_now
from kvforge.app.models.spec import ModelSpec
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.host_memory import release_freed_memory

log = logging.getLogger(__name__)


class ModelUnavailable(ValueError):
    """A model that can never be loaded on demand here (its memory or the count of resident models is taken by what
    cannot be unloaded); the message says which limit."""


@dataclass
class Resident:
    """A model loaded on demand."""

    name: str  # the models-directory entry it was loaded from (what requests name)
    spec: ModelSpec
    engine: AsyncEngine | None  # None once unloaded (nothing here may keep a closed engine's memory alive)
    memory_bytes: int  # its weights and KV pool, measured once loaded
    keep_alive_s: float  # idle seconds before it is unloaded (math.inf: until room is needed)
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)  # its keep-alive's unload, while idle

    def expires_at(self) -> float:
        """When it will be unloaded (time.time()) if it stays idle from now on (busy: its keep-alive from now);
        kept forever: Ollama's forever, ~292 years from now."""
        if self.keep_alive_s == FOREVER:
            return forever_from_now()
        idle = 0.0 if self.in_flight else time.monotonic() - self.last_used
        return time.time() + max(0.0, self.keep_alive_s - idle)


@dataclass
class Lease:
    """What a request runs on: the engine and the name it answers under, until released (ModelHost.release)."""

    engine: AsyncEngine
    name: str
    resident: Resident | None  # None: the server's own model


@dataclass
class Loading:
    """A model being loaded on demand: its task, its estimated bytes, and whether they count yet (not while the
    models unloaded to make room for it are still closing: their own places and memory count until then)."""

    need: int
    counted: bool = False
    task: asyncio.Task | None = None
    waiters: int = 0  # requests waiting for it: the model is in flight for each once loaded


def close_and_free(engines: list[AsyncEngine]) -> None:
    """Close engines and give their memory back to the system now (call it off the event loop). The list is emptied
    so that the caller's reference goes; then the cyclic garbage (an engine's parts refer to each other) is collected
    and glibc's free heap pages are returned (malloc_trim): freed memory otherwise stays in the process, whose heap
    keeps up to 1 GiB of it for the step loop (core/host_memory.py); so are the CUDA allocator's cached blocks."""
    while engines:
        try:
            engines.pop().close()
        except Exception:  # the others are still closed, and what this one freed is returned
            log.exception("closing an unloaded model failed")
    gc.collect()
    release_freed_memory()
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the CUDA allocator's cached blocks of the closed engines go back to the device
