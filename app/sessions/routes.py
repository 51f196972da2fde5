"""The sessions API: conversations kept server-side (app/sessions/conversations.py), replies streamed.

    GET/POST /v1/sessions                 list (?search=WORDS: those matching, app/sessions/history_routes.py), create
    GET/PATCH/DELETE /v1/sessions/{id}    get (with messages), rename / change settings / show a branch, delete
    GET/POST /v1/sessions/{id}/messages   history; post a user message (or a tool's result) and get the reply
    POST /v1/sessions/{id}/messages/{message_id}/regenerate   another reply to a stored message
    GET  /v1/sessions/{id}/pictures/{sha256}                  a picture a message shows (a user message's `images`:
                                                              posted as data URLs, kept once in the data file)

A turn (app/sessions/service.py) renders the whole history with the chat template. Earlier turns render
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

Branches, as in ChatGPT: a conversation's messages form a tree (app/sessions/conversations.py), and the one branch shown
(root to the session's `current_message_id`) is its history: what GET returns as `messages`, and what the next
message follows. Every message carries `parent_id` (the message it follows; null: a first message) and `siblings`
(the ids of its parent's children, itself included, oldest first: the branches at that point, "< 2/3 >").
- Edit a message: post the new text with `"parent_id"`: the id of the message the old text followed (null for
  the first message). The branch down to that parent is the history; the old message and its replies stay.
  parent_id must be one of the session's messages (400 naming parent_id), and a user message follows an
  assistant or tool message. Absent: the last message shown, as before.
- Regenerate: POST .../messages/{message_id}/regenerate with the sampling overrides (and `tool_choice`,
  `stream`; the body may be empty) answers a stored user or tool message again (given an assistant reply: the
  message that reply answers); the new reply is a sibling of the earlier ones. Its events are a posted
  message's without the first: delta..., done, [DONE] (`"stream": false`: {"message", "usage", "timings",
  "token_ids"}). 404 naming message_id for an unknown message.
- Show another branch: PATCH {"current_message_id": id} shows the branch through that message, down to its most
  recent reply (its newest child at each level); 400 naming current_message_id for an unknown id. This is not
  an update: the session keeps its place in the list.
- GET .../messages?branches=all lists every message of every branch (creation order) instead of the one shown.
A conversation longer than the context (the model's, or a smaller `num_ctx`: Ollama's option, as a session's setting
or a reply's field) loses its oldest whole turns from the prompt (they stay stored); the done event (and a whole
reply) carries `context_truncated` {"dropped_messages", "dropped_turns"}, the response the X-KVForge-Dropped-Messages
header, and the stored reply keeps `context_truncated` (GET, export and import carry it; the UI shows it again).
Each reply is stored under the message it answers, whatever branch another client shows meanwhile. Going back to
an earlier branch renders the very prompt it had, so its KV is still in the prefix cache (memory or the persisted
tier): the next message there computes only itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvforge.app.generate.context_fit import truncation_headers
from kvforge.app.generate.pictures import picture_media_type
from kvforge.app.generate.stream import RequestTimedOut, StreamResponse
from kvforge.app.http.errors import APIError
from kvforge.app.sessions.conversations import CURRENT, MessageNotFound, NotFound
from kvforge.app.sessions.history_routes import search_response
from kvforge.app.sessions.protocol import (
    SessionCreateRequest,
    SessionMessageRequest,
    SessionRegenerateRequest,
    SessionUpdateRequest,
)
from kvforge.app.sessions.search import ConversationSearch
from kvforge.app.sessions.service import AwaitingResults, ChatService, Turn, not_found

log = logging.getLogger(__name__)
DEFAULT_TITLE = "New chat"


def sessions_router(chat: ChatService) -> APIRouter:
    router, host, conversations = APIRouter(), chat.context.host, chat.conversations
    get = chat.get

    searcher = ConversationSearch(conversations.store)

    @router.get("/v1/sessions")
    def list_sessions(search: str | None = None):
        if search is not None:  # the sessions whose title or messages hold these words
            return search_response(searcher, search)
        return {"object": "list", "data": [c.to_dict() for c in conversations.list()]}

    @router.post("/v1/sessions")
    def create_session(body: SessionCreateRequest):
        conv = conversations.create(body.title, host.name, body.stored())
        return conv.to_dict(messages=True)

    @router.get("/v1/sessions/{session_id}")
    def get_session(session_id: str):
        return get(session_id).to_dict(messages=True)

    @router.get("/v1/sessions/{session_id}/pictures/{sha256}")
    def get_picture(session_id: str, sha256: str):
        """A picture one of the conversation's messages shows (its `images` name them), as its own file type."""
        conv = get(session_id)
        if not any(sha256 in (m.images or ()) for m in conv.nodes):
            raise APIError(404, f"sha256: no message of session {session_id!r} shows picture {sha256!r}", "sha256",
                           "not_found_error", "picture_not_found")
        data = chat.conversations.pictures([sha256])[sha256]
        return Response(data, media_type=picture_media_type(data))

    @router.patch("/v1/sessions/{session_id}")
    def update_session(session_id: str, body: SessionUpdateRequest):
        conv = get(session_id)
        changes = {}
        if body.title is not None:
            changes["title"] = body.title
        if body.changes_settings():
            try:
                changes["settings"] = body.settings(conv.settings or {}).stored()
            except ValidationError as exc:  # the settings these changes make do not hold together
                raise RequestValidationError(exc.errors(), body=body.model_dump(exclude_unset=True)) from None
        if body.current_message_id is not None:  # checked before anything changes
            try:
                conv.node(body.current_message_id)
            except MessageNotFound as exc:
                raise APIError(400, f"current_message_id: {exc}", "current_message_id") from None
        try:
            if changes or body.current_message_id is None:  # showing a branch alone is not an update
                conv = conversations.update(session_id, **changes)
            if body.current_message_id is not None:
                conv = conversations.switch(session_id, body.current_message_id)
        except NotFound as exc:
            raise not_found(exc) from None
        return conv.to_dict(messages=True)

    @router.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str):
        try:
            conversations.delete(session_id)
        except NotFound as exc:
            raise not_found(exc) from None
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.get("/v1/sessions/{session_id}/messages")
    def list_messages(session_id: str, branches: Literal["current", "all"] = "current"):
        conv = get(session_id)
        return {"object": "list", "data": [m.to_dict() for m in (conv.nodes if branches == "all" else conv.messages)]}

    @router.post("/v1/sessions/{session_id}/messages")
    async def post_message(session_id: str, body: SessionMessageRequest):
        if body.n != 1:
            raise APIError(400, "n: a session reply has one sample (n = 1)", "n")
        parent_id = body.parent_id if "parent_id" in body.model_fields_set else CURRENT  # null: a new first message
        # the fields this request sets override the conversation's sampling settings
        turn = await chat.start_turn(session_id, body.content, body.overrides(), body.tool_call_id, body.tool_choice,
                                     parent_id, body.num_ctx, body.images)
        posted = {"type": body.role, "message": turn.posted.to_dict()}
        if isinstance(turn, AwaitingResults):  # other calls of the reply still wait for their results
            waiting = {"type": "awaiting_tool_results", "tool_call_ids": turn.open_calls}
            if not body.stream:
                return {body.role: posted["message"], "awaiting_tool_results": turn.open_calls}
            return StreamResponse(iter_events([posted, waiting]), lambda: None)
        return await reply_response(turn, body.stream, [posted], {body.role: posted["message"]})

    @router.post("/v1/sessions/{session_id}/messages/{message_id}/regenerate")
    async def regenerate(session_id: str, message_id: int, body: SessionRegenerateRequest | None = None):
        body = body or SessionRegenerateRequest()
        if body.n != 1:
            raise APIError(400, "n: a session reply has one sample (n = 1)", "n")
        turn = await chat.regenerate(session_id, message_id, body.overrides(), body.tool_choice, body.num_ctx)
        return await reply_response(turn, body.stream, [], {})

    return router


