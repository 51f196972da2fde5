"""The one loop that drives a request's outputs, for every dialect and the sessions API: the server's request timeout,
each sample's text read into the reply's parts (app/generate/reply.py: thinking, text, tool calls, by ChoiceReader; a
raw prompt's text as it comes), finished samples counted in the metrics, and a failure after the response's headers went
out (the engine failed the request, or it ran past the timeout) handed over as an item the dialect writes into its
stream instead of an exception. A dialect's stream writer, and a whole response's collect(), only shape what this
yields."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvforge.app.generate.chat_output import ChoiceReader
from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.reply import Part, Text
from kvforge.app.http.errors import APIError
from kvforge.app.http.metrics import ServerMetrics
from kvforge.core.async_engine import RequestStream
from kvforge.core.engine import RequestsFailed
from kvforge.core.output import RequestOutput

T = TypeVar("T")


@dataclass(frozen=True)
class Read:
    """One engine output of one sample, read."""

    out: RequestOutput
    parts: list[Part]  # the reply's new parts, in order (none when `read` was off)
    first: bool  # the sample's first output (its first token: a true TTFT)
    called_tools: bool  # the sample has called tools so far (a finished one's finish reason)


class RequestTimedOut(Exception):
    kind, code = "timeout_error", "request_timeout"  # its type and code in OpenAI's error shape

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request ran past the server's --request-timeout of {seconds:g} s and was aborted")

    def api_error(self) -> APIError:
        """For a whole (not streamed) response: 504."""
        return APIError(504, str(self), None, self.kind, self.code)


@dataclass(frozen=True)
class Failed:
    """The request failed after the response started: what the stream says, in each API's terms."""

    error: RequestsFailed | RequestTimedOut
    status: int  # 503: the engine failed it; 504: past the server's request timeout (aborted, KV freed)
    kind: str  # OpenAI's error type
    code: str

    @property
    def message(self) -> str:
        return str(self.error)


def failed(error: RequestsFailed | RequestTimedOut) -> Failed:
    if isinstance(error, RequestTimedOut):
        return Failed(error, 504, error.kind, error.code)
    return Failed(error, 503, "server_error", "request_failed")


async def drive(stream: RequestStream, plan: ChatPlan | None, timeout_s: float | None, metrics: ServerMetrics,
                read: bool = True) -> AsyncIterator[Read | Failed]:
    """The request's outputs, each read (`plan`: a chat's, how its text is read; None: the text as it comes), until
    every sample has finished; then nothing more, or one Failed last. `read` False: no parts (a whole response
    reads the final text at once)."""
    readers: dict[int, ChoiceReader | None] = {}
    # a forced call's output is read even for a whole response: a repeated call ends its sample early
    reading = plan is not None and (read or plan.forced_calls)
    stopped: set[int] = set()
    try:
        async for out in within(stream, timeout_s):
            first = out.index not in readers
            reader = readers.setdefault(out.index, ChoiceReader(plan) if reading else None)
            if reader is not None:
                parts = reader.read(out)
                if reader.ended and not out.finished and out.index not in stopped:
                    stream.stop_sample(out.index)
                    stopped.add(out.index)
                if not read:
                    parts = []
            else:
                parts = [Text(out.delta_text)] if read and out.delta_text else []
            if out.finished:
                metrics.observe_finished(out)
            yield Read(out, parts, first, reader is not None and reader.num_tool_calls > 0)
    except (RequestsFailed, RequestTimedOut) as exc:
        yield failed(exc)


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's position (a completions batch's
    prompts streamed together); leaving early stops reading them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
            await queue.put((position, done))
        except Exception as exc:  # handed to the reader, raised there
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(position, stream)) for position, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


class StreamResponse(StreamingResponse):
    """A streamed response (server-sent events, or Ollama's JSON lines) that runs `on_close` however it ends — also
    when the client went away before the body generator started (its own `finally` never runs then): the
    admission ticket is released and the request aborted exactly once either way."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream", headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type=media_type, headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def within(stream: RequestStream, timeout_s: float | None) -> AsyncIterator[RequestOutput]:
    """The stream's outputs, aborting the request (its KV blocks freed) and raising RequestTimedOut once
    `timeout_s` seconds have passed since this call; no limit when None or 0."""
    if not timeout_s:
        async for out in stream:
            yield out
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            out = await asyncio.wait_for(stream.__anext__(), max(left, 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            stream.abort()
            raise RequestTimedOut(timeout_s) from None
        yield out
