"""Store: the SQLAlchemy database behind conversations, their messages and the persisted-KV index.

One URL selects it: a SQLite file (the default, inside the data directory) or PostgreSQL
(`postgresql+psycopg://...`). The schema is created and upgraded by Alembic migrations on open.
Every write is one short transaction, so a process killed at any moment leaves the database
consistent (SQLite runs in WAL mode). Timestamps are Unix seconds, like the OpenAI API's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from kvforge.core.private_files import DIR_MODE, private_file

MIGRATIONS = Path(__file__).parent / "migrations"


def default_data_dir() -> Path:
    """$KVFORGE_DATA_DIR, else the user's data directory (~/.local/share/kvforge on Linux)."""
    env = os.environ.get("KVFORGE_DATA_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("kvforge", appauthor=False))


def default_db_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'kvforge.db'}"


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    pass


class Conversation(Base):
    __tablename__ = "conversations"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    title: Mapped[str] = mapped_column(String(200))
    model: Mapped[str | None] = mapped_column(String(200))
    settings: Mapped[dict] = mapped_column(JSON, default=dict)  # system prompt, sampling defaults
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation", order_by="Message.position", cascade="all, delete-orphan",
        passive_deletes=True)

    def to_dict(self, messages: bool = False) -> dict[str, Any]:
        out = {"id": self.id, "object": "session", "title": self.title, "model": self.model,
               "settings": self.settings or {}, "created_at": self.created_at, "updated_at": self.updated_at}
        if messages:
            out["messages"] = [m.to_dict() for m in self.messages]
        return out


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("conversation_id", "position"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    conversation: Mapped[Conversation] = relationship(back_populates="messages")

    STATS = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "ttft_s", "tokens_per_s")

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "role": self.role, "content": self.content, "created_at": self.created_at}
        out.update({k: getattr(self, k) for k in self.STATS if getattr(self, k) is not None})
        return out


class KVBlockRow(Base):
    """One persisted KV block: the file holding it and what it must contain."""
    __tablename__ = "kv_blocks"
    hash: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    parent_hash: Mapped[bytes] = mapped_column(LargeBinary(16))
    fingerprint: Mapped[bytes] = mapped_column(LargeBinary(16), index=True)
    token_digest: Mapped[bytes] = mapped_column(LargeBinary(16))
    num_tokens: Mapped[int] = mapped_column(Integer)
    file: Mapped[str] = mapped_column(String(200))  # relative to the KV directory
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[bytes] = mapped_column(LargeBinary(32))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    last_access: Mapped[float] = mapped_column(Float, default=time.time, index=True)


@dataclass(frozen=True)
class KVEntry:
    hash: bytes
    parent_hash: bytes
    fingerprint: bytes
    token_digest: bytes
    num_tokens: int
    file: str
    nbytes: int
    checksum: bytes
    last_access: float

    @classmethod
    def from_row(cls, row: KVBlockRow) -> KVEntry:
        return cls(row.hash, row.parent_hash, row.fingerprint, row.token_digest, row.num_tokens, row.file,
                   row.nbytes, row.checksum, row.last_access)


