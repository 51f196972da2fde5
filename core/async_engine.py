"""AsyncEngine: the engine loop in a background thread, one async stream of deltas per request.

Requests are validated in the caller's thread (so a bad request fails at once, before anything
is queued) and handed to the loop thread, which applies new requests and aborts between steps;
the loop never blocks the caller's event loop. Outputs are handed back to each stream's event
loop thread-safely, all of a step's at once: one wakeup of each event loop per step, not one per
token per stream (each wakeup is a syscall on the engine thread and a chance for the event loop to
take the GIL mid-step). A step that raises fails the requests in it, not the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvforge.core.config import EngineConfig
from kvforge.core.engine import LLMEngine, RequestsFailed
from kvforge.core.images import ImagePrompt
from kvforge.core.metrics import EngineStats
from kvforge.core.output import RequestOutput
from kvforge.core.pooling import PoolingParams
from kvforge.core.sampling import SamplingParams

log = logging.getLogger(__name__)

IDLE_PERSIST_POLL_S = 0.05  # idle with deferred KV blocks: how often the writer's backlog is looked at again


class RequestStream:
    """Async iterator of one request's RequestOutputs (all its samples), ending when all finish.
    Leaving the iteration early (break, cancellation, a closed connection) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_samples: int) -> None:
        self.engine, self.request_id = engine, request_id
        self._remaining = num_samples
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._remaining == 0:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the client is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._remaining = 0
            raise item
        if item.finished:
            self._remaining -= 1
        return item

    def abort(self) -> None:
        if self._remaining:
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def stop_sample(self, index: int) -> None:
        """End sample `index` now, finish reason "stop": its reader has the whole reply (the other samples go on)."""
        if self._remaining:
            self.engine.abort(self.request_id, index, "stop")


def _hand_over(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """On the consumers' event loop: a step's outputs into their streams, in order."""
    for stream, item in items:
        stream._queue.put_nowait(item)


def build_off_main_thread(build: Callable[[], Any]) -> Any:
    """Run `build` (loading a model) in a short-lived thread. Measured here: once the main thread has
    run parallel torch work, oneDNN matmuls issued from the engine thread run ~2x slower; keeping all
    of the engine's torch work off the main thread avoids that."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvforge-load") as pool:
        return pool.submit(build).result()


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None = None, on_fatal: Callable[[str], None] | None = None,
                 **config: Any) -> None:
        """`on_fatal(why)` is called (from the engine thread) when the engine can no longer run at all -- a
        tensor-parallel rank died -- after every open request has failed with that error."""
        self.engine = engine or build_off_main_thread(lambda: LLMEngine(**config))
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._unfinished: dict[str, int] = {}  # samples of each request not yet delivered as finished
        # what the engine thread has for the streams, by their event loop, until _flush hands it over
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self.engine.on_failure(self._wakeup.set)  # a tensor-parallel rank dying while idle wakes the loop
        self._thread = threading.Thread(target=self._loop, name="kvforge-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt: str | list[int] | ImagePrompt, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, group: str | None = None) -> RequestStream:
        """Validate and queue a request (PoolingParams: an embedding request, core/pooling.py); returns its stream.
        `group`: the client request it is part of (LLMEngine.add_request). Must be called from a running event loop.
        Raises ValueError (RequestRejected included) for a request that cannot run."""
        if self._stopped:
            raise RuntimeError("the engine is closed")
        params = params or SamplingParams()
        prompt_ids = self.engine.validate_prompt(prompt, params)
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = stream
        self._unfinished[request_id] = params.n
        images = prompt.images if isinstance(prompt, ImagePrompt) else []
        self._commands.put(("add", request_id, prompt_ids, params, group, images))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Abort at the next step (every sample, or sample `index`): its blocks are freed and its stream ends with
        finish_reason `reason`."""
        self._commands.put(("abort", request_id, index, reason))
        self._wakeup.set()

    def abort_all(self) -> None:
        """Abort every request in flight (graceful shutdown): each stream still gets its final output."""
        for request_id in list(self._streams):
            self.abort(request_id)

    @property
    def config(self) -> EngineConfig:
        """The configuration the engine was built with."""
        return self.engine.config

    @property
    def placement(self) -> list[dict]:
        """Where each part of the model lives, stage by stage (fixed once loaded: LLMEngine.placement)."""
        return self.engine.placement

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe to read from any thread), with the persisted
        tier's figures read live (its writer works while the engine is idle)."""
        if self.engine.persisted is None:
            return self._stats
        return replace(self._stats, **self.engine.disk_stats())

    def close(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.close()

    # --- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._flush()
                if self.engine.failure():
                    self._die(self.engine.failure())
                    return
                self._apply_commands()
                if not self.engine.has_unfinished():
                    more = self.engine.persist_deferred()  # KV blocks the busy steps had no time to save
                    self._stats = self.engine.stats()
                    self._flush()
                    self._wakeup.wait(IDLE_PERSIST_POLL_S if more else None)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except RequestsFailed as exc:  # e.g. out of device memory: only these requests stop
                    log.warning("%s", exc)
                    for request_id in exc.request_ids:
                        self._fail(request_id, exc)
                    continue
                except Exception as exc:  # fail the requests of this step, keep serving the others
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    continue  # unless the engine cannot run any more (checked at the top)
                for output in outputs:
                    self._deliver(output)
                self._flush()
                self._stats = self.engine.stats()
            self._fail_all(RuntimeError("the engine was closed"))
        finally:
            self._flush()

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        self._outbox.setdefault(stream._loop, []).append((stream, item))

    def _flush(self) -> None:
        """Hand everything queued to the streams: one call into each consumer event loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # the consumers' event loop is closed: nobody can read these any more
                for request_id in dict.fromkeys(stream.request_id for stream, _ in items):
                    self.abort(request_id)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt_ids, params, group, images = command
                if request_id not in self._streams:
                    continue  # aborted before it was added
                try:
                    self.engine.add_validated(prompt_ids, params, request_id=request_id, group=group, images=images)
                except Exception as exc:
                    self._unfinished.pop(request_id, None)
                    self._send(self._streams.pop(request_id), exc)
            else:
                _, request_id, index, reason = command
                for output in self.engine.abort(request_id, index, reason):
                    self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        self._send(stream, output)
        if output.finished:
            self._unfinished[output.request_id] -= 1
            if self._unfinished[output.request_id] == 0:
                del self._streams[output.request_id], self._unfinished[output.request_id]

    def _die(self, why: str) -> None:
        self.fatal = why
        log.error("the engine cannot run any more: %s", why)
        self._stopped = True
        error = RuntimeError(f"the engine stopped: {why}")
        for request_id in list(self._streams):  # no engine.abort: the engine cannot run (or free) anything now
            self._unfinished.pop(request_id, None)
            self._send(self._streams.pop(request_id), error)
        self._flush()
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._fail(request_id, exc)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """End the request's stream with `exc` (the engine has stopped it already)."""
        self._unfinished.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send(stream, exc)
