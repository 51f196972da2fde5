"""A sandbox worker process: renders chat templates and trial-compiles grammars for the server, one job at a time,
so that what a model file or a request hands us can run out of time, memory or stack without the server.

Started by core/sandbox/pool.py as `python -m kvforge.core.sandbox.worker`; jobs and replies are frames on
stdin / stdout: a 4-byte big-endian length, then UTF-8 JSON (JSON, not pickle: a worker running untrusted code must
not be able to hand the server objects). The worker dies with the server (it watches for its re-parenting, and EOF
on stdin), its address space is capped (RLIMIT_AS: MEMORY_BUDGET_BYTES above what it holds at start), and the
server kills it past a job's time budget. It imports the standard library, jinja2 and llguidance only (no torch).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

MEMORY_BUDGET_BYTES = 1 << 30  # what one job may allocate (a render's strings, a grammar's automata)
MAX_FRAME_BYTES = 256 << 20  # a job carries a tokenizer (~2-10 MB of JSON) at most; a reply a rendered prompt
_HEADER = struct.Struct(">I")


class FrameError(EOFError):
    pass


def write_frame(stream: BinaryIO, message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=False, default=_placeholder).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    """The next frame; None at a clean end of stream."""
    header = _read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes")
    data = _read_exactly(stream, size)
    if data is None:
        raise FrameError("truncated frame")
    return json.loads(data)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    chunks, missing = [], size
    while missing:
        chunk = stream.read(missing)
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _placeholder(value: Any) -> str:
    return f"<{type(value).__name__}>"  # as HF's template data: anything not JSON becomes an inert name


def _die_with_parent() -> None:
    """Exit as soon as the server is gone, even mid-job: a thread watches for this process being re-parented.
    (PR_SET_PDEATHSIG would fire when the server *thread* that started the worker exits, and the server starts
    workers from its thread pool, whose threads come and go.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _cap_memory(extra: int) -> None:
    with open("/proc/self/status") as status:
        size = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:")), 0)
    if size:
        limit = size + extra
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Jobs:
    """The jobs a worker runs, by name; each returns a JSON value or raises."""

    def __init__(self) -> None:
        self.tokenizers: dict[str, Any] = {}

    def render(self, job: dict[str, Any]) -> str:
        from kvforge.core.sandbox import templates

        return templates.render(job["template"], job["context"], job["time_budget_s"])

    def grammar(self, job: dict[str, Any]) -> str | None:
        from kvforge.core.sandbox import grammars

        key = job["tokenizer_key"]
        if "tokenizer" in job:
            from llguidance import LLTokenizer

            spec = job["tokenizer"]
            self.tokenizers[key] = LLTokenizer(spec["json"], n_vocab=spec["n_vocab"], eos_token=spec["eos"] or None)
        return grammars.trial_compile(self.tokenizers[key], job["grammar"])


def main() -> None:
    _die_with_parent()
    from kvforge.core.sandbox.grammars import COMPILE_STACK_BYTES

    _cap_memory(MEMORY_BUDGET_BYTES + COMPILE_STACK_BYTES)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the reply stream
    jobs = Jobs()
    while True:
        job = read_frame(source)
        if job is None:
            return
        what = job.get("what", "the job")
        try:
            reply: dict[str, Any] = {"ok": getattr(jobs, job["op"])(job)}
        except MemoryError:
            # a worker that hit its memory cap is replaced rather than trusted again
            reply = {"error": f"{what} ran out of its memory budget ({MEMORY_BUDGET_BYTES >> 20} MiB)", "retire": True}
        except RecursionError:
            reply = {"error": f"{what} recursed too deeply"}
        except Exception as exc:
            reply = {"error": _describe(exc, what)}
        write_frame(sink, reply)
        if reply.get("retire"):
            return


def _describe(exc: Exception, what: str) -> str:
    from jinja2.exceptions import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return f"{what} does not parse: {exc.message} (line {exc.lineno})"
    return str(exc) or f"{what} failed: {type(exc).__name__}"


if __name__ == "__main__":
    main()