class NotFound(LookupError):
    pass


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer; crash-consistent
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def upgrade(engine: Engine) -> None:
    """Create or upgrade the schema to the newest migration (Alembic, scripts in core/migrations)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


class Store:
    _open: dict[str, Store] = {}
    _open_lock = threading.Lock()

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            path = Path(url.removeprefix("sqlite:///")).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)  # a new one is private; a given one kept
            private_file(path)  # SQLite gives its -wal / -shm / -journal files the database file's mode
        self.engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str) -> Store:
        """One Store per URL in a process (the server's sessions and the engine's KV index share it)."""
        with cls._open_lock:
            store = cls._open.get(url)
            if store is None:
                store = cls._open[url] = cls(url)
            return store

    def session(self) -> Session:
        return self._sessions()

    # --- conversations ------------------------------------------------------------------------

    def create_conversation(self, title: str = "New chat", model: str | None = None,
                            settings: dict | None = None) -> Conversation:
        with self.session() as s, s.begin():
            conv = Conversation(title=title, model=model, settings=settings or {}, messages=[])
            s.add(conv)
        return conv

    def list_conversations(self) -> list[Conversation]:
        with self.session() as s:
            return list(s.scalars(select(Conversation).order_by(Conversation.updated_at.desc())))

    def get_conversation(self, conversation_id: str) -> Conversation:
        """The conversation with its messages loaded, or NotFound."""
        with self.session() as s:
            conv = s.get(Conversation, conversation_id)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            conv.messages  # noqa: B018 - load them before the session closes
            return conv

    def update_conversation(self, conversation_id: str, **changes: Any) -> Conversation:
        with self.session() as s, s.begin():
            conv = s.get(Conversation, conversation_id)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            for key, value in changes.items():
                setattr(conv, key, value)
            conv.updated_at = time.time()
            conv.messages  # noqa: B018
        return conv

    def delete_conversation(self, conversation_id: str) -> None:
        with self.session() as s, s.begin():
            if s.execute(delete(Conversation).where(Conversation.id == conversation_id)).rowcount == 0:
                raise NotFound(f"session {conversation_id!r} not found")

    def add_message(self, conversation_id: str, role: str, content: str, **stats: Any) -> Message:
        """Append a message (at the next position) in one transaction."""
        with self.session() as s, s.begin():
            conv = s.get(Conversation, conversation_id, with_for_update=True)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            # The INSERT computes the position itself: SQLite ignores FOR UPDATE and runs a separate
            # SELECT before taking the write lock, so two appends could both read the same max.
            position = (select(func.coalesce(func.max(Message.position), 0) + 1)
                        .where(Message.conversation_id == conversation_id).scalar_subquery())
            message = Message(conversation_id=conversation_id, position=position, role=role,
                              content=content, **stats)
            s.add(message)
            conv.updated_at = message.created_at = time.time()
            s.flush()
            message.position  # noqa: B018 - load the computed position before the session closes
        return message

    def truncate_messages(self, conversation_id: str, keep: int) -> None:
        """Drop every message after the first `keep` (regenerate, edit the last message)."""
        with self.session() as s, s.begin():
            positions = list(s.scalars(select(Message.position).where(Message.conversation_id == conversation_id)
                                       .order_by(Message.position)))
            if len(positions) > keep:
                s.execute(delete(Message).where(Message.conversation_id == conversation_id,
                                                Message.position >= positions[keep]))

    # --- persisted KV index -------------------------------------------------------------------

    def kv_entries(self, fingerprint: bytes) -> list[KVEntry]:
        """This model's persisted blocks, least recently used first."""
        with self.session() as s:
            rows = s.scalars(select(KVBlockRow).where(KVBlockRow.fingerprint == fingerprint)
                             .order_by(KVBlockRow.last_access))
            return [KVEntry.from_row(r) for r in rows]

    def kv_add(self, entries: Iterable[KVEntry]) -> None:
        with self.session() as s, s.begin():
            for e in entries:
                s.merge(KVBlockRow(hash=e.hash, parent_hash=e.parent_hash, fingerprint=e.fingerprint,
                                   token_digest=e.token_digest, num_tokens=e.num_tokens, file=e.file,
                                   nbytes=e.nbytes, checksum=e.checksum, last_access=e.last_access))

    def kv_touch(self, hashes: Iterable[bytes], when: float | None = None) -> None:
        when = when or time.time()
        self.kv_set_access(dict.fromkeys(hashes, when))

    def kv_set_access(self, times: dict[bytes, float]) -> None:
        """Record access times (hash -> Unix seconds) of indexed blocks; unknown hashes are ignored."""
        if times:
            with self.session() as s, s.begin():
                known = set(s.scalars(select(KVBlockRow.hash).where(KVBlockRow.hash.in_(list(times)))))
                rows = [{"hash": h, "last_access": t} for h, t in times.items() if h in known]
                if rows:
                    s.execute(update(KVBlockRow), rows)

    def kv_children(self, parents: Iterable[bytes]) -> list[KVEntry]:
        with self.session() as s:
            rows = s.scalars(select(KVBlockRow).where(KVBlockRow.parent_hash.in_(list(parents))))
            return [KVEntry.from_row(r) for r in rows]

    def kv_remove(self, hashes: Iterable[bytes]) -> None:
        hashes = list(hashes)
        if hashes:
            with self.session() as s, s.begin():
                s.execute(delete(KVBlockRow).where(KVBlockRow.hash.in_(hashes)))

    def kv_least_recent(self, limit: int) -> list[KVEntry]:
        """Eviction candidates across every model: the budget is for the whole KV directory."""
        with self.session() as s:
            rows = s.scalars(select(KVBlockRow).order_by(KVBlockRow.last_access).limit(limit))
            return [KVEntry.from_row(r) for r in rows]

    def kv_totals(self) -> dict[bytes, tuple[int, int]]:
        """fingerprint -> (blocks, bytes)."""
        with self.session() as s:
            rows = s.execute(select(KVBlockRow.fingerprint, func.count(), func.coalesce(func.sum(KVBlockRow.nbytes), 0))
                             .group_by(KVBlockRow.fingerprint))
            return {fp: (int(n), int(b)) for fp, n, b in rows}

    def kv_clear(self) -> int:
        with self.session() as s, s.begin():
            return s.execute(delete(KVBlockRow)).rowcount
