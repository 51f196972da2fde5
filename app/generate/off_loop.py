"""Work a request hands to a thread, stopped with the request: when the awaiting task is cancelled (its client left,
app/http/disconnect.py), the sandbox job the work started (a chat template's render, a grammar's trial compile:
core/sandbox/pool.py) is cancelled too and its worker process killed, instead of running on to its time budget."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from kvforge.core.sandbox.pool import CANCEL

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args) -> T:
    """fn(*args) on Starlette's thread pool (the thread sees this task's context variables, CANCEL among them)."""
    cancel = threading.Event()
    token = CANCEL.set(cancel)
    try:
        return await run_in_threadpool(fn, *args)
    except asyncio.CancelledError:
        cancel.set()
        raise
    finally:
        CANCEL.reset(token)
