"""ChatService: one turn of a stored conversation, shared by the sessions API and the browser UI.

A turn renders the whole history with the chat template (earlier turns render byte-identically, and
replies are stored exactly as generated, so the prefix cache serves the history), queues the request,
stores the user message, then streams the reply and stores it when it ends — however it ends: a reply
cut short (stop button, disconnect) is kept with finish_reason "abort", like a chat app's.

A reasoning model's reply is stored as its answer (`content`) and its thinking (`reasoning`) and goes back to
the template with `reasoning_content`. Templates that drop past thinking (DeepSeek-R1's) then render that reply
differently from how it was generated, so the next turn's cache hit ends at that reply: the model's own design.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvforge.app.admission import Admission, Ticket
from kvforge.app.chat_request import may_skip_special_tokens, reasoning_syntax, special_token_ids
from kvforge.app.completion import RequestTimedOut, check_prompt_chars, submit, timings, usage, within
from kvforge.app.conversations import Conversation, Conversations, Message, NotFound
from kvforge.app.errors import APIError
from kvforge.app.metrics import ServerMetrics
from kvforge.app.protocol import SamplingFields
from kvforge.app.reasoning import ReasoningStream, ReasoningSyntax, split_reasoning, starts_in_reasoning
from kvforge.core.async_engine import RequestStream
from kvforge.core.output import RequestOutput
from kvforge.core.store import Store
from kvforge.core.tokenizer import Tokenizer

DEFAULT_TITLE = "New chat"


def chat_messages(conv: Conversation, new_user_message: str | None = None) -> list[dict[str, str]]:
    """What the chat template renders: the system prompt, the history, the new message. A reply's reasoning goes
    as `reasoning_content`, the name templates that render past thinking read (Qwen3's; DeepSeek-R1's drops it)."""
    system = (conv.settings or {}).get("system_prompt")
    messages = [{"role": "system", "content": system}] if system else []
    for m in conv.messages:
        messages.append({"role": m.role, "content": m.content}
                        | ({"reasoning_content": m.reasoning} if m.reasoning is not None else {}))
    if new_user_message is not None:
        messages.append({"role": "user", "content": new_user_message})
    return messages


def reply_stats(out: RequestOutput, prompt_tokens: int) -> dict:
    m = out.metrics or {}
    tpot = m.get("tpot")
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
            "cached_tokens": out.num_cached_tokens, "finish_reason": out.finish_reason,
            "ttft_s": m.get("ttft"), "tokens_per_s": (1 / tpot) if tpot else None}


def title_from(content: str, limit: int = 60) -> str:
    """A new conversation is named after its first message."""
    line = " ".join(content.split())
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "…"


def not_found(exc: NotFound, suffix: str = "") -> APIError:
    return APIError(404, f"{exc}{suffix}", "session_id", "not_found_error", "session_not_found")


@dataclass(frozen=True)
class ReplyReading:
    """How a reply's text splits into reasoning and content (app/reasoning.py): `syntax` None for a model that
    does not reason; `starts_inside` when the prompt opened the think block."""
    syntax: ReasoningSyntax | None = None
    starts_inside: bool = False

    def stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.starts_inside, self.syntax) if self.syntax is not None else None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; content "" when it ended inside the think block."""
        if self.syntax is None:
            return None, text
        reasoning, content = split_reasoning(text, self.starts_inside, self.syntax)
        return reasoning, content or ""


