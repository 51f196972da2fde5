"""A conversation's export format, and import: a whole conversation tree as one JSON document.

    {"format": "kvforge.conversation", "version": 1, "title", "model", "settings", "created_at", "updated_at",
     "current_message_id", "messages": [{"id", "parent_id", "role", "content", "reasoning_content", "tool_calls",
     "tool_call_id", "created_at", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
     "ttft_s", "tokens_per_s", "context_truncated", "images"}, ...]}

`messages` holds every message of every branch in creation order, so a message's parent comes before it;
`current_message_id` is the last message of the branch shown. An export always writes every key (null where a
message has none); an import needs only format, version, title and each message's id, role and content.
`context_truncated` ({"dropped_messages", "dropped_turns"}: what a reply's prompt left out of a conversation longer
than the context) and `images` (a user message's pictures as data URLs, so that the file holds them) came after
version 1's first files; they are optional, so those still import.

Import makes a NEW conversation (new ids, created and updated now, so it tops the list) with the same tree,
branch shown, settings (checked as a session's: SessionSettings), model and per-message metadata (times, token
counts), in one transaction: a document that does not validate stores nothing. Validation is pydantic's, so a
400 names the field ("messages.3.parent_id: ..."): a wrong format or version, a role other than user, assistant
or tool, a parent that is not an earlier message, a size over the limits below.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvforge.app.dialects.openai.messages import ChatCompletionMessageToolCall
from kvforge.app.generate.pictures import MAX_IMAGES, data_url, picture_bytes
from kvforge.app.sessions.conversations import Conversation, Message, keep_pictures
from kvforge.app.sessions.protocol import SessionSettings
from kvforge.app.sessions.stored_text import Storable
from kvforge.core.store import Store

FORMAT = "kvforge.conversation"
VERSION = 1
MAX_MESSAGES = 10_000  # per imported conversation
# per text field: PostgreSQL's search index (a tsvector) holds at most 1 MiB of words (4 bytes per char at most)
MAX_TEXT_CHARS = 250_000
MAX_TOOL_CALLS = 128
INT32 = 2**31 - 1  # the token-count columns' range (PostgreSQL integer)

Count = Annotated[int, Field(ge=0, le=INT32)]
Seconds = Annotated[float, Field(ge=0)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), Storable]
Title = Annotated[str, Field(min_length=1, max_length=200), Storable]  # the columns' lengths
ModelName = Annotated[str, Field(max_length=200), Storable]
CallId = Annotated[str, Field(min_length=1, max_length=200), Storable]
FinishReason = Annotated[str, Field(min_length=1, max_length=16), Storable]


class LeftOut(BaseModel):
    """A reply's context_truncated: what its prompt left out (app/generate/context_fit.py Truncation)."""

    model_config = ConfigDict(extra="forbid")
    dropped_messages: Annotated[int, Field(ge=1, le=INT32)]
    dropped_turns: Annotated[int, Field(ge=1, le=INT32)]

    @model_validator(mode="after")
    def _whole_turns(self) -> LeftOut:
        if self.dropped_turns > self.dropped_messages:  # a turn is at least one message
            raise ValueError("dropped_turns: at most dropped_messages (a turn is one message or more)")
        return self


class ExportedMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    id: int  # the exporting store's: only links parent_id and current_message_id within the document
    parent_id: int | None = None  # null: a first message
    role: Literal["user", "assistant", "tool"]
    content: Text
    reasoning_content: Text | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: CallId | None = None
    created_at: Seconds | None = None  # null: the time of the import
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None
    finish_reason: FinishReason | None = None
    ttft_s: Seconds | None = None
    tokens_per_s: Seconds | None = None
    context_truncated: LeftOut | None = None
    images: list[str] | None = Field(default=None, max_length=MAX_IMAGES)  # data URLs

    @model_validator(mode="after")
    def _role_fields(self) -> ExportedMessage:
        # as the sessions API stores them: only a reply calls tools or has a prompt that left messages out, only a
        # tool message answers a call, only a user message has pictures
        for name in ("tool_calls", "context_truncated"):
            if getattr(self, name) and self.role != "assistant":
                raise ValueError(f"{name}: only on an assistant message, not on a {self.role} message")
        if self.images and self.role != "user":
            raise ValueError(f"images: only on a user message, not on a {self.role} message")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one (the call it answers), other messages have none")
        return self


