"""Store, on SQLite and on a real PostgreSQL server: Alembic migrations of the one schema (the app's
conversations and the core's persisted-KV index) and the KV index (core/kv/sql_index.py)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvforge.app.sessions.conversations import (
    Conversations,  # maps its tables on Base: the metadata is the whole schema
)
from kvforge.app.sessions.system_prompts import SystemPrompts
from kvforge.core.kv.index import KVEntry
from kvforge.core.kv.sql_index import SQLKVIndex
from kvforge.core.store import MIGRATIONS, Base, Store, mapped_schema_object

TABLES = {"conversations", "messages", "kv_blocks", "system_prompts"}


@pytest.fixture
def index(db_url):
    index = SQLKVIndex.open(db_url)
    yield index
    index.close()


# --- migrations ----------------------------------------------------------------------------------

def models_vs_schema(conn) -> list:
    """What differs between the models and the database (the search index no model maps left out)."""
    return compare_metadata(MigrationContext.configure(conn, opts={"include_name": mapped_schema_object}),
                            Base.metadata)


def alembic_config(connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def database_at(db_url: str, revision: str, role: str, content: str, title: str = "old") -> None:
    """A database migrated to `revision` only, holding conversation c1 (`title`) with one message at position 1."""
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), revision)
            conn.execute(sa.text("INSERT INTO conversations (id, title, settings, created_at, updated_at) "
                                 "VALUES ('c1', :title, '{}', 1, 1)"), {"title": title})
            conn.execute(sa.text("INSERT INTO messages (conversation_id, position, role, content, created_at) "
                                 "VALUES ('c1', 1, :role, :content, 1)"), {"role": role, "content": content})
    finally:
        engine.dispose()


def test_migrations_create_the_schema_and_reopening_is_a_noop(db_url):
    first = Store(db_url)
    conv = Conversations(first).create("kept")
    Conversations(first).add_message(conv.id, "user", "hello")
    SystemPrompts(first).put("Brief", "Answer briefly.")
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert head is not None

    second = Store(db_url)  # upgrade to head again: nothing to do, nothing lost
    try:
        assert [m.content for m in Conversations(second).get(conv.id).messages] == ["hello"]
        assert SystemPrompts(second).get("Brief").content == "Answer briefly."
        inspector = sa.inspect(second.engine)
        assert TABLES | {"alembic_version"} <= set(inspector.get_table_names())
        with second.engine.connect() as conn:
            assert list(conn.execute(sa.text("SELECT version_num FROM alembic_version"))) == [(head,)]
            assert models_vs_schema(conn) == []  # models == schema

        with second.engine.begin() as conn:  # the migration also downgrades cleanly...
            command.downgrade(alembic_config(conn), "base")
        assert not TABLES & set(sa.inspect(second.engine).get_table_names())
    finally:
        first.engine.dispose()
        second.engine.dispose()
    third = Store(db_url)  # ...and a store opened on the empty database builds it again
    try:
        assert TABLES <= set(sa.inspect(third.engine).get_table_names())
        assert Conversations(third).list() == []
    finally:
        third.engine.dispose()


def test_a_data_file_of_the_first_schema_is_upgraded_with_its_messages(db_url):
    """A database written at revision 0001 (before replies kept their reasoning and tool calls apart) opens with its
    rows, and takes both."""
    database_at(db_url, "0001", "assistant", "kept")
    store = Store(db_url)
    try:
        conversations = Conversations(store)
        [old] = conversations.get("c1").messages
        assert (old.content, old.reasoning) == ("kept", None) and "reasoning_content" not in old.to_dict()
        new = conversations.add_message("c1", "assistant", "Paris.", reasoning="The capital...")
        assert new.to_dict()["reasoning_content"] == "The capital..."
        assert [m.reasoning for m in conversations.get("c1").messages] == [None, "The capital..."]
        call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        conversations.add_message("c1", "assistant", "", tool_calls=[call])
        conversations.add_message("c1", "tool", "12 C", tool_call_id="call_1")
        *_, asked, answered = [m.to_dict() for m in conversations.get("c1").messages]
        assert asked["tool_calls"] == [call] and "tool_call_id" not in asked and "tool_calls" not in old.to_dict()
        assert (answered["role"], answered["content"], answered["tool_call_id"]) == ("tool", "12 C", "call_1")
    finally:
        store.engine.dispose()


def test_a_data_file_of_revision_0003_becomes_a_message_tree(db_url):
    """Revision 0004 (branches): each conversation of a 0003 database becomes one branch, every message following the
    one before it and the last one shown; the tree then takes branches; downgrading keeps the branch shown."""
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), "0003")
            for conv in ("c1", "c2", "empty"):
                conn.execute(sa.text("INSERT INTO conversations (id, title, settings, created_at, updated_at) "
                                     "VALUES (:c, 'old', '{}', 1, 1)"), {"c": conv})
            # interleaved, so that ids and positions disagree
            for position, conv in [(1, "c1"), (1, "c2"), (2, "c1"), (3, "c1"), (2, "c2")]:
                conn.execute(sa.text("INSERT INTO messages (conversation_id, position, role, content, created_at) "
                                     "VALUES (:c, :p, :r, :t, 1)"),
                             {"c": conv, "p": position, "r": "user" if position % 2 else "assistant",
                              "t": f"{conv}-{position}"})
    finally:
        engine.dispose()
    store = Store(db_url)
    try:
        conversations = Conversations(store)
        for conv, length in (("c1", 3), ("c2", 2)):
            got = conversations.get(conv)
            shown = got.messages
            assert [m.content for m in shown] == [f"{conv}-{p}" for p in range(1, length + 1)]
            assert [m.parent_id for m in shown] == [None] + [m.id for m in shown[:-1]]
            assert [m.position for m in shown] == list(range(1, length + 1))
            assert got.current_message_id == shown[-1].id and len(got.nodes) == length
            assert all(m.to_dict()["siblings"] == [m.id] for m in shown)
        empty = conversations.get("empty")
        assert (empty.current_message_id, empty.messages) == (None, [])
        with store.engine.connect() as conn:
            assert models_vs_schema(conn) == []

        # positions are depths now, no longer unique: an edit of c1-3 is a sibling at position 3
        first, second, _ = conversations.get("c1").messages
        edit = conversations.add_message("c1", "user", "c1-3b", parent_id=second.id)
        assert (edit.position, edit.siblings) == (3, [conversations.get("c1").nodes[2].id, edit.id])
        conversations.add_message("c1", "assistant", "c1-4b")
        conversations.add_message("empty", "user", "first")

        with store.engine.begin() as conn:  # back to one branch per conversation: the one shown
            command.downgrade(alembic_config(conn), "0003")
        with store.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT conversation_id, position, content FROM messages "
                                        "ORDER BY conversation_id, position")).all()
        assert [tuple(r) for r in rows] == [("c1", 1, "c1-1"), ("c1", 2, "c1-2"), ("c1", 3, "c1-3b"),
                                            ("c1", 4, "c1-4b"), ("c2", 1, "c2-1"), ("c2", 2, "c2-2"),
                                            ("empty", 1, "first")]
        with store.engine.begin() as conn:
            with pytest.raises(sa.exc.IntegrityError):  # 0001's unique positions are back
                with conn.begin_nested():
                    conn.execute(sa.text("INSERT INTO messages (conversation_id, position, role, content, "
                                         "created_at) VALUES ('c1', 3, 'user', 'dup', 1)"))
    finally:
        store.engine.dispose()


def test_revision_0006_keeps_what_a_reply_left_out_and_the_search_index(db_url):
    """Revision 0006 adds the replies' context_truncated (NULL for those of a 0005 database) in place: on SQLite the
    search index's triggers survive it both ways (a batch copy of messages would drop them)."""
    from kvforge.app.sessions.search import ConversationSearch

    database_at(db_url, "0005", "assistant", "an older harbour")
    store = Store(db_url)
    try:
        conversations, left_out = Conversations(store), {"dropped_messages": 4, "dropped_turns": 2}
        [old] = conversations.get("c1").nodes
        assert old.context_truncated is None and "context_truncated" not in old.to_dict()
        conversations.add_message("c1", "assistant", "a newer lighthouse", context_truncated=left_out)
        assert conversations.get("c1").nodes[-1].to_dict()["context_truncated"] == left_out
        with store.engine.connect() as conn:
            assert models_vs_schema(conn) == []
        search = ConversationSearch(store)
        assert [h.conversation.id for h in search.search("harbour")] == ["c1"]
        assert [h.conversation.id for h in search.search("lighthouse")] == ["c1"]  # the insert trigger kept

        with store.engine.begin() as conn:
            command.downgrade(alembic_config(conn), "0005")
            assert "context_truncated" not in {c["name"] for c in sa.inspect(conn).get_columns("messages")}
            conn.execute(sa.text("INSERT INTO messages (conversation_id, position, role, content, created_at) "
                                 "VALUES ('c1', 3, 'user', 'a quay', 1)"))
        assert [h.conversation.id for h in ConversationSearch(store).search("quay")] == ["c1"]
    finally:
        store.engine.dispose()