@dataclass
class Turn:
    """A queued reply: `user` is the stored user message; iterate `events()` exactly once (or call
    `abort()`): {"type": "delta", "content"} (or, for a reasoning model's thinking, {"type": "delta",
    "reasoning_content"})..., then {"type": "done", "message", "usage", ...}."""
    service: ChatService
    session_id: str
    user: Message
    prompt_tokens: int
    stream: RequestStream
    ticket: Ticket
    reading: ReplyReading = ReplyReading()

    def abort(self) -> None:
        """Stop the reply and give back its admission; safe to call more than once."""
        self.ticket.release()
        self.stream.abort()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Raises RequestTimedOut (after keeping the partial reply, finish_reason "timeout") when the
        reply runs past the server's request timeout."""
        conversations, last, final, ended = self.service.conversations, None, None, "abort"
        reader = self.reading.stream()
        try:
            async for out in within(self.stream, self.service.request_timeout_s):
                last = out
                if out.delta_text:
                    for event in _delta_events(reader, out.delta_text, final=False):
                        yield event
                if out.finished:
                    final = out
                    self.service.metrics.observe_finished(out)
                    for event in _delta_events(reader, "", final=True):
                        yield event
        except RequestTimedOut:
            ended = "timeout"
            raise
        finally:
            self.abort()  # no-op once finished; frees the KV blocks if the client went away
            if final is None and last is not None and last.text:  # cut short: keep what was generated
                reasoning, content = self.reading.split(last.text)
                try:
                    conversations.add_message(self.session_id, "assistant", content, reasoning, finish_reason=ended,
                                      prompt_tokens=self.prompt_tokens, completion_tokens=len(last.token_ids),
                                      cached_tokens=last.num_cached_tokens)
                except NotFound:
                    pass  # the conversation was deleted meanwhile
        if final.finish_reason == "abort" and not final.text:
            return  # stopped before any text: nothing to keep
        reasoning, content = self.reading.split(final.text)
        try:
            message = await run_in_threadpool(conversations.add_message, self.session_id, "assistant", content,
                                              reasoning, **reply_stats(final, self.prompt_tokens))
        except NotFound as exc:
            raise not_found(exc, " (deleted during the reply)") from None
        yield {"type": "done", "message": message.to_dict(), "usage": usage([final], self.prompt_tokens),
               "timings": timings(final), "token_ids": final.token_ids}


def _delta_events(reader: ReasoningStream | None, text: str, final: bool) -> list[dict[str, str]]:
    if reader is None:
        return [{"type": "delta", "content": text}] if text else []
    reasoning, content = reader.finish() if final else reader.feed(text)
    return ([{"type": "delta", "reasoning_content": reasoning}] if reasoning else []) + (
        [{"type": "delta", "content": content}] if content else [])


class ChatService:
    def __init__(self, admission: Admission, store: Store, metrics: ServerMetrics, default_max_tokens: int,
                 request_timeout_s: float | None = None) -> None:
        """`store`: the database the server's owner opened (and closes); conversations are kept in it."""
        self.admission, self.host, self.metrics = admission, admission.host, metrics
        self.conversations = Conversations(store)
        self.default_max_tokens, self.request_timeout_s = default_max_tokens, request_timeout_s

    def get(self, session_id: str) -> Conversation:
        try:
            return self.conversations.get(session_id)
        except NotFound as exc:
            raise not_found(exc) from None

    async def start_turn(self, session_id: str, content: str, overrides: dict[str, Any] | None = None) -> Turn:
        """Validate and queue the reply to `content`, then store `content`; APIError (nothing stored)
        for an unknown session, bad sampling fields, or a conversation too long for the model."""
        self.admission.check_open()  # a full server refuses before reading the conversation
        conv = await run_in_threadpool(self.get, session_id)
        fields = SamplingFields.model_validate({**(conv.settings or {}).get("sampling", {}), **(overrides or {})})
        ticket = await self.admission.enter()
        try:
            engine = ticket.engine
            messages = chat_messages(conv, content)
            check_prompt_chars(engine, sum(len(m["content"]) for m in messages), "content")
            try:
                prompt, reading, skip_special = await run_in_threadpool(_render, engine.tokenizer, messages)
            except Exception as exc:  # a template that rejects this conversation (e.g. role order)
                raise APIError(400, f"content: {exc}", "content") from None
            stream, _ = submit(engine, prompt, fields, self.default_max_tokens, None, "content",
                               skip_special_tokens=skip_special)
        except BaseException:
            ticket.release()
            raise
        try:
            user = await run_in_threadpool(self.conversations.add_message, session_id, "user", content,
                                           prompt_tokens=len(prompt))
            if conv.title == DEFAULT_TITLE and not conv.messages:
                await run_in_threadpool(self.conversations.update, session_id, title=title_from(content))
        except BaseException as exc:
            ticket.release()
            stream.abort()
            if isinstance(exc, NotFound):  # deleted meanwhile
                raise not_found(exc) from None
            raise
        return Turn(self, session_id, user, len(prompt), stream, ticket, reading)


def _render(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], ReplyReading, bool]:
    """The prompt's tokens, how its reply reads, and whether decoding may drop special tokens (not when a think
    marker is one: the reader must see it)."""
    text = tokenizer.chat_text(messages)
    syntax = reasoning_syntax(tokenizer)
    reading = ReplyReading(syntax, syntax is not None and starts_in_reasoning(text, syntax))
    markers = [syntax.start, syntax.end] if syntax is not None else []
    skip_special = may_skip_special_tokens(special_token_ids(tokenizer) if markers else {}, markers)
    return tokenizer.encode(text, add_special_tokens=False), reading, skip_special