class ConversationExport(BaseModel):
    """The export format (the module's docstring); the body of POST /v1/sessions/import."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    format: Literal["kvforge.conversation"]
    version: Literal[1]
    title: Title
    model: ModelName | None = None
    settings: SessionSettings = Field(default_factory=SessionSettings)
    created_at: Seconds | None = None  # the original's; the import is a new conversation, created now
    updated_at: Seconds | None = None
    messages: list[ExportedMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    current_message_id: int | None = None  # after messages: its check reads them

    @field_validator("messages")
    @classmethod
    def _a_tree(cls, messages: list[ExportedMessage]) -> list[ExportedMessage]:
        seen: set[int] = set()
        for i, message in enumerate(messages):
            if message.id in seen:
                raise ValueError(f"item {i}: id {message.id} is the id of an earlier message too")
            if message.parent_id is not None and message.parent_id not in seen:
                raise ValueError(f"item {i} (id {message.id}): parent_id {message.parent_id} is not the id of an "
                                 "earlier message")
            seen.add(message.id)
        return messages

    @field_validator("current_message_id")
    @classmethod
    def _one_of_them(cls, current: int | None, info: ValidationInfo) -> int | None:
        messages = info.data.get("messages")
        if current is not None and messages is not None and current not in {m.id for m in messages}:
            raise ValueError(f"{current} is not the id of one of the messages")
        return current


def export_conversation(conv: Conversation, pictures: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The conversation (loaded with its messages, as Conversations.get returns it) in the export format; `pictures`:
    the bytes of its messages' pictures by SHA-256 (Conversations.pictures)."""
    return {"format": FORMAT, "version": VERSION, "title": conv.title, "model": conv.model,
            "settings": conv.settings or {}, "created_at": conv.created_at, "updated_at": conv.updated_at,
            "current_message_id": conv.current_message_id,
            "messages": [exported_message(m, pictures or {}) for m in conv.nodes]}


def exported_message(m: Message, pictures: dict[str, bytes]) -> dict[str, Any]:
    images = [data_url(pictures[digest]) for digest in m.images or ()]
    return {"id": m.id, "parent_id": m.parent_id, "role": m.role, "content": m.content,
            "reasoning_content": m.reasoning, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id,
            "created_at": m.created_at, **{k: getattr(m, k) for k in Message.STATS}, "images": images or None}


def import_conversation(store: Store, export: ConversationExport) -> str:
    """Store `export` as a new conversation, in one transaction; its id."""
    now = time.time()
    with store.session() as s, s.begin():
        conv = Conversation(title=export.title, model=export.model, settings=export.settings.stored(),
                            created_at=now, updated_at=now)
        s.add(conv)
        s.flush()
        new_ids: dict[int, int] = {}
        depths: dict[int | None, int] = {None: 0}
        for m in export.messages:  # parents first (validated): each row's parent already has its new id
            images = keep_pictures(s, [picture_bytes(url, "messages.images") for url in m.images or ()])
            row = Message(conversation_id=conv.id, parent_id=new_ids.get(m.parent_id), position=depths[m.parent_id] + 1,
                          images=images or None,
                          role=m.role, content=m.content, reasoning=m.reasoning_content,
                          tool_calls=[c.model_dump() for c in m.tool_calls] if m.tool_calls else None,
                          tool_call_id=m.tool_call_id, created_at=now if m.created_at is None else m.created_at,
                          **m.model_dump(include=set(Message.STATS)))
            s.add(row)
            s.flush()  # its id, for its children
            new_ids[m.id], depths[m.id] = row.id, row.position
        conv.current_message_id = new_ids.get(export.current_message_id)
    return conv.id


def export_filename(title: str, extension: str) -> str:
    """A file name for an export: the title's words joined by dashes ("kvforge-trip-to-france.md")."""
    words = re.findall(r"[^\W_]+", title.lower())[:12]
    return f"kvforge-{'-'.join(words)[:80].strip('-') or 'conversation'}.{extension}"


def content_disposition(filename: str) -> str:
    """An attachment header: an ASCII name for every client, the UTF-8 one (RFC 6266) for those that read it."""
    ascii_name = filename if filename.isascii() else "kvforge-conversation." + filename.rsplit(".", 1)[-1]
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename)}"
