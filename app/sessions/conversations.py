"""Conversations: the app's chats and their messages, kept in the Store (core/store.py) the app opened.

The sessions API (app/sessions/routes.py), the chat turns (app/sessions/service.py) and the browser UI (ui/service.py)
all go through one Conversations. The tables are the data file's schema (core/migrations); these models map
them. Every call is one short transaction on its own session, safe from any thread.

A conversation's messages form a tree, as in ChatGPT: editing a message or regenerating a reply adds a sibling
(another child of the same parent) instead of replacing it, so every branch is kept. `Conversation.nodes` holds
every message; `current_message_id` is the last message of the branch shown, and `Conversation.messages` is that
branch (root first), the history a turn renders. A message's `position` is its depth (a root's is 1).
"""

from __future__ import annotations

import enum
import hashlib
import time
import uuid
from collections import defaultdict
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, LargeBinary, String, Text, delete, select, update
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kvforge.core.store import Base, Store


def new_id() -> str:
    return uuid.uuid4().hex


class NotFound(LookupError):
    pass


class MessageNotFound(NotFound):
    """A message id that is not one of the conversation's messages."""

    def __init__(self, message_id: int, conversation_id: str) -> None:
        super().__init__(f"message {message_id} is not a message of session {conversation_id!r}")
        self.message_id = message_id


class Leaf(enum.Enum):
    CURRENT = "current"


CURRENT = Leaf.CURRENT  # add_message's default parent: the last message of the branch shown


class Conversation(Base):
    __tablename__ = "conversations"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    title: Mapped[str] = mapped_column(String(200))
    model: Mapped[str | None] = mapped_column(String(200))
    settings: Mapped[dict] = mapped_column(JSON, default=dict)  # system prompt, sampling defaults
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    # the last message of the branch shown (None: none shown); a plain integer, so that the two tables do not
    # reference each other
    current_message_id: Mapped[int | None] = mapped_column(Integer)
    nodes: Mapped[list[Message]] = relationship(  # every message of every branch, in creation order
        back_populates="conversation", order_by="Message.id", cascade="all, delete-orphan", passive_deletes=True)

    @property
    def messages(self) -> list[Message]:
        """The branch shown, root first: the history the next turn renders."""
        return self.path(self.current_message_id)

    def path(self, message_id: int | None) -> list[Message]:
        """The messages from a root down to `message_id` (None: none); MessageNotFound for an id not here."""
        by_id = {m.id: m for m in self.nodes}
        path = []
        while message_id is not None:
            if message_id not in by_id:
                raise MessageNotFound(message_id, self.id)
            path.append(by_id[message_id])
            message_id = by_id[message_id].parent_id
        return path[::-1]

    def node(self, message_id: int) -> Message:
        """One message of any branch; MessageNotFound for an id not here."""
        for message in self.nodes:
            if message.id == message_id:
                return message
        raise MessageNotFound(message_id, self.id)

    def to_dict(self, messages: bool = False) -> dict[str, Any]:
        out = {"id": self.id, "object": "session", "title": self.title, "model": self.model,
               "settings": self.settings or {}, "current_message_id": self.current_message_id,
               "created_at": self.created_at, "updated_at": self.updated_at}
        if messages:
            out["messages"] = [m.to_dict() for m in self.messages]
        return out


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (Index("ix_messages_conversation_id_position", "conversation_id", "position"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    # the message this one follows (None: a root); messages sharing a parent are the branches at that point
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("messages.id", ondelete="CASCADE", name="fk_messages_parent_id_messages"), index=True)
    position: Mapped[int] = mapped_column(Integer)  # the depth: the parent's + 1, a root's 1
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)  # a reasoning model's answer, without its think block
    # its think block (app/generate/parsers/reasoning.py); None: none
    reasoning: Mapped[str | None] = mapped_column(Text)
    # an assistant's tool calls in OpenAI's shape ([{"id", "type": "function", "function": {"name", "arguments"}}])
    tool_calls: Mapped[list | None] = mapped_column(JSON)
    tool_call_id: Mapped[str | None] = mapped_column(String(200))  # a tool message: the call it answers
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    # a reply to a conversation longer than the context: what its prompt left out, {"dropped_messages",
    # "dropped_turns"}; named as the API's field (app/generate/context_fit.py FIELD), which stores it; None: nothing
    context_truncated: Mapped[dict | None] = mapped_column(JSON)
    # a user message's pictures, in order: each one's SHA-256 (hex), its bytes in `pictures`; None: none
    images: Mapped[list | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    conversation: Mapped[Conversation] = relationship(back_populates="nodes")
    # not a column: the ids of the messages sharing this one's parent (itself included, in creation order), set
    # by Conversations on what it returns, so that a client can show "< 2/3 >"
    siblings = None

    # a reply's figures: kept, exported and shown (to_dict) where known
    STATS = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "ttft_s", "tokens_per_s",
             "context_truncated")

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "parent_id": self.parent_id, "role": self.role, "content": self.content,
               "created_at": self.created_at}
        if self.siblings is not None:
            out["siblings"] = list(self.siblings)
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.images:
            out["images"] = list(self.images)
        out.update({k: getattr(self, k) for k in self.STATS if getattr(self, k) is not None})
        return out