async def reply_response(turn: Turn, stream: bool, first: list[dict], whole: dict):
    """The reply as server-sent events (`first`'s events, the reply's, [DONE]) or, not streamed, one JSON object
    (`whole` and the done event's fields); with the header that says older messages were left out of its prompt."""
    headers = truncation_headers(turn.truncation)
    if not stream:
        try:
            done = [event async for event in turn.events() if event["type"] == "done"][0]
        except RequestTimedOut as exc:
            raise exc.api_error() from None
        finally:
            turn.abort()
        return JSONResponse({**whole, **{k: v for k, v in done.items() if k != "type"}}, headers=headers)

    async def sse() -> AsyncIterator[str]:
        for event in first:
            yield event_line(event)
        try:
            async for event in turn.events():
                yield event_line(event)
        except RequestTimedOut as exc:
            yield event_line({"type": "error", "message": str(exc)})
        except Exception as exc:  # the engine failed this request: say so in the stream
            log.exception("session reply failed")
            yield event_line({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        yield "data: [DONE]\n\n"

    return StreamResponse(sse(), turn.abort, headers=headers)


def event_line(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


async def iter_events(events: list[dict]) -> AsyncIterator[str]:
    for event in events:
        yield event_line(event)
    yield "data: [DONE]\n\n"
