"""Conversation history in the store, on SQLite and on a real PostgreSQL server (no model: conversations are built
with Conversations.add_message): the JSON export and its import as a new conversation (the whole tree, the branch
shown, settings and token figures kept), the Markdown export of the branch shown, search across titles and every
branch (FTS5 / tsvector, and the LIKE scan a SQLite without FTS5 gets), and the browser UI's history methods."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from kvforge.app.models.factory import default_engine_factory
from kvforge.app.models.host import ModelHost
from kvforge.app.models.spec import ModelSpec
from kvforge.app.server import create_app
from kvforge.app.sessions.conversations import Conversations
from kvforge.app.sessions.date_groups import MONTHS
from kvforge.app.sessions.history import ConversationExport, export_conversation, import_conversation
from kvforge.app.sessions.markdown import conversation_markdown
from kvforge.app.sessions.search import ConversationSearch, snippet
from kvforge.core.store import Store, upgrade
from kvforge.ui.service import UIService
from tests.core.test_store import database_at
from tests.helpers.conversation_tree import LEFT_OUT, SETTINGS, build_tree


@pytest.fixture
def conversations(db_url):
    store = Store(db_url)
    yield Conversations(store)
    store.close()


def by_position(export: dict) -> dict:
    """An export with its message ids replaced by their index in the list: two exports of the same tree compare
    equal whatever ids their stores gave."""
    index = {m["id"]: i for i, m in enumerate(export["messages"])}
    messages = [{**m, "id": index[m["id"]], "parent_id": index.get(m["parent_id"])} for m in export["messages"]]
    return {**export, "messages": messages, "current_message_id": index.get(export["current_message_id"])}


# --- export and import -----------------------------------------------------------------------------------

def test_an_imported_export_is_the_same_tree_in_a_new_conversation(conversations):
    original = build_tree(conversations)
    exported = export_conversation(original)
    assert [m["content"] for m in exported["messages"]][2] == "Which river flows through Florence?"  # every branch
    assert exported["messages"][1] == {
        "id": original.nodes[1].id, "parent_id": original.nodes[0].id, "role": "assistant", "content": "Paris.",
        "reasoning_content": "The user asks for France's capital.", "tool_calls": None, "tool_call_id": None,
        "created_at": original.nodes[1].created_at, "prompt_tokens": 40, "completion_tokens": 24,
        "cached_tokens": 12, "finish_reason": "stop", "ttft_s": 0.085, "tokens_per_s": 31.2, "context_truncated": None,
        "images": None}
    assert exported["messages"][-1]["context_truncated"] == LEFT_OUT  # what the last reply's prompt left out

    before = time.time()
    document = json.loads(json.dumps(exported))  # as a file holds it
    new_id = import_conversation(conversations.store, ConversationExport.model_validate(document))
    copy = conversations.get(new_id)
    again = export_conversation(copy)

    assert new_id != original.id and not {m.id for m in copy.nodes} & {m.id for m in original.nodes}
    assert copy.created_at >= before and copy.updated_at >= before  # a new conversation: it tops the list
    assert [c.id for c in conversations.list()][0] == new_id
    times = ("created_at", "updated_at")
    assert {k: v for k, v in by_position(again).items() if k not in times} == \
        {k: v for k, v in by_position(exported).items() if k not in times}
    assert again["settings"] == SETTINGS
    # the branch shown, positions (depths) and siblings are those of the original
    assert [m.content for m in copy.messages] == [m.content for m in original.messages]
    assert [m.position for m in copy.nodes] == [m.position for m in original.nodes]
    assert [len(m.siblings) for m in copy.nodes] == [len(m.siblings) for m in original.nodes]
    # the copy is an ordinary conversation: it takes a message after its branch shown
    follow = conversations.add_message(new_id, "user", "Thanks!")
    assert follow.parent_id == copy.current_message_id and follow.position == copy.messages[-1].position + 1


def test_markdown_is_the_branch_shown_with_reasoning_tool_calls_and_figures(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'kvforge.db'}")
    try:
        conv = build_tree(Conversations(store))
        assert conversation_markdown(conv) == """\
# Capitals of Europe

### System

Answer briefly.

### User

What is the capital of France?

### Assistant

<details><summary>Reasoning</summary>

The user asks for France's capital.

</details>

Paris.

*24 tokens · 31.2 tok/s · TTFT 85 ms · 12 cached tokens*

### User

And the capital of Spain?

### Assistant

```json
[
  {
    "id": "call_1",
    "type": "function",
    "function": {
      "name": "weather",
      "arguments": "{\\"city\\": \\"Madrid\\"}"
    }
  }
]
```

