"""The sessions API: conversations kept server-side in the store, replies streamed.

    GET/POST /v1/sessions                 list, create
    GET/PATCH/DELETE /v1/sessions/{id}    get (with messages), rename / change settings, delete
    GET/POST /v1/sessions/{id}/messages   history; post a user message and get the assistant's reply

Each turn renders the whole history with the chat template. Earlier turns render byte-identically
from turn to turn (the reply is stored exactly as generated), so the prompt's prefix is the previous
turn's prompt plus its reply, and the prefix cache — in memory, or the persisted tier after a
restart — serves all of it: only the new message is computed.

A reply streams as server-sent events: `{"type": "user", "message"}` (the stored user message),
`{"type": "delta", "content"}`..., then `{"type": "done", "message", "usage", "timings", "token_ids"}` and
`[DONE]`. A client that disconnects aborts the reply; what was generated so far is kept with
finish_reason "abort", like a chat app's stop button.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvforge.app.completion import submit, timings, usage
from kvforge.app.errors import APIError
from kvforge.app.metrics import ServerMetrics
from kvforge.app.models import ModelHost, NoModelLoaded
from kvforge.app.protocol import (
    SamplingFields,
    SessionCreateRequest,
    SessionMessageRequest,
    SessionUpdateRequest,
)
from kvforge.core.output import RequestOutput
from kvforge.core.store import Conversation, NotFound, Store

log = logging.getLogger(__name__)
DEFAULT_TITLE = "New chat"


def chat_messages(conv: Conversation, new_user_message: str | None = None) -> list[dict[str, str]]:
    """What the chat template renders: the system prompt, the history, the new message."""
    system = (conv.settings or {}).get("system_prompt")
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": m.role, "content": m.content} for m in conv.messages]
    if new_user_message is not None:
        messages.append({"role": "user", "content": new_user_message})
    return messages


def reply_stats(out: RequestOutput, prompt_tokens: int) -> dict:
    m = out.metrics or {}
    tpot = m.get("tpot")
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
            "cached_tokens": out.num_cached_tokens, "finish_reason": out.finish_reason,
            "ttft_s": m.get("ttft"), "tokens_per_s": (1 / tpot) if tpot else None}


def sessions_router(host: ModelHost, store: Store, metrics: ServerMetrics, default_max_tokens: int) -> APIRouter:
    router = APIRouter()

    def get(session_id: str) -> Conversation:
        try:
            return store.get_conversation(session_id)
        except NotFound as exc:
            raise APIError(404, str(exc), "session_id", "not_found_error", "session_not_found") from None

    @router.get("/v1/sessions")
    def list_sessions():
        return {"object": "list", "data": [c.to_dict() for c in store.list_conversations()]}

    @router.post("/v1/sessions")
    def create_session(body: SessionCreateRequest):
        conv = store.create_conversation(body.title, host.name, body.model_dump(exclude={"title"}))
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
        if "system_prompt" in body.model_fields_set or body.sampling is not None:
            settings = dict(conv.settings or {})
            if "system_prompt" in body.model_fields_set:
                settings["system_prompt"] = body.system_prompt
            if body.sampling is not None:
                settings["sampling"] = body.sampling
            changes["settings"] = settings
        try:
            return store.update_conversation(session_id, **changes).to_dict(messages=True)
        except NotFound as exc:
            raise APIError(404, str(exc), "session_id", "not_found_error", "session_not_found") from None

    @router.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str):
        try:
            store.delete_conversation(session_id)
        except NotFound as exc:
            raise APIError(404, str(exc), "session_id", "not_found_error", "session_not_found") from None
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.get("/v1/sessions/{session_id}/messages")
    def list_messages(session_id: str):
        return {"object": "list", "data": [m.to_dict() for m in get(session_id).messages]}

    @router.post("/v1/sessions/{session_id}/messages")
    async def post_message(session_id: str, body: SessionMessageRequest):
        conv = await run_in_threadpool(get, session_id)
        if body.n != 1:
            raise APIError(400, "n: a session reply has one sample (n = 1)", "n")
        # the conversation's sampling settings, overridden by the fields this request sets
        overrides = body.model_dump(include=body.model_fields_set - {"content", "stream", "model"})
        fields = SamplingFields.model_validate({**(conv.settings or {}).get("sampling", {}), **overrides})
        try:
            engine = await host.acquire()  # waits while a model swap is in progress
        except NoModelLoaded as exc:
            raise APIError(503, str(exc), None, "server_error", "no_model") from None
        try:
            try:
                prompt = engine.tokenizer.apply_chat_template(chat_messages(conv, body.content))
            except Exception as exc:  # a template that rejects this conversation (e.g. role order)
                raise APIError(400, f"content: {exc}", "content") from None
            stream, _ = submit(engine, prompt, fields, default_max_tokens, None, "content")
        except BaseException:
            host.release()
            raise
        try:
            user = await run_in_threadpool(store.add_message, session_id, "user", body.content,
                                           prompt_tokens=len(prompt))
            if conv.title == DEFAULT_TITLE and not conv.messages:
                await run_in_threadpool(store.update_conversation, session_id, title=title_from(body.content))
        except BaseException as exc:
            host.release()
            stream.abort()
            if isinstance(exc, NotFound):  # deleted meanwhile
                raise APIError(404, str(exc), "session_id", "not_found_error", "session_not_found") from None
            raise

        async def reply() -> AsyncIterator[dict]:
            """The reply's events; the assistant message is stored when it ends, however it ends."""
            text, final = "", None
            try:
                async for out in stream:
                    text = out.text
                    if out.delta_text:
                        yield {"type": "delta", "content": out.delta_text}
                    if out.finished:
                        final = out
                        metrics.observe_finished(out)
            finally:
                host.release()
                stream.abort()  # no-op once finished; frees the KV blocks if the client went away
                if final is None and text:  # cut short: keep the partial reply, like a chat app's stop
                    try:
                        store.add_message(session_id, "assistant", text, finish_reason="abort",
                                          prompt_tokens=len(prompt))
                    except NotFound:
                        pass  # the conversation was deleted meanwhile
            try:
                message = await run_in_threadpool(store.add_message, session_id, "assistant", final.text,
                                                  **reply_stats(final, len(prompt)))
            except NotFound as exc:
                raise APIError(404, f"{exc} (deleted during the reply)", "session_id", "not_found_error",
                               "session_not_found") from None
            yield {"type": "done", "message": message.to_dict(), "usage": usage([final], len(prompt)),
                   "timings": timings(final), "token_ids": final.token_ids}

        if not body.stream:
            done = [event async for event in reply() if event["type"] == "done"][0]
            return {"user": user.to_dict(), **{k: v for k, v in done.items() if k != "type"}}

        async def sse() -> AsyncIterator[str]:
            yield event_line({"type": "user", "message": user.to_dict()})
            try:
                async for event in reply():
                    yield event_line(event)
            except Exception as exc:  # the engine failed this request: say so in the stream
                log.exception("session reply failed")
                yield event_line({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return router


def event_line(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def title_from(content: str, limit: int = 60) -> str:
    """A new conversation is named after its first message."""
    line = " ".join(content.split())
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "…"

