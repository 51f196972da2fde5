"""Store, on SQLite and on a real PostgreSQL server: conversations and their messages, Alembic
migrations, the persisted-KV index, and crash consistency when the writing process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvforge.core.store import MIGRATIONS, Base, KVEntry, NotFound, Store

TABLES = {"conversations", "messages", "kv_blocks"}


@pytest.fixture
def store(db_url):
    store = Store(db_url)
    yield store
    store.engine.dispose()


def message_rows(store: Store, conversation_id: str) -> list[tuple[int, str]]:
    """(position, content) of a conversation's messages, straight from SQL (no ORM relationship)."""
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            sa.text("SELECT position, content FROM messages WHERE conversation_id = :c ORDER BY position"),
            {"c": conversation_id})]


# --- conversations -------------------------------------------------------------------------------

def test_conversation_crud_and_ordering(store):
    a = store.create_conversation("A", model="m1", settings={"system": "be brief"})
    b = store.create_conversation("B")
    c = store.create_conversation("C")
    assert len({a.id, b.id, c.id}) == 3
    assert [x.id for x in store.list_conversations()] == [c.id, b.id, a.id]  # newest first

    first = store.add_message(a.id, "user", "hi", prompt_tokens=3)
    second = store.add_message(a.id, "assistant", "hello", completion_tokens=2, finish_reason="stop",
                               cached_tokens=0, ttft_s=0.5, tokens_per_s=12.5)
    third = store.add_message(a.id, "user", "more")
    assert [first.position, second.position, third.position] == [1, 2, 3]
    assert [x.id for x in store.list_conversations()] == [a.id, c.id, b.id]  # a message bumps updated_at

    got = store.get_conversation(a.id)
    assert (got.title, got.model, got.settings) == ("A", "m1", {"system": "be brief"})
    assert [(m.position, m.role, m.content) for m in got.messages] == [
        (1, "user", "hi"), (2, "assistant", "hello"), (3, "user", "more")]
    out = got.to_dict(messages=True)
    assert out["id"] == a.id and out["object"] == "session" and len(out["messages"]) == 3
    assert out["messages"][0]["prompt_tokens"] == 3 and "completion_tokens" not in out["messages"][0]
    assert out["messages"][1] | {"id": 0, "created_at": 0} == {
        "id": 0, "created_at": 0, "role": "assistant", "content": "hello", "completion_tokens": 2,
        "finish_reason": "stop", "cached_tokens": 0, "ttft_s": 0.5, "tokens_per_s": 12.5}
    assert got.updated_at >= out["messages"][2]["created_at"] >= got.created_at

    before = store.get_conversation(b.id).updated_at
    renamed = store.update_conversation(b.id, title="B2", settings={"sampling": {"temperature": 0.2}})
    assert renamed.title == "B2" and renamed.updated_at > before
    again = store.get_conversation(b.id)
    assert (again.title, again.settings, again.model) == ("B2", {"sampling": {"temperature": 0.2}}, None)
    assert [x.id for x in store.list_conversations()] == [b.id, a.id, c.id]

    assert len(message_rows(store, a.id)) == 3
    store.delete_conversation(a.id)
    assert message_rows(store, a.id) == []  # ON DELETE CASCADE, at the SQL level
    with pytest.raises(NotFound):
        store.get_conversation(a.id)
    assert [x.id for x in store.list_conversations()] == [b.id, c.id]
    assert store.get_conversation(c.id).messages == []


@pytest.mark.parametrize("call", [
    lambda s: s.get_conversation("nope"),
    lambda s: s.update_conversation("nope", title="x"),
    lambda s: s.delete_conversation("nope"),
    lambda s: s.add_message("nope", "user", "hi"),
], ids=["get", "update", "delete", "add_message"])
def test_unknown_conversation_is_not_found(store, call):
    store.create_conversation("other")
    with pytest.raises(NotFound, match="nope"):
        call(store)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM messages")).scalar() == 0


def test_truncate_messages_then_append_continues_the_positions(store):
    conv = store.create_conversation()
    other = store.create_conversation()
    for i in range(5):
        store.add_message(conv.id, "user", f"m{i}")
    store.add_message(other.id, "user", "untouched")
    store.truncate_messages(conv.id, 3)
    assert message_rows(store, conv.id) == [(1, "m0"), (2, "m1"), (3, "m2")]
    assert store.add_message(conv.id, "assistant", "new").position == 4
    store.truncate_messages(conv.id, 10)  # nothing past the end: no-op
    assert [p for p, _ in message_rows(store, conv.id)] == [1, 2, 3, 4]
    store.truncate_messages(conv.id, 0)
    assert message_rows(store, conv.id) == []
    assert store.add_message(conv.id, "user", "restart").position == 1
    assert message_rows(store, other.id) == [(1, "untouched")]


def test_concurrent_appends_get_contiguous_positions(store):
    """Appends to one conversation from several threads (two browser tabs) all succeed, in order."""
    conv = store.create_conversation()
    errors: list[Exception] = []

    def append(worker: int) -> None:
        for i in range(10):
            try:
                store.add_message(conv.id, "user", f"{worker}-{i}")
            except Exception as exc:  # collected and reported below
                errors.append(exc)

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = message_rows(store, conv.id)
    assert [p for p, _ in rows] == list(range(1, 41))
    for worker in range(4):  # each thread's messages keep their order
        mine = [c for _, c in rows if c.startswith(f"{worker}-")]
        assert mine == [f"{worker}-{i}" for i in range(10)]


# --- migrations ----------------------------------------------------------------------------------

