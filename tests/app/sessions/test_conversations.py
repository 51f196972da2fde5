"""Conversations (app/sessions/conversations.py), on SQLite and on a real PostgreSQL server: conversations and their
messages, the message tree (branches: edits and regenerated replies beside the old ones), and crash consistency
when the writing process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa

from kvforge.app.sessions.conversations import Conversations, MessageNotFound, NotFound
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
    assert out["current_message_id"] == third.id
    assert out["messages"][1] | {"id": 0, "created_at": 0} == {
        "id": 0, "created_at": 0, "parent_id": first.id, "siblings": [second.id], "role": "assistant",
        "content": "hello", "completion_tokens": 2, "finish_reason": "stop", "cached_tokens": 0, "ttft_s": 0.5,
        "tokens_per_s": 12.5}
    assert second.to_dict() == out["messages"][1]  # as add_message returned it
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


def shape(conv) -> list[tuple[str, str | None, int, list[str]]]:
    """(content, parent's content, position, siblings' contents) of each message shown."""
    content = {m.id: m.content for m in conv.nodes}
    return [(m.content, content.get(m.parent_id), m.position, [content[s] for s in m.siblings]) for m in conv.messages]


def test_edits_and_regenerated_replies_keep_every_branch(conversations):
    conv = conversations.create()
    u1 = conversations.add_message(conv.id, "user", "u1")
    a1 = conversations.add_message(conv.id, "assistant", "a1")
    u2 = conversations.add_message(conv.id, "user", "u2")
    a2 = conversations.add_message(conv.id, "assistant", "a2")
    assert (u1.parent_id, a1.parent_id, u2.parent_id, a2.parent_id) == (None, u1.id, a1.id, u2.id)
    before = conversations.get(conv.id).updated_at

    # edit u2: the new text follows a1 (u2's parent), beside u2; it and its reply are shown
    u2b = conversations.add_message(conv.id, "user", "u2b", parent_id=a1.id)
    assert (u2b.parent_id, u2b.position, u2b.siblings) == (a1.id, 3, [u2.id, u2b.id])
    a2b = conversations.add_message(conv.id, "assistant", "a2b", parent_id=u2b.id)
    # regenerate a2b: another reply to u2b, beside it
    a2c = conversations.add_message(conv.id, "assistant", "a2c", parent_id=u2b.id)
    assert a2c.siblings == [a2b.id, a2c.id] and a2c.to_dict()["siblings"] == [a2b.id, a2c.id]
    got = conversations.get(conv.id)
    assert got.current_message_id == a2c.id and got.updated_at >= before
    assert shape(got) == [("u1", None, 1, ["u1"]), ("a1", "u1", 2, ["a1"]),
                          ("u2b", "a1", 3, ["u2", "u2b"]), ("a2c", "u2b", 4, ["a2b", "a2c"])]
    assert [m.to_dict() for m in got.messages] == got.to_dict(messages=True)["messages"]
    assert [m.content for m in conversations.tree(conv.id)] == ["u1", "a1", "u2", "a2", "u2b", "a2b", "a2c"]
    assert [m.content for m in conversations.path(conv.id, a2.id)] == ["u1", "a1", "u2", "a2"]
    assert conversations.path(conv.id, None) == []

    # back to the first branch: the old messages, intact; a message sent now follows a2
    listed = conversations.list()[0].updated_at
    shown = conversations.switch(conv.id, u2.id)
    assert shown.current_message_id == a2.id and [m.content for m in shown.messages] == ["u1", "a1", "u2", "a2"]
    assert [m.to_dict() for m in shown.messages[:2]] == [m.to_dict() for m in got.messages[:2]]
    assert conversations.list()[0].updated_at == listed  # showing a branch is not an update
    u3 = conversations.add_message(conv.id, "user", "u3")
    assert (u3.parent_id, u3.position) == (a2.id, 5)
    # switch lands on the most recent leaf under the message: the newest child at each level
    assert conversations.switch(conv.id, a1.id).current_message_id == a2c.id
    assert conversations.switch(conv.id, u1.id).current_message_id == a2c.id
    assert conversations.switch(conv.id, a2.id).current_message_id == u3.id
    assert conversations.switch(conv.id, a2b.id).current_message_id == a2b.id  # a leaf is its own

    # editing the first message: a new root; set_current shows a branch up to an exact message
    root = conversations.add_message(conv.id, "user", "u1b", parent_id=None)
    assert (root.parent_id, root.position, root.siblings) == (None, 1, [u1.id, root.id])
    assert [m.content for m in conversations.get(conv.id).messages] == ["u1b"]
    assert conversations.set_current(conv.id, u2.id).messages[-1].content == "u2"
    assert conversations.set_current(conv.id, None).messages == []
    u1c = conversations.add_message(conv.id, "user", "u1c")
    assert u1c.siblings == [u1.id, root.id, u1c.id]

    # a message of another conversation (or none) is not one of its own: nothing stored, nothing shown
    other = conversations.create()
    foreign = conversations.add_message(other.id, "user", "theirs")
    current = conversations.get(conv.id).current_message_id
    for call in (lambda: conversations.add_message(conv.id, "user", "x", parent_id=foreign.id),
                 lambda: conversations.add_message(conv.id, "user", "x", parent_id=10**6),
                 lambda: conversations.switch(conv.id, foreign.id),
                 lambda: conversations.set_current(conv.id, foreign.id),
                 lambda: conversations.path(conv.id, foreign.id)):
        with pytest.raises(MessageNotFound, match=str(foreign.id) + "|1000000"):
            call()
    assert conversations.get(conv.id).current_message_id == current
    assert len(conversations.tree(conv.id)) == 10 and len(conversations.tree(other.id)) == 1
    with pytest.raises(NotFound, match="nope"):
        conversations.switch("nope", u1.id)

    conversations.delete(conv.id)  # every branch goes with it, at the SQL level
    assert message_rows(conversations, conv.id) == []
    assert message_rows(conversations, other.id) == [(1, "theirs")]


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
    chain = conversations.get(conv.id).messages  # one branch: each follows the one before
    assert [m.content for m in chain] == [c for _, c in rows]
    assert [m.parent_id for m in chain] == [None] + [m.id for m in chain[:-1]]
    for worker in range(4):  # each thread's messages keep their order
        mine = [c for _, c in rows if c.startswith(f"{worker}-")]
        assert mine == [f"{worker}-{i}" for i in range(10)]


# --- crash consistency ---------------------------------------------------------------------------

WRITER = """
import sys
from kvforge.app.sessions.conversations import Conversation, Conversations, Message
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
        parent = None
        for position in (1, 2, 3):
            message = Message(conversation_id=conv.id, parent_id=parent, position=position, role="user", content=big)
            s.add(message)
            s.flush()
            parent = conv.current_message_id = message.id
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


