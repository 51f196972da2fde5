"""Conversations: the app's chats and their messages, kept in the Store (core/store.py) the app opened.

The sessions API (app/sessions.py), the chat turns (app/chat_service.py) and the browser UI (ui/service.py)
all go through one Conversations. The tables are the data file's schema (core/migrations); these models map
them. Every call is one short transaction on its own session, safe from any thread.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text, UniqueConstraint, delete, func, select
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kvforge.core.store import Base, Store


def new_id() -> str:
    return uuid.uuid4().hex


class NotFound(LookupError):
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
    content: Mapped[str] = mapped_column(Text)  # a reasoning model's answer, without its think block
    reasoning: Mapped[str | None] = mapped_column(Text)  # its think block (app/reasoning.py); None: none
    # an assistant's tool calls in OpenAI's shape ([{"id", "type": "function", "function": {"name", "arguments"}}])
    tool_calls: Mapped[list | None] = mapped_column(JSON)
    tool_call_id: Mapped[str | None] = mapped_column(String(200))  # a tool message: the call it answers
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
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        out.update({k: getattr(self, k) for k in self.STATS if getattr(self, k) is not None})
        return out


class Conversations:
    """Conversation CRUD on a Store its caller owns (and closes)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, title: str = "New chat", model: str | None = None, settings: dict | None = None) -> Conversation:
        with self.store.session() as s, s.begin():
            conv = Conversation(title=title, model=model, settings=settings or {}, messages=[])
            s.add(conv)
        return conv

    def list(self) -> list[Conversation]:
        """Every conversation (without its messages), the most recently updated first."""
        with self.store.session() as s:
            return list(s.scalars(select(Conversation).order_by(Conversation.updated_at.desc())))

    def get(self, conversation_id: str) -> Conversation:
        """The conversation with its messages loaded, or NotFound."""
        with self.store.session() as s:
            conv = s.get(Conversation, conversation_id)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            conv.messages  # noqa: B018 - load them before the session closes
            return conv

    def update(self, conversation_id: str, **changes: Any) -> Conversation:
        with self.store.session() as s, s.begin():
            conv = s.get(Conversation, conversation_id)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            for key, value in changes.items():
                setattr(conv, key, value)
            conv.updated_at = time.time()
            conv.messages  # noqa: B018
        return conv

    def delete(self, conversation_id: str) -> None:
        with self.store.session() as s, s.begin():
            if s.execute(delete(Conversation).where(Conversation.id == conversation_id)).rowcount == 0:
                raise NotFound(f"session {conversation_id!r} not found")

    def add_message(self, conversation_id: str, role: str, content: str, reasoning: str | None = None,
                    tool_calls: list[dict] | None = None, tool_call_id: str | None = None, **stats: Any) -> Message:
        """Append a message (at the next position) in one transaction."""
        with self.store.session() as s, s.begin():
            conv = s.get(Conversation, conversation_id, with_for_update=True)
            if conv is None:
                raise NotFound(f"session {conversation_id!r} not found")
            # The INSERT computes the position itself: SQLite ignores FOR UPDATE and runs a separate
            # SELECT before taking the write lock, so two appends could both read the same max.
            position = (select(func.coalesce(func.max(Message.position), 0) + 1)
                        .where(Message.conversation_id == conversation_id).scalar_subquery())
            message = Message(conversation_id=conversation_id, position=position, role=role,
                              content=content, reasoning=reasoning, tool_calls=tool_calls or None,
                              tool_call_id=tool_call_id, **stats)
            s.add(message)
            conv.updated_at = message.created_at = time.time()
            s.flush()
            message.position  # noqa: B018 - load the computed position before the session closes
        return message

    def truncate_messages(self, conversation_id: str, keep: int) -> None:
        """Drop every message after the first `keep` (regenerate, edit the last message)."""
        with self.store.session() as s, s.begin():
            positions = list(s.scalars(select(Message.position).where(Message.conversation_id == conversation_id)
                                       .order_by(Message.position)))
            if len(positions) > keep:
                s.execute(delete(Message).where(Message.conversation_id == conversation_id,
                                                Message.position >= positions[keep]))