class Picture(Base):
    """A picture's bytes, once, whichever messages show it (Message.images name it by its SHA-256)."""

    __tablename__ = "pictures"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)


class Conversations:
    """Conversation CRUD on a Store its caller owns (and closes). A conversation returned has every message
    loaded (`nodes`) with their `siblings`; a message returned has its `siblings`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, title: str = "New chat", model: str | None = None, settings: dict | None = None) -> Conversation:
        with self.store.session() as s, s.begin():
            conv = Conversation(title=title, model=model, settings=settings or {}, nodes=[])
            s.add(conv)
        return conv

    def list(self) -> list[Conversation]:
        """Every conversation (without its messages), the most recently updated first."""
        with self.store.session() as s:
            return list(s.scalars(select(Conversation).order_by(Conversation.updated_at.desc())))

    def get(self, conversation_id: str) -> Conversation:
        """The conversation with its messages loaded, or NotFound."""
        with self.store.session() as s:
            return with_siblings(self._get(s, conversation_id))

    def path(self, conversation_id: str, message_id: int | None) -> list[Message]:
        """The branch from a root down to `message_id`; NotFound, MessageNotFound."""
        return self.get(conversation_id).path(message_id)

    def tree(self, conversation_id: str) -> list[Message]:
        """Every message of every branch, in creation order (each with its parent_id and siblings); NotFound."""
        return self.get(conversation_id).nodes

    def update(self, conversation_id: str, **changes: Any) -> Conversation:
        with self.store.session() as s, s.begin():
            conv = self._get(s, conversation_id)
            for key, value in changes.items():
                setattr(conv, key, value)
            conv.updated_at = time.time()
        return with_siblings(conv)

    def delete(self, conversation_id: str) -> None:
        with self.store.session() as s, s.begin():
            if s.execute(delete(Conversation).where(Conversation.id == conversation_id)).rowcount == 0:
                raise NotFound(f"session {conversation_id!r} not found")
            drop_unshown_pictures(s)

    def add_pictures(self, pictures: list[bytes]) -> list[str]:
        """Keep each picture's bytes (once per content); their SHA-256s, in order, for add_message's `images`."""
        with self.store.session() as s, s.begin():
            return keep_pictures(s, pictures)

    def pictures(self, digests: list[str]) -> dict[str, bytes]:
        """The bytes of the pictures kept under these SHA-256s (those kept)."""
        with self.store.session() as s:
            return {p.sha256: p.data for p in s.scalars(select(Picture).where(Picture.sha256.in_(set(digests))))}

    def add_message(self, conversation_id: str, role: str, content: str, reasoning: str | None = None,
                    tool_calls: list[dict] | None = None, tool_call_id: str | None = None,
                    parent_id: int | None | Leaf = CURRENT, images: list[str] | None = None, **stats: Any) -> Message:
        """Add a message under `parent_id` (None: a new root; by default the last message of the branch shown)
        and show its branch (it becomes current_message_id), in one transaction; NotFound, MessageNotFound.
        `images`: the SHA-256s of its pictures (add_pictures kept them)."""
        with self.store.session() as s, s.begin():
            now = time.time()
            # The write lock first (PostgreSQL: the conversation's row; SQLite runs reads before a transaction's
            # first write outside it), so that two appends at the current leaf cannot both read the same leaf.
            touched = s.execute(update(Conversation).where(Conversation.id == conversation_id)
                                .values(updated_at=now))
            if touched.rowcount == 0:
                raise NotFound(f"session {conversation_id!r} not found")
            if parent_id is CURRENT:
                parent_id = s.scalar(select(Conversation.current_message_id).where(Conversation.id == conversation_id))
            position = 1
            if parent_id is not None:
                depth = s.scalar(select(Message.position).where(Message.id == parent_id,
                                                                 Message.conversation_id == conversation_id))
                if depth is None:
                    raise MessageNotFound(parent_id, conversation_id)
                position = depth + 1
            message = Message(conversation_id=conversation_id, parent_id=parent_id, position=position, role=role,
                              content=content, reasoning=reasoning, tool_calls=tool_calls or None,
                              tool_call_id=tool_call_id, images=images or None, created_at=now, **stats)
            s.add(message)
            s.flush()
            s.execute(update(Conversation).where(Conversation.id == conversation_id)
                      .values(current_message_id=message.id))
            same_parent = Message.parent_id.is_(None) if parent_id is None else Message.parent_id == parent_id
            message.siblings = list(s.scalars(select(Message.id).order_by(Message.id).where(
                Message.conversation_id == conversation_id, same_parent)))
        return message

    def switch(self, conversation_id: str, message_id: int) -> Conversation:
        """Show the branch through `message_id`: down to its most recent leaf (the newest child at each level),
        where a chat app's "< 2/3 >" arrows land; NotFound, MessageNotFound."""
        return self._show(conversation_id, message_id, descend=True)

    def set_current(self, conversation_id: str, message_id: int | None) -> Conversation:
        """Show the branch that ends at `message_id` exactly (None: no message), e.g. before a message is edited;
        NotFound, MessageNotFound."""
        return self._show(conversation_id, message_id, descend=False)

    def _show(self, conversation_id: str, message_id: int | None, descend: bool) -> Conversation:
        with self.store.session() as s, s.begin():
            conv = self._get(s, conversation_id)
            if message_id is not None:
                conv.node(message_id)  # one of its own
            if descend:
                newest_child = {m.parent_id: m.id for m in conv.nodes}  # creation order: the last one wins
                while message_id in newest_child:
                    message_id = newest_child[message_id]
            conv.current_message_id = message_id  # viewing another branch is not an update: updated_at stays
        return with_siblings(conv)

    @staticmethod
    def _get(s, conversation_id: str) -> Conversation:
        conv = s.get(Conversation, conversation_id)
        if conv is None:
            raise NotFound(f"session {conversation_id!r} not found")
        conv.nodes  # noqa: B018 - load them before the session closes
        return conv


