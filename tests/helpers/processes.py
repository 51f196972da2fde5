"""The processes a test expects a server or an engine to leave behind: none, or its tensor-parallel ranks. The
sandbox workers (core/sandbox/pool.py) of a process that rendered a chat template or compiled a grammar are its
children too, by design, and stay for its life: they are not counted."""

from __future__ import annotations

import psutil

from kvforge.core.sandbox.pool import WORKER_MODULE


def rank_processes(pid: int | None = None) -> list[psutil.Process]:
    """The descendants of `pid` (default: this process) that are not sandbox workers."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if WORKER_MODULE not in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found
