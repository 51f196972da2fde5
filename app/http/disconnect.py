"""A request whose client leaves is cancelled, whatever it is doing: rendering or tokenizing its prompt, waiting
for admission or a model load, queued or generating in the engine, whole (not streamed) responses included.

`CancelOnDisconnect` (ASGI) reads the request body first (BodyLimit, outside it, caps it and bounds its wait),
replays it to the app, then watches the connection while the handler runs: the `http.disconnect` that comes
before the response is complete cancels the handler's task. The cancellation reaches whatever the handler
awaits, and every path into the engine closes its request however it ends (app/generate/admit.py Admitted.close,
app/generate/embeddings.py, app/sessions/service.py Turn), so the engine aborts it and frees its KV blocks at its next
step.

Why a middleware: uvicorn reports a disconnect only to a caller of `receive()`, and a handler building a whole
response never calls it, so without this the work runs to its end for nobody (Starlette's StreamingResponse
listens only while it streams). The app's own `receive()` answers `http.disconnect` once the watcher has seen it,
so a streamed response's listener stops too: one watcher per request.

Only the API paths are watched: the browser UI's Gradio routes stop their work on disconnect themselves, and
/admin's operations (loading a model) run to their end whoever waits for them.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

WATCHED_PREFIXES = ("/v1/", "/api/")


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = WATCHED_PREFIXES) -> None:
        self.app, self.prefixes = app, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return  # gone before its body arrived: nothing was started
        gone = asyncio.Event()
        replayed = complete = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tracking_send(message: Message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass  # nothing else can come after the body
            gone.set()

        handler = asyncio.ensure_future(self.app(scope, replay, tracking_send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
            if gone.is_set() and not complete and not handler.done():  # left mid-request (uvicorn also
                handler.cancel()                                         # says so once the response is sent)
                try:
                    await handler
                except asyncio.CancelledError:
                    return
            await handler
        finally:
            watcher.cancel()
            if not handler.done():  # this task itself was cancelled (server shutdown): take the handler along
                handler.cancel()


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body (None when the client disconnects first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