# --- the persisted-KV index ----------------------------------------------------------------------

def kv_entry(name: str, fingerprint: bytes, last_access: float, nbytes: int = 1000) -> KVEntry:
    digest = name.encode().ljust(16, b"-")
    return KVEntry(digest, b"p" * 16, fingerprint, b"t" * 16, 16, f"{fingerprint.hex()}/{name}.kv",
                   nbytes, name.encode().ljust(32, b"#"), last_access)


def test_kv_index_lru_totals_touch_remove_clear(index):
    fa, fb = b"A" * 16, b"B" * 16
    e1, e2, e3 = kv_entry("e1", fa, 10.0, 3 << 30), kv_entry("e2", fa, 30.0), kv_entry("e3", fa, 20.0)
    other = kv_entry("other", fb, 5.0, 7)
    index.add([e1, e2, e3, other])

    assert index.entries(fa) == [e1, e3, e2]  # every field round-trips; LRU first
    assert index.entries(fb) == [other]
    assert index.entries(b"C" * 16) == []
    assert index.least_recent(2) == [other, e1]  # across every fingerprint
    assert index.totals() == {fa: (3, (3 << 30) + 2000), fb: (1, 7)}  # > 2**31: BigInteger

    index.touch([e1.hash], when=40.0)
    assert [e.hash for e in index.entries(fa)] == [e3.hash, e2.hash, e1.hash]
    assert index.entries(fa)[-1].last_access == 40.0
    index.touch([e3.hash])  # now
    assert [e.hash for e in index.entries(fa)] == [e2.hash, e1.hash, e3.hash]
    assert index.entries(fa)[-1].last_access >= time.time() - 60
    index.touch([])  # no-op

    rewritten = kv_entry("e2", fa, 50.0, 1234)  # the same block written again replaces its row
    index.add([rewritten])
    assert index.totals()[fa] == (3, (3 << 30) + 1234 + 1000)
    assert index.entries(fa)[1] == rewritten

    index.remove([e1.hash, b"unknown".ljust(16)])
    index.remove([])
    assert [e.hash for e in index.entries(fa)] == [e2.hash, e3.hash]
    assert index.totals() == {fa: (2, 2234), fb: (1, 7)}

    assert index.clear() == 3
    assert index.totals() == {} and index.entries(fa) == [] and index.least_recent(10) == []


