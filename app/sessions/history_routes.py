"""History routes of the sessions API: export and import a conversation, search, system-prompt presets.

    GET    /v1/sessions/{id}/export?format=json|markdown   the conversation as a file (app/sessions/history.py, its
    format)
    POST   /v1/sessions/import                             a JSON export -> a new session, as GET /v1/sessions/{id}
    GET    /v1/sessions?search=WORDS                       (app/sessions/routes.py's list, through search_response here)
    GET    /v1/system_prompts                              the presets, by name
    PUT    /v1/system_prompts/{name}  {"content"}          create or replace one
    DELETE /v1/system_prompts/{name}                       delete one (404 when there is none)

Bad input is a 400 naming the field, and nothing is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse, Response

from kvforge.app.http.errors import APIError
from kvforge.app.sessions.conversations import NotFound, shown_pictures
from kvforge.app.sessions.history import (
    ConversationExport,
    content_disposition,
    export_conversation,
    export_filename,
    import_conversation,
)
from kvforge.app.sessions.markdown import conversation_markdown
from kvforge.app.sessions.search import ConversationSearch
from kvforge.app.sessions.service import ChatService
from kvforge.app.sessions.system_prompts import PresetName, SystemPromptRequest, SystemPrompts

NameInPath = Annotated[PresetName, Path()]


def history_router(chat: ChatService) -> APIRouter:
    router, store = APIRouter(), chat.conversations.store
    presets = SystemPrompts(store)

    @router.get("/v1/sessions/{session_id}/export")
    def export_session(session_id: str, format: Literal["json", "markdown"] = "json"):
        conv = chat.get(session_id)
        if format == "markdown":
            disposition = content_disposition(export_filename(conv.title, "md"))
            return Response(conversation_markdown(conv), media_type="text/markdown; charset=utf-8",
                            headers={"Content-Disposition": disposition})
        pictures = chat.conversations.pictures(shown_pictures(conv.nodes))
        return JSONResponse(export_conversation(conv, pictures),
                            headers={"Content-Disposition": content_disposition(export_filename(conv.title, "json"))})

    @router.post("/v1/sessions/import")
    def import_session(body: ConversationExport):  # plain def: FastAPI runs it in a thread, off the event loop
        return chat.get(import_conversation(store, body)).to_dict(messages=True)

    @router.get("/v1/system_prompts")
    def list_presets():
        return {"object": "list", "data": [p.to_dict() for p in presets.list()]}

    @router.put("/v1/system_prompts/{name}")
    def put_preset(name: NameInPath, body: SystemPromptRequest):
        return presets.put(name, body.content).to_dict()

    @router.delete("/v1/system_prompts/{name}")
    def delete_preset(name: NameInPath):
        try:
            presets.delete(name)
        except NotFound as exc:
            raise APIError(404, str(exc), "name", "not_found_error", "system_prompt_not_found") from None
        return {"name": name, "object": "system_prompt.deleted", "deleted": True}

    return router


def search_response(search: ConversationSearch, text: str) -> dict[str, Any]:
    """GET /v1/sessions?search=...: the matching sessions, the most recently updated first, each with `match`:
    {"message_id" (null: the title matched), "snippet"}; 400 naming search for a query too long."""
    try:
        hits = search.search(text)
    except ValueError as exc:
        raise APIError(400, f"search: {exc}", "search") from None
    return {"object": "list", "data": [hit.to_dict() for hit in hits]}