def shown_pictures(messages: list[Message]) -> list[str]:
    """The SHA-256s of the pictures these messages show, in order."""
    return [digest for m in messages for digest in m.images or ()]


def keep_pictures(s, pictures: list[bytes]) -> list[str]:
    """Keep each picture once (in session `s`'s transaction); their SHA-256s in order."""
    digests = [hashlib.sha256(data).hexdigest() for data in pictures]
    for digest, data in zip(digests, pictures):
        if s.get(Picture, digest) is None:
            s.add(Picture(sha256=digest, data=data))
            s.flush()
    return digests


def drop_unshown_pictures(s) -> None:
    """Delete the pictures no message shows any more (after a conversation's deletion, in its transaction)."""
    shown = {digest for images in s.scalars(select(Message.images).where(Message.images.is_not(None)))
             for digest in images or ()}
    kept = set(s.scalars(select(Picture.sha256)))
    if kept - shown:
        s.execute(delete(Picture).where(Picture.sha256.in_(kept - shown)))


def with_siblings(conv: Conversation) -> Conversation:
    """Set each message's `siblings` (the children of its parent, in creation order)."""
    children: dict[int | None, list[int]] = defaultdict(list)
    for message in conv.nodes:
        children[message.parent_id].append(message.id)
    for message in conv.nodes:
        message.siblings = children[message.parent_id]
    return conv
