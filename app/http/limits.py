"""Bounded work per connection and per request body, before any handler runs.

- `BodyLimit` (ASGI): a body over `max_bytes` gets 413 before it is parsed — at once when Content-Length
  says so, else as soon as the streamed body passes the cap; a body that stops arriving for
  `read_timeout_s` gets 408.
  Starlette's RequestBodyLimitMiddleware (and FastAPI's max_body_size) raise only when a route reads
  its body, answer in plain text, and have no read deadline: this one refuses on Content-Length before
  any route runs, answers in OpenAI's error shape on every route (Gradio's too) and names the setting.
- `header_timeout_protocol`: uvicorn's h11 protocol with a deadline on each request's head. uvicorn closes
  idle keep-alive connections, but a connection that sends part of a request head and then nothing stays
  open for ever, and enough of them fill `limit_concurrency`; this one closes it after `seconds`.
"""

from __future__ import annotations

import asyncio

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvforge.app.http.errors import error_response

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # parsed on the event loop: 4 MiB of JSON takes ~0.2 s (measured)


class BodyTooLarge(HTTPException):
    """Raised from receive(): an HTTPException, so FastAPI's body parsing passes it on as it is."""

    code = "request_too_large"  # the error's code in OpenAI's shape

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large: over {limit} bytes (the server's --max-request-bytes)")


class BodyTimeout(HTTPException):
    code = "request_timeout"

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"request body not received within {seconds:g} s")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.strip().isdigit():
            await error_response(400, "invalid Content-Length", None, "invalid_request_error",
                                 "invalid_request")(scope, receive, send)
            return
        if declared is not None and int(declared) > self.max_bytes:
            too_large = BodyTooLarge(self.max_bytes)
            await error_response(413, str(too_large.detail), None, "invalid_request_error",
                                 too_large.code)(scope, receive, send)
            return
        received, body_done, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come: no deadline on waiting for it
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                raise BodyTimeout(self.read_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except (BodyTooLarge, BodyTimeout) as exc:  # raised where no handler turned it into a response
            if started:
                raise
            await error_response(exc.status_code, str(exc.detail), None, "invalid_request_error", exc.code)(
                scope, receive, send)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing a connection whose request head is not complete `seconds` after its
    first byte (or after the connection opened)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and data:  # part of a request head, not all of it
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


def connection_limits(settings) -> dict:
    """uvicorn.Config arguments bounding connections (app.settings.ServeSettings)."""
    return {"http": header_timeout_protocol(settings.header_timeout), "limit_concurrency": settings.max_connections,
            "timeout_keep_alive": KEEP_ALIVE_S}
