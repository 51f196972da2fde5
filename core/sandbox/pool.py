"""The server's side of the sandbox workers (core/sandbox/worker.py): a few worker processes, one job each at a time,
a worker killed and replaced when its job runs past its time budget, is cancelled (its client left), or crashes it.

`render_template` (chat templates) and `trial_compile` (grammars the server has not seen) are the two jobs. A job
waits for a free worker; the wait has no deadline of its own (each job ahead of it ends within its budget) but is
cancelled with the job. Cancelling: `CANCEL` holds a threading.Event the job's caller sets (app code sets it when
the request's task is cancelled, see app/generate/admit.py off_loop); the job stops at the next poll (POLL_S).
"""

from __future__ import annotations

import atexit
import contextvars
import hashlib
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from kvforge.core.sandbox.templates import TIME_BUDGET_S
from kvforge.core.sandbox.worker import read_frame, write_frame

WORKERS = 2  # jobs at once; each worker holds ~30 MB (a tokenizer for grammars: more)
GRACE_S = 1.0  # past a job's budget, the worker's own deadline check has this long to answer before it is killed
GRAMMAR_TIME_S = 10.0  # a trial compile (the largest grammar within the limits compiles in ~1 s)
POLL_S = 0.05
WORKER_MODULE = "kvforge.core.sandbox.worker"  # what a worker runs (`python -m`)
CANCEL: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("kvforge_sandbox_cancel",
                                                                                default=None)


class SandboxRefused(ValueError):
    """The job failed or hit a limit (the template raised, ran past its budget, the grammar does not compile...).
    `timed_out`: it ran past its time budget, which a busier machine may explain (not worth remembering)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class SandboxCancelled(RuntimeError):
    """The job's caller cancelled it (its client went away)."""


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self.tokenizers: set[str] = set()  # tokenizers this worker already holds, by key

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()

    def run(self, job: dict[str, Any], budget_s: float, cancel: threading.Event | None, what: str) -> dict[str, Any]:
        """The job's reply; the worker killed (and SandboxRefused / SandboxCancelled raised) when it runs GRACE_S past
        `budget_s`, is cancelled, or dies. `what`: the job's subject in the error messages."""
        try:
            write_frame(self.process.stdin, job)
        except (BrokenPipeError, OSError):
            raise SandboxRefused(f"{what} {self._death()}") from None
        deadline = time.monotonic() + budget_s + GRACE_S
        fd = self.process.stdout.fileno()
        while True:
            if cancel is not None and cancel.is_set():
                self.kill()
                raise SandboxCancelled("cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise SandboxRefused(f"{what} ran past its time budget of {budget_s:g} s and was stopped", True)
            ready, _, _ = select.select([fd], [], [], min(POLL_S, left))
            if ready:
                break
        try:
            reply = read_frame(self.process.stdout)  # the worker writes a whole frame at once
        except (EOFError, ValueError):
            reply = None
        if reply is None:
            raise SandboxRefused(f"{what} {self._death()}")
        return reply

    def _death(self) -> str:
        code = self.process.wait()
        self.kill()
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"crashed the sandbox worker ({how})"


class SandboxPool:
    def __init__(self, size: int = WORKERS) -> None:
        self.size = size
        self._idle: list[_Worker] = []
        self._started = 0  # workers alive (idle or busy)
        self._cond = threading.Condition()
        self._closed = False

    def _take(self, cancel: threading.Event | None) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxRefused("the server is shutting down")
                if cancel is not None and cancel.is_set():
                    raise SandboxCancelled("cancelled")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    worker.kill()
                    self._started -= 1
                if self._started < self.size:
                    self._started += 1
                    break
                self._cond.wait(POLL_S)
        try:
            return _Worker()
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            if worker.alive() and not self._closed:
                self._idle.append(worker)
            else:
                worker.kill()
                self._started -= 1
            self._cond.notify()

    def run(self, job: dict[str, Any], budget_s: float, what: str, prepare=None) -> Any:
        """The job's result in a free worker (`prepare(worker, job)` may add to the job what that worker lacks);
        SandboxRefused with the reason, `what` named, when the job fails, hits a limit, runs past `budget_s` or
        crashes its worker."""
        cancel = CANCEL.get()
        worker = self._take(cancel)
        try:
            if prepare is not None:
                prepare(worker, job)
            reply = worker.run({**job, "what": what}, budget_s, cancel, what)
            if reply.get("retire"):
                worker.kill()
        finally:
            self._give_back(worker)
        if "error" in reply:
            raise SandboxRefused(reply["error"])
        return reply["ok"]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in idle:
            worker.kill()


_POOL: SandboxPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> SandboxPool:
    """The process's sandbox pool, started at first use (its workers at their first job)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = SandboxPool()
            atexit.register(_POOL.close)
        return _POOL


def render_template(template: str, context: dict[str, Any], time_budget_s: float = TIME_BUDGET_S) -> str:
    """The chat template rendered in a sandbox worker (core/sandbox/templates.py); SandboxRefused with the reason when
    it fails, hits a limit or runs past `time_budget_s`."""
    job = {"op": "render", "template": template, "context": context, "time_budget_s": time_budget_s}
    return pool().run(job, time_budget_s, "the chat template")


class TokenizerSpec:
    """What a worker needs to build the server's llguidance tokenizer: the HF tokenizer's JSON, the vocabulary size
    and the end-of-sequence ids (llguidance.hf.from_tokenizer's inputs), keyed by their hash."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int]) -> None:
        self.spec = {"json": tokenizer_json, "n_vocab": n_vocab, "eos": eos}
        self.key = hashlib.sha256(f"{n_vocab} {eos} ".encode() + tokenizer_json.encode()).hexdigest()


def trial_compile(tokenizer: TokenizerSpec, grammar: str) -> str | None:
    """The grammar compiled (and its first mask computed) in a sandbox worker on the server's compile stack
    (core/sandbox/grammars.py): None when it compiles, llguidance's error when it does not; SandboxRefused when it
    crashes the worker or runs past its time."""

    def prepare(worker: _Worker, job: dict[str, Any]) -> None:
        if tokenizer.key not in worker.tokenizers:
            job["tokenizer"] = tokenizer.spec
            worker.tokenizers.add(tokenizer.key)

    job = {"op": "grammar", "tokenizer_key": tokenizer.key, "grammar": grammar}
    return pool().run(job, GRAMMAR_TIME_S, "the grammar", prepare)
