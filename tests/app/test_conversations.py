"""Conversations (app/conversations.py), on SQLite and on a real PostgreSQL server: conversations and their
messages, and crash consistency when the writing process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa

from kvforge.app.conversations import Conversations, NotFound
from kvforge.core.store import Store


@pytest.fixture
def conversations(db_url):
    store = Store(db_url)
    yield Conversations(store)
    store.close()


def message_rows(conversations: Conversations, conversation_id: str) -> list[tuple[int, str]]:
    """(position, content) of a conversation's messages, straight from SQL (no ORM relationship)."""
    with conversations.store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            sa.text("SELECT position, content FROM messages WHERE conversation_id = :c ORDER BY position"),
            {"c": conversation_id})]


# --- conversations -------------------------------------------------------------------------------

def test_conversation_crud_and_ordering(conversations):
    a = conversations.create("A", model="m1", settings={"system": "be brief"})
    b = conversations.create("B")
    c = conversations.create("C")
    assert len({a.id, b.id, c.id}) == 3
    assert [x.id for x in conversations.list()] == [c.id, b.id, a.id]  # newest first

    first = conversations.add_message(a.id, "user", "hi", prompt_tokens=3)
    second = conversations.add_message(a.id, "assistant", "hello", completion_tokens=2, finish_reason="stop",
                                       cached_tokens=0, ttft_s=0.5, tokens_per_s=12.5)
    third = conversations.add_message(a.id, "user", "more")
    assert [first.position, second.position, third.position] == [1, 2, 3]
    assert [x.id for x in conversations.list()] == [a.id, c.id, b.id]  # a message bumps updated_at

    got = conversations.get(a.id)
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

    before = conversations.get(b.id).updated_at
    renamed = conversations.update(b.id, title="B2", settings={"sampling": {"temperature": 0.2}})
    assert renamed.title == "B2" and renamed.updated_at > before
    again = conversations.get(b.id)
    assert (again.title, again.settings, again.model) == ("B2", {"sampling": {"temperature": 0.2}}, None)
    assert [x.id for x in conversations.list()] == [b.id, a.id, c.id]

    assert len(message_rows(conversations, a.id)) == 3
    conversations.delete(a.id)
    assert message_rows(conversations, a.id) == []  # ON DELETE CASCADE, at the SQL level
    with pytest.raises(NotFound):
        conversations.get(a.id)
    assert [x.id for x in conversations.list()] == [b.id, c.id]
    assert conversations.get(c.id).messages == []


@pytest.mark.parametrize("call", [
    lambda s: s.get("nope"),
    lambda s: s.update("nope", title="x"),
    lambda s: s.delete("nope"),
    lambda s: s.add_message("nope", "user", "hi"),
], ids=["get", "update", "delete", "add_message"])
def test_unknown_conversation_is_not_found(conversations, call):
    conversations.create("other")
    with pytest.raises(NotFound, match="nope"):
        call(conversations)
    with conversations.store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM messages")).scalar() == 0


def test_truncate_messages_then_append_continues_the_positions(conversations):
    conv = conversations.create()
    other = conversations.create()
    for i in range(5):
        conversations.add_message(conv.id, "user", f"m{i}")
    conversations.add_message(other.id, "user", "untouched")
    conversations.truncate_messages(conv.id, 3)
    assert message_rows(conversations, conv.id) == [(1, "m0"), (2, "m1"), (3, "m2")]
    assert conversations.add_message(conv.id, "assistant", "new").position == 4
    conversations.truncate_messages(conv.id, 10)  # nothing past the end: no-op
    assert [p for p, _ in message_rows(conversations, conv.id)] == [1, 2, 3, 4]
    conversations.truncate_messages(conv.id, 0)
    assert message_rows(conversations, conv.id) == []
    assert conversations.add_message(conv.id, "user", "restart").position == 1
    assert message_rows(conversations, other.id) == [(1, "untouched")]


def test_concurrent_appends_get_contiguous_positions(conversations):
    """Appends to one conversation from several threads (two browser tabs) all succeed, in order."""
    conv = conversations.create()
    errors: list[Exception] = []

    def append(worker: int) -> None:
        for i in range(10):
            try:
                conversations.add_message(conv.id, "user", f"{worker}-{i}")
            except Exception as exc:  # collected and reported below
                errors.append(exc)

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = message_rows(conversations, conv.id)
    assert [p for p, _ in rows] == list(range(1, 41))
    for worker in range(4):  # each thread's messages keep their order
        mine = [c for _, c in rows if c.startswith(f"{worker}-")]
        assert mine == [f"{worker}-{i}" for i in range(10)]


# --- crash consistency ---------------------------------------------------------------------------

WRITER = """
import sys
from kvforge.app.conversations import Conversation, Conversations, Message
from kvforge.core.store import Store

store = Store(sys.argv[1])
conversations = Conversations(store)
log = conversations.create("log")
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
    conversations.add_message(log.id, "user", f"log-{i}")
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
    stored = Conversations(store)
    try:
        conversations = [c for c in stored.list() if c.title.startswith("atomic-")]
        assert len(conversations) >= committed
        assert sorted(int(c.title.split("-")[1]) for c in conversations) == list(range(len(conversations)))
        for conv in conversations:
            assert [m.position for m in stored.get(conv.id).messages] == [1, 2, 3], conv.title
        with store.engine.connect() as conn:  # no message without its conversation
            assert conn.execute(sa.text(
                "SELECT count(*) FROM messages m LEFT JOIN conversations c ON c.id = m.conversation_id "
                "WHERE c.id IS NULL")).scalar() == 0
        log = stored.get(log_id).messages
        assert len(log) >= committed
        assert [(m.position, m.content) for m in log] == [(i + 1, f"log-{i}") for i in range(len(log))]
        stored.add_message(log_id, "user", "after the crash")  # and the store keeps working
        assert stored.get(log_id).messages[-1].position == len(log) + 1
    finally:
        store.engine.dispose()