def alembic_config(connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def test_migrations_create_the_schema_and_reopening_is_a_noop(db_url):
    first = Store(db_url)
    conv = first.create_conversation("kept")
    first.add_message(conv.id, "user", "hello")
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert head is not None

    second = Store(db_url)  # upgrade to head again: nothing to do, nothing lost
    try:
        assert [m.content for m in second.get_conversation(conv.id).messages] == ["hello"]
        inspector = sa.inspect(second.engine)
        assert TABLES | {"alembic_version"} <= set(inspector.get_table_names())
        with second.engine.connect() as conn:
            assert list(conn.execute(sa.text("SELECT version_num FROM alembic_version"))) == [(head,)]
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []  # models == schema

        with second.engine.begin() as conn:  # the migration also downgrades cleanly...
            command.downgrade(alembic_config(conn), "base")
        assert not TABLES & set(sa.inspect(second.engine).get_table_names())
    finally:
        first.engine.dispose()
        second.engine.dispose()
    third = Store(db_url)  # ...and a store opened on the empty database builds it again
    try:
        assert TABLES <= set(sa.inspect(third.engine).get_table_names())
        assert third.list_conversations() == []
    finally:
        third.engine.dispose()


# --- the persisted-KV index ----------------------------------------------------------------------

def kv_entry(name: str, fingerprint: bytes, last_access: float, nbytes: int = 1000) -> KVEntry:
    digest = name.encode().ljust(16, b"-")
    return KVEntry(digest, b"p" * 16, fingerprint, b"t" * 16, 16, f"{fingerprint.hex()}/{name}.kv",
                   nbytes, name.encode().ljust(32, b"#"), last_access)


def test_kv_index_lru_totals_touch_remove_clear(store):
    fa, fb = b"A" * 16, b"B" * 16
    e1, e2, e3 = kv_entry("e1", fa, 10.0, 3 << 30), kv_entry("e2", fa, 30.0), kv_entry("e3", fa, 20.0)
    other = kv_entry("other", fb, 5.0, 7)
    store.kv_add([e1, e2, e3, other])

    assert store.kv_entries(fa) == [e1, e3, e2]  # every field round-trips; LRU first
    assert store.kv_entries(fb) == [other]
    assert store.kv_entries(b"C" * 16) == []
    assert store.kv_least_recent(2) == [other, e1]  # across every fingerprint
    assert store.kv_totals() == {fa: (3, (3 << 30) + 2000), fb: (1, 7)}  # > 2**31: BigInteger

    store.kv_touch([e1.hash], when=40.0)
    assert [e.hash for e in store.kv_entries(fa)] == [e3.hash, e2.hash, e1.hash]
    assert store.kv_entries(fa)[-1].last_access == 40.0
    store.kv_touch([e3.hash])  # now
    assert [e.hash for e in store.kv_entries(fa)] == [e2.hash, e1.hash, e3.hash]
    assert store.kv_entries(fa)[-1].last_access >= time.time() - 60
    store.kv_touch([])  # no-op

    rewritten = kv_entry("e2", fa, 50.0, 1234)  # the same block written again replaces its row
    store.kv_add([rewritten])
    assert store.kv_totals()[fa] == (3, (3 << 30) + 1234 + 1000)
    assert store.kv_entries(fa)[1] == rewritten

    store.kv_remove([e1.hash, b"unknown".ljust(16)])
    store.kv_remove([])
    assert [e.hash for e in store.kv_entries(fa)] == [e2.hash, e3.hash]
    assert store.kv_totals() == {fa: (2, 2234), fb: (1, 7)}

    assert store.kv_clear() == 3
    assert store.kv_totals() == {} and store.kv_entries(fa) == [] and store.kv_least_recent(10) == []


# --- crash consistency ---------------------------------------------------------------------------

WRITER = """
import sys
from kvforge.core.store import Conversation, Message, Store

store = Store(sys.argv[1])
log = store.create_conversation("log")
big = "x" * 100_000
i = 0
while True:
    with store.session() as s, s.begin():  # a conversation and its 3 messages: all or nothing
        conv = Conversation(title=f"atomic-{i}", settings={})
        s.add(conv)
        s.flush()
        for position in (1, 2, 3):
            s.add(Message(conversation_id=conv.id, position=position, role="user", content=big))
            s.flush()
    store.add_message(log.id, "user", f"log-{i}")
    print(log.id, i, flush=True)
    i += 1
"""


def test_killed_writer_leaves_a_consistent_database(db_url):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, db_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        deadline = time.monotonic() + 60
        while len(lines) < 8 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.split())
        assert len(lines) >= 8, proc.stderr.read() if proc.poll() is not None else "writer too slow"
        time.sleep(0.013)  # somewhere in the middle of a transaction, most likely
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    log_id, committed = lines[-1][0], int(lines[-1][1]) + 1  # reported after commit: durable

    if db_url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"))
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        finally:
            conn.close()

    store = Store(db_url)
    try:
        conversations = [c for c in store.list_conversations() if c.title.startswith("atomic-")]
        assert len(conversations) >= committed
        assert sorted(int(c.title.split("-")[1]) for c in conversations) == list(range(len(conversations)))
        for conv in conversations:
            assert [m.position for m in store.get_conversation(conv.id).messages] == [1, 2, 3], conv.title
        with store.engine.connect() as conn:  # no message without its conversation
            assert conn.execute(sa.text(
                "SELECT count(*) FROM messages m LEFT JOIN conversations c ON c.id = m.conversation_id "
                "WHERE c.id IS NULL")).scalar() == 0
        log = store.get_conversation(log_id).messages
        assert len(log) >= committed
        assert [(m.position, m.content) for m in log] == [(i + 1, f"log-{i}") for i in range(len(log))]
        store.add_message(log_id, "user", "after the crash")  # and the store keeps working
        assert store.get_conversation(log_id).messages[-1].position == len(log) + 1
    finally:
        store.engine.dispose()