*9 tokens · 0 cached tokens · called tools*

### Tool `call_1`

21 C

### Assistant

Madrid, 21 C and sunny.

*1 token · 12.0 tok/s · TTFT 40 ms · 0 cached tokens · 2 older messages left out*
"""
        regenerated = conv.nodes[4]  # on another branch: shown once the user switches to it
        conv = Conversations(store).switch(conv.id, regenerated.id)
        assert conversation_markdown(conv).endswith(
            "### Assistant\n\nThe capital is Paris.\n\n"
            "*6 tokens · 28.0 tok/s · 0 cached tokens · max tokens reached*\n")
    finally:
        store.close()


# --- search ----------------------------------------------------------------------------------------------

def test_search_finds_titles_and_words_of_every_branch(conversations):
    tree = build_tree(conversations)
    other = conversations.create("Economics notes")
    conversations.add_message(other.id, "user", "Explain capitalism, in the capital's own words.")
    conversations.add_message(other.id, "assistant", "Capitalism is an economic system...")
    empty = conversations.create("Empty")
    full_text = ConversationSearch(conversations.store)
    assert full_text.method == ("tsvector" if conversations.store.engine.dialect.name == "postgresql" else "fts5")

    for search in (full_text, ConversationSearch(conversations.store, full_text=False)):
        def found(text: str) -> list[str]:
            return [hit.conversation.id for hit in search.search(text)]  # noqa: B023 - used at once

        assert found("florence") == [tree.id], search.method  # the 3rd message, on a branch not shown
        assert found("FLOREN") == [tree.id]  # a word's start, any case
        assert found("river Florence") == [tree.id]  # every word, in one message
        assert found("river Madrid") == []  # ...not spread over two
        assert found("europe") == [tree.id]  # the title
        assert found("capital") == [other.id, tree.id]  # the most recently updated first; capital's, capitalism
        assert found("pital") == [] and found("berlin") == []  # not inside words; not absent words
        assert found('(capital) "FRANCE*') == [tree.id]  # FTS5 / tsquery syntax is only words here
        assert found("100%_ \\") == []  # nor are LIKE's wildcards
        assert {*found("")} == {*found(" ?! ")} == {tree.id, other.id, empty.id}  # no words: every conversation

        [hit] = search.search("arno")
        assert (hit.message_id, hit.snippet) == (tree.nodes[3].id, "The Arno.")
        assert hit.to_dict()["match"] == {"message_id": tree.nodes[3].id, "snippet": "The Arno."}
        [hit] = search.search("europe")
        assert (hit.message_id, hit.snippet) == (None, "Capitals of Europe")

    # the index follows renames, deleted conversations and new messages
    conversations.update(other.id, title="Political economy")
    conversations.delete(tree.id)
    conversations.add_message(empty.id, "user", "Is Florence in Tuscany?")
    for search in (full_text, ConversationSearch(conversations.store, full_text=False)):
        assert [h.conversation.id for h in search.search("political")] == [other.id]
        assert search.search("economics") == [] and search.search("arno") == []
        assert [h.conversation.id for h in search.search("florence")] == [empty.id]
    if full_text.method == "fts5":  # the external-content index agrees with messages, row for row
        with conversations.store.engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")
    with pytest.raises(ValueError, match="at most 16 words"):
        full_text.search(" ".join(f"w{i}" for i in range(17)))


def test_a_sqlite_without_fts5_gets_no_index_and_searches_with_like(tmp_path):
    """A SQLite build without FTS5 (here: one that refuses to create virtual tables) migrates without the index;
    search detects that and scans with LIKE."""
    url = f"sqlite:///{tmp_path / 'kvforge.db'}"
    engine = sa.create_engine(url)

    @event.listens_for(engine, "connect")
    def _no_virtual_tables(dbapi_connection, _record):
        dbapi_connection.set_authorizer(
            lambda action, *_: sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_CREATE_VTABLE else sqlite3.SQLITE_OK)

    upgrade(engine)
    engine.dispose()
    store = Store(url)
    try:
        assert not {"messages_fts", "conversations_fts"} & set(sa.inspect(store.engine).get_table_names())
        tree = build_tree(Conversations(store))
        search = ConversationSearch(store)
        assert search.method == "like"
        assert [h.conversation.id for h in search.search("florence river")] == [tree.id]
        assert search.search("pital") == []
    finally:
        store.close()


def test_a_data_file_of_revision_0004_is_searchable_at_once(db_url):
    """Migration 0005 indexes the messages and titles already there."""
    database_at(db_url, "0004", "user", "The Colosseum at night", title="Old trip notes")
    store = Store(db_url)
    try:
        search = ConversationSearch(store)
        assert search.method in ("fts5", "tsvector")
        assert [(h.conversation.id, h.snippet) for h in search.search("colosseum")] == [
            ("c1", "The Colosseum at night")]
        assert [h.conversation.id for h in search.search("trip")] == ["c1"]
    finally:
        store.close()


def test_snippets_start_near_the_first_word_found():
    text = "word " * 40 + "the Colosseum in Rome, " + "more " * 40
    got = snippet(text, ["colosseum"])
    assert got.startswith("…word ") and "the Colosseum in Rome" in got and got.endswith("…")
    assert len(got) <= 122 and "\n" not in snippet("a\nb\n\nc", ["b"])
    assert snippet("short", ["absent"]) == "short"


# --- the browser UI's methods ----------------------------------------------------------------------------

def test_ui_service_history_methods(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'kvforge.db'}")
    try:
        app = create_app(ModelHost(default_engine_factory, ModelSpec(), None), store=store)  # no model: none needed
        service = UIService(app.state.chat, None)
        conversations = Conversations(store)
        tree = build_tree(conversations)
        old = conversations.create("Last year")
        with store.engine.begin() as conn:  # backdated
            conn.execute(sa.text("UPDATE conversations SET updated_at = :t WHERE id = :c"),
                         {"t": (datetime.now() - timedelta(days=400)).timestamp(), "c": old.id})
        month = datetime.now() - timedelta(days=400)
        assert service.conversation_groups() == [("Today", [("Capitals of Europe", tree.id)]),
                                                 (f"{MONTHS[month.month - 1]} {month.year}", [("Last year", old.id)])]
        assert service.conversation_groups("florence") == [("Today", [("Capitals of Europe", tree.id)])]
        assert service.conversation_groups("nowhere") == []

        name, text = service.export_conversation(tree.id, "json")
        assert name == "kvforge-capitals-of-europe.json" and json.loads(text)["format"] == "kvforge.conversation"
        new_id = service.import_conversation(text)
        assert by_position(export_conversation(conversations.get(new_id)))["messages"] == \
            by_position(json.loads(text))["messages"]
        # reloaded, the chat says again that the last reply's prompt left older messages out (the store kept it)
        from kvforge.ui.chat import ChatHandlers

        for shown in (tree.id, new_id):
            stats = ChatHandlers(service).show(shown)[3]
            assert stats.startswith("Last reply: 1 token") and "left out of the model's context: the 2 oldest" in stats
        name, markdown = service.export_conversation(tree.id, "markdown")
        assert name == "kvforge-capitals-of-europe.md" and markdown.startswith("# Capitals of Europe\n")
        with pytest.raises(ValueError, match="unknown export format"):
            service.export_conversation(tree.id, "pdf")

        count = len(conversations.list())
        bad = json.loads(text)
        bad["messages"][3]["parent_id"] = bad["messages"][5]["id"]
        system_role = text.replace('"role": "tool"', '"role": "system"')
        for document, says in [("{", "not valid JSON"), ("[]", "body: Input should be"),
                               (json.dumps({**json.loads(text), "version": 2}), "version: Input should be 1"),
                               (json.dumps(bad), "messages: item 3 (id "),
                               (system_role, "messages.7.role: Input should be")]:
            with pytest.raises(ValueError, match="not a kvforge conversation export") as raised:
                service.import_conversation(document)
            assert says in str(raised.value), raised.value
        assert len(conversations.list()) == count  # nothing stored

        assert service.system_prompt_names() == [] and service.system_prompt("Pirate") is None
        service.save_system_prompt(" Pirate ", "Talk like a pirate.")
        service.save_system_prompt("Brief", "Answer in one sentence.")
        service.save_system_prompt("Pirate", "Talk like a pirate, matey.")
        assert service.system_prompt_names() == ["Brief", "Pirate"]
        assert service.system_prompt("Pirate") == "Talk like a pirate, matey."
        for name, content, says in [("  ", "x", "name: must not be blank"), ("a/b", "x", "name: must not contain"),
                                    ("x" * 101, "x", "name: String should have at most 100"),
                                    ("Empty", "", "content: String should have at least 1")]:
            with pytest.raises(ValueError, match=says):
                service.save_system_prompt(name, content)
        service.delete_system_prompt("Pirate")
        service.delete_system_prompt("Pirate")  # gone already: not an error
        assert service.system_prompt_names() == ["Brief"]
    finally:
        store.close()
