"""The sessions API: conversations kept server-side (app/conversations.py), replies streamed.

    GET/POST /v1/sessions                 list, create
    GET/PATCH/DELETE /v1/sessions/{id}    get (with messages), rename / change settings, delete
    GET/POST /v1/sessions/{id}/messages   history; post a user message (or a tool's result) and get the reply

A turn (app/chat_service.py) renders the whole history with the chat template. Earlier turns render
byte-identically from turn to turn (the reply is stored exactly as generated), so the prompt's prefix
is the previous turn's prompt plus its reply, and the prefix cache — in memory, or the persisted tier
after a restart — serves all of it: only the new message is computed.

A reply streams as server-sent events: `{"type": "user", "message"}` (the stored user message; a tool result:
`{"type": "tool", "message"}`), `{"type": "delta", "content"}`..., then `{"type": "done", "message", "usage",
"timings", "token_ids"}` and `[DONE]`. A reasoning model's think block streams as `{"type": "delta",
"reasoning_content"}` deltas and is stored apart from the answer: a message's `content` is the answer, its
`reasoning_content` the thinking (absent for a model that does not reason). A conversation's tools (its
settings) may be called: a call streams as `{"type": "delta", "tool_calls"}` and is stored in the reply's
`tool_calls`; each result is posted as a tool message, and one that leaves other calls of the reply open gets
`{"type": "awaiting_tool_results", "tool_call_ids"}` instead of a reply. A client that disconnects aborts the
reply; what was generated so far is kept with finish_reason "abort", like a chat app's stop button.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvforge.app.chat_service import AwaitingResults, ChatService, not_found
from kvforge.app.completion import RequestTimedOut, StreamResponse
from kvforge.app.conversations import NotFound
from kvforge.app.errors import APIError
from kvforge.app.protocol import SessionCreateRequest, SessionMessageRequest, SessionUpdateRequest

log = logging.getLogger(__name__)
DEFAULT_TITLE = "New chat"


def sessions_router(chat: ChatService) -> APIRouter:
    router, host, conversations = APIRouter(), chat.host, chat.conversations
    get = chat.get

    @router.get("/v1/sessions")
    def list_sessions():
        return {"object": "list", "data": [c.to_dict() for c in conversations.list()]}

    @router.post("/v1/sessions")
    def create_session(body: SessionCreateRequest):
        conv = conversations.create(body.title, host.name, body.stored())
        return conv.to_dict(messages=True)

    @router.get("/v1/sessions/{session_id}")
    def get_session(session_id: str):
        return get(session_id).to_dict(messages=True)

    @router.patch("/v1/sessions/{session_id}")
    def update_session(session_id: str, body: SessionUpdateRequest):
        conv = get(session_id)
        changes = {}
        if body.title is not None:
            changes["title"] = body.title
        if body.model_fields_set - {"title"}:
            try:
                changes["settings"] = body.settings(conv.settings or {}).stored()
            except ValidationError as exc:  # the settings these changes make do not hold together
                raise RequestValidationError(exc.errors(), body=body.model_dump(exclude_unset=True)) from None
        try:
            return conversations.update(session_id, **changes).to_dict(messages=True)
        except NotFound as exc:
            raise not_found(exc) from None

    @router.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str):
        try:
            conversations.delete(session_id)
        except NotFound as exc:
            raise not_found(exc) from None
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.get("/v1/sessions/{session_id}/messages")
    def list_messages(session_id: str):
        return {"object": "list", "data": [m.to_dict() for m in get(session_id).messages]}

    @router.post("/v1/sessions/{session_id}/messages")
    async def post_message(session_id: str, body: SessionMessageRequest):
        if body.n != 1:
            raise APIError(400, "n: a session reply has one sample (n = 1)", "n")
        # the fields this request sets override the conversation's sampling settings
        overrides = body.model_dump(include=body.model_fields_set - {"role", "content", "tool_call_id", "tool_choice",
                                                                     "stream", "model"})
        turn = await chat.start_turn(session_id, body.content, overrides, body.tool_call_id, body.tool_choice)
        posted = {"type": body.role, "message": turn.posted.to_dict()}
        if isinstance(turn, AwaitingResults):  # other calls of the reply still wait for their results
            waiting = {"type": "awaiting_tool_results", "tool_call_ids": turn.open_calls}
            if not body.stream:
                return {body.role: posted["message"], "awaiting_tool_results": turn.open_calls}
            return StreamResponse(iter_events([posted, waiting]), lambda: None)
        reply = turn.events

        if not body.stream:
            try:
                done = [event async for event in reply() if event["type"] == "done"][0]
            except RequestTimedOut as exc:
                raise exc.api_error() from None
            finally:
                turn.abort()
            return {body.role: posted["message"], **{k: v for k, v in done.items() if k != "type"}}

        async def sse() -> AsyncIterator[str]:
            yield event_line(posted)
            try:
                async for event in reply():
                    yield event_line(event)
            except RequestTimedOut as exc:
                yield event_line({"type": "error", "message": str(exc)})
            except Exception as exc:  # the engine failed this request: say so in the stream
                log.exception("session reply failed")
                yield event_line({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
            yield "data: [DONE]\n\n"

        return StreamResponse(sse(), turn.abort)

    return router


def event_line(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


async def iter_events(events: list[dict]) -> AsyncIterator[str]:
    for event in events:
        yield event_line(event)
    yield "data: [DONE]\n\n"
