"""The history routes over real HTTP (uvicorn on 127.0.0.1) on SQLite and PostgreSQL: export (JSON and Markdown
files), import (a new session as GET returns it; bad documents are a 400 naming the field and store nothing),
GET /v1/sessions?search=, and the system-prompt presets. No model is loaded: none of these routes generates."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from kvforge.app.dialects.openai.fields import MAX_SYSTEM_PROMPT_CHARS
from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.models.factory import default_engine_factory
from kvforge.app.models.host import ModelHost
from kvforge.app.models.spec import ModelSpec
from kvforge.app.server import create_app
from kvforge.app.sessions.conversations import Conversations
from kvforge.app.sessions.history import MAX_MESSAGES, MAX_TEXT_CHARS
from kvforge.core.store import Store
from tests.helpers.conversation_tree import build_tree


@pytest.fixture
def served(db_url) -> Iterator[tuple[httpx.Client, Conversations]]:
    """The API on its own store, with no model loaded; a client and the store's Conversations."""
    store = Store(db_url)
    app = create_app(ModelHost(default_engine_factory, ModelSpec(served_name="m"), None), store=store)
    try:
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield http, Conversations(store)
    finally:
        store.close()


def assert_error(r: httpx.Response, status: int, param: str | None, mentions: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and mentions in error["message"], error


def without_ids(session: dict) -> dict:
    """A session as GET returns it, without what an import renews: ids (as list indices) and its own times."""
    index = {m["id"]: i for i, m in enumerate(session["messages"])}
    messages = [{**m, "id": index[m["id"]], "parent_id": index.get(m["parent_id"]),
                 "siblings": [index.get(s) for s in m["siblings"]]} for m in session["messages"]]
    drop = {"id", "created_at", "updated_at", "current_message_id"}
    return {**{k: v for k, v in session.items() if k not in drop}, "messages": messages}


def test_export_and_import_over_http(served):
    http, conversations = served
    tree = build_tree(conversations)

    r = http.get(f"/v1/sessions/{tree.id}/export")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.headers["content-disposition"].startswith('attachment; filename="kvforge-capitals-of-europe.json"')
    exported = r.json()
    assert (exported["format"], exported["version"], len(exported["messages"])) == ("kvforge.conversation", 1, 9)
    r = http.get(f"/v1/sessions/{tree.id}/export", params={"format": "markdown"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/markdown; charset=utf-8"
    assert r.headers["content-disposition"].startswith('attachment; filename="kvforge-capitals-of-europe.md"')
    assert r.text.startswith("# Capitals of Europe\n") and "Florence" not in r.text  # the branch shown only
    assert_error(http.get(f"/v1/sessions/{tree.id}/export", params={"format": "pdf"}), 400, "format")
    assert_error(http.get("/v1/sessions/nope/export"), 404, "session_id")

    r = http.post("/v1/sessions/import", json=exported)
    assert r.status_code == 200, r.text
    imported = r.json()
    original = http.get(f"/v1/sessions/{tree.id}").json()
    assert imported == http.get(f"/v1/sessions/{imported['id']}").json()  # as GET returns it
    assert imported["id"] != tree.id and without_ids(imported) == without_ids(original)
    assert imported["object"] == "session" and imported["messages"][-1]["id"] == imported["current_message_id"]
    all_branches = http.get(f"/v1/sessions/{imported['id']}/messages", params={"branches": "all"}).json()["data"]
    assert [m["content"] for m in all_branches] == [m["content"] for m in exported["messages"]]
    assert http.get(f"/v1/sessions/{imported['id']}/export").json()["messages"][1]["tokens_per_s"] == 31.2

    sessions = http.get("/v1/sessions").json()["data"]
    first, reply = exported["messages"][0], exported["messages"][1]

    def changed(**fields) -> dict:
        return {**copy.deepcopy(exported), **fields}

    def message_changed(i: int, **fields) -> dict:
        document = copy.deepcopy(exported)
        document["messages"][i].update(fields)
        return document

    bad = [
        (changed(format="other.app"), "format", "kvforge.conversation"),
        (changed(version=2), "version", "1"),
        ({k: v for k, v in exported.items() if k != "title"}, "title", "Field required"),
        (changed(title="x" * 201), "title", "200"),
        (changed(extra=True), "extra", "unknown field"),
        (changed(settings={"sampling": {"temperature": -1}}), "settings", "temperature"),
        (changed(settings={"tool_choice": {"type": "function", "function": {"name": "absent"}}}), "settings", ""),
        (changed(current_message_id=10**6), "current_message_id", "not the id of one of the messages"),
        (message_changed(0, role="system"), "messages", "messages.0.role"),
        (message_changed(0, parent_id=reply["id"]), "messages", "not the id of an earlier message"),
        (message_changed(1, id=first["id"]), "messages", "earlier message too"),
        (message_changed(0, content="nul \x00 char"), "messages", "NUL"),
        (message_changed(0, content="x" * (MAX_TEXT_CHARS + 1)), "messages", str(MAX_TEXT_CHARS)),
        (message_changed(1, prompt_tokens=2**31), "messages", "prompt_tokens"),
        (message_changed(1, ttft_s=-1), "messages", "ttft_s"),
        (message_changed(0, tool_call_id="call_9"), "messages", "tool_call_id"),
        (message_changed(0, context_truncated={"dropped_messages": 2, "dropped_turns": 1}), "messages",
         "context_truncated: only on an assistant message"),
        (message_changed(1, context_truncated={"dropped_messages": 0, "dropped_turns": 1}), "messages",
         "dropped_messages"),
        (message_changed(1, context_truncated={"dropped_messages": 1, "dropped_turns": 2}), "messages",
         "dropped_turns: at most dropped_messages"),
        (message_changed(1, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f"}}]), "messages",
         "arguments"),
        (changed(messages=[{"id": i, "role": "user", "content": "hi"} for i in range(MAX_MESSAGES + 1)]),
         "messages", str(MAX_MESSAGES)),
    ]
    for document, param, mentions in bad:
        assert_error(http.post("/v1/sessions/import", json=document), 400, param, mentions)
    assert_error(http.post("/v1/sessions/import", content=b"{", headers={"content-type": "application/json"}),
                 400, None, "invalid JSON")
    assert http.get("/v1/sessions").json()["data"] == sessions  # nothing stored

    # a minimal hand-written document: the fields left out take their defaults
    r = http.post("/v1/sessions/import", json={"format": "kvforge.conversation", "version": 1, "title": "Hand-made",
                                                "messages": [{"id": 7, "role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    made = r.json()
    assert (made["settings"], made["current_message_id"], made["model"]) == (
        {"system_prompt": None, "sampling": {}}, None, None)
    assert [m["content"] for m in http.get(f"/v1/sessions/{made['id']}/messages",
                                           params={"branches": "all"}).json()["data"]] == ["Hi"]


def test_search_and_system_prompts_over_http(served):
    http, conversations = served
    tree = build_tree(conversations)
    other = conversations.create("Economics notes")
    conversations.add_message(other.id, "user", "Explain capitalism.")

    def search(text: str) -> list[dict]:
        r = http.get("/v1/sessions", params={"search": text})
        assert r.status_code == 200, r.text
        return r.json()["data"]

    [hit] = search("florence")  # the 3rd message, on a branch not shown
    assert hit["id"] == tree.id and hit["title"] == "Capitals of Europe" and "messages" not in hit
    assert hit["match"] == {"message_id": tree.nodes[2].id, "snippet": "Which river flows through Florence?"}
    assert [h["match"] for h in search("Europe")] == [{"message_id": None, "snippet": "Capitals of Europe"}]
    assert [h["id"] for h in search("capital")] == [other.id, tree.id]
    assert search("berlin") == [] and search("pital") == []
    assert len(search("")) == 2 and len(http.get("/v1/sessions").json()["data"]) == 2
    assert_error(http.get("/v1/sessions", params={"search": "x" * 501}), 400, "search", "500")

    assert http.get("/v1/system_prompts").json() == {"object": "list", "data": []}
    r = http.put("/v1/system_prompts/Pirate", json={"content": "Talk like a pirate."})
    assert r.status_code == 200, r.text
    created = r.json()
    assert {k: created[k] for k in ("name", "object", "content")} == {
        "name": "Pirate", "object": "system_prompt", "content": "Talk like a pirate."}
    assert created["created_at"] == created["updated_at"]
    replaced = http.put("/v1/system_prompts/Pirate", json={"content": "Arr."}).json()
    assert replaced["content"] == "Arr." and replaced["created_at"] == created["created_at"]
    assert replaced["updated_at"] >= created["updated_at"]
    http.put("/v1/system_prompts/Code review", json={"content": "Review the code."})  # any name but '/'
    names = [p["name"] for p in http.get("/v1/system_prompts").json()["data"]]
    assert names == ["Code review", "Pirate"]

    for name, body, param, mentions in [
            ("x" * 101, {"content": "x"}, "name", "100"),
            (" padded", {"content": "x"}, "name", "whitespace"),
            ("bell\x07", {"content": "x"}, "name", "control characters"),
            ("Empty", {"content": ""}, "content", "at least 1"),
            ("Huge", {"content": "x" * (MAX_SYSTEM_PROMPT_CHARS + 1)}, "content", str(MAX_SYSTEM_PROMPT_CHARS)),
            ("Nul", {"content": "a\x00b"}, "content", "NUL"),
            ("Extra", {"content": "x", "title": "y"}, "title", "unknown field"),
            ("Missing", {}, "content", "Field required")]:
        assert_error(http.put(f"/v1/system_prompts/{quote(name)}", json=body), 400, param, mentions)
    assert [p["name"] for p in http.get("/v1/system_prompts").json()["data"]] == names  # nothing stored

    assert http.delete("/v1/system_prompts/Pirate").json() == {
        "name": "Pirate", "object": "system_prompt.deleted", "deleted": True}
    assert_error(http.delete("/v1/system_prompts/Pirate"), 404, "name", "not found")
    assert [p["name"] for p in http.get("/v1/system_prompts").json()["data"]] == ["Code review"]