def test_pictures_are_kept_once_and_deleted_with_the_last_conversation_that_shows_them(conversations):
    """A picture's bytes are stored once whichever messages show it (SQLite and PostgreSQL: a LargeBinary column),
    listed by the messages in order, and deleted when no remaining message shows it."""
    first, second = conversations.create("one"), conversations.create("two")
    shared, own = b"\x89PNG shared bytes", b"GIF89a own bytes"
    digests = conversations.add_pictures([shared, own])
    conversations.add_message(first.id, "user", "look", images=digests)
    conversations.add_message(second.id, "user", "again", images=conversations.add_pictures([shared]))
    assert conversations.get(first.id).messages[0].images == digests
    assert conversations.get(second.id).messages[0].to_dict()["images"] == digests[:1]
    assert conversations.pictures(digests) == dict(zip(digests, [shared, own]))
    with conversations.store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM pictures")).scalar() == 2
    conversations.delete(first.id)
    assert conversations.pictures(digests) == {digests[0]: shared}  # the other conversation still shows it
    conversations.delete(second.id)
    assert conversations.pictures(digests) == {}
    untouched = conversations.create("text")
    conversations.add_message(untouched.id, "user", "no pictures")
    assert "images" not in conversations.get(untouched.id).messages[0].to_dict()
