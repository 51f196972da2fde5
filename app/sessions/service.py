"""ChatService: one turn of a stored conversation, shared by the sessions API and the browser UI.

A turn renders the whole history with the chat template (earlier turns render byte-identically, and
replies are stored exactly as generated, so the prefix cache serves the history), queues the request,
stores the posted message, then streams the reply and stores it when it ends — however it ends: a reply
cut short (stop button, disconnect) is kept with finish_reason "abort", like a chat app's.

A turn is planned as a chat-completions request is (app/generate/chat_request.py): the conversation's tools
(its settings) go to the template or the default tools prompt, a forced tool_choice through the call
grammar, and the reply is read by the same reader (app/generate/chat_output.py) into content, reasoning and tool
calls. A reply that calls tools is stored with its calls (finish_reason "tool_calls"); the client runs
them and posts each result as a `tool` message naming its call; the result that answers the reply's
last open call starts the next reply.

A reasoning model's reply is stored as its answer (`content`) and its thinking (`reasoning`) and goes back to
the template with `reasoning_content`. Templates that drop past thinking (DeepSeek-R1's) then render that reply
differently from how it was generated, so the next turn's cache hit ends at that reply: the model's own design.
So do tool calls on a template without tool syntax: they go back as `<tool_call>` blocks of their parsed JSON.

A user message that no reply followed (the server was killed mid-reply, or the reply was stopped before its first
token: nothing was kept) is merged with the user message after it into one user turn, their texts joined by a blank
line, as LangChain's merge_message_runs and LlamaIndex's Gemini adapter turn a run of one role into one message:
templates that require user and assistant turns to alternate (Gemma's, Mistral's) then render the conversation, and
the model reads both messages as the one request they are. Both stay stored as they were posted; a placeholder reply
instead would put words in the model's mouth.

A conversation longer than the context loses its oldest whole turns from the prompt, not from the store
(app/generate/context_fit.py): the first turn kept stays put for the turns after, so they still hit the prefix cache;
the reply's done event says what was left out (`context_truncated`), and the UI shows it.

Branches (app/sessions/conversations.py keeps a tree): a turn may follow any stored message (`parent_id`), which renders
the branch down to it, stores the posted message beside that message's other children and the reply under the
posted message, named explicitly (another tab may show another branch by then). `regenerate` answers a stored
message again: its branch is rendered unchanged, so a new reply costs only its own tokens, and so does going
back to an earlier branch: its prompt is the one it had, still in the prefix cache (memory or persisted tier).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.format import delta, finish_reason, timings, tool_call, usage
from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.protocol import SamplingFields
from kvforge.app.dialects.openai.tools import ToolFields
from kvforge.app.generate.admit import Admitted, admit
from kvforge.app.generate.chat_output import read_whole
from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.context_fit import Truncation, truncation_field
from kvforge.app.generate.pictures import data_url, picture_bytes, with_pictures
from kvforge.app.generate.request import ChatPrompt, ContextWindow, GenerateRequest
from kvforge.app.generate.stream import Failed, RequestTimedOut
from kvforge.app.http.errors import APIError
from kvforge.app.sessions.conversations import (
    CURRENT,
    Conversation,
    Conversations,
    Leaf,
    Message,
    MessageNotFound,
    NotFound,
    shown_pictures,
)
from kvforge.core.output import RequestOutput
from kvforge.core.store import Store

DEFAULT_TITLE = "New chat"


def chat_messages(conv: Conversation, history: list[Message], posted: dict[str, Any] | None = None,
                  pictures: dict[str, bytes] | None = None) -> list[ChatMessage]:
    """What the chat template renders: the system prompt, the history (a branch of the conversation, root first),
    the posted message (OpenAI's message shape: a reply's reasoning as `reasoning_content`, the name templates that
    render past thinking read, its calls as `tool_calls`; a tool result with its `tool_call_id`; a user message's
    pictures, from `pictures` by SHA-256, as image parts before its text)."""
    system = (conv.settings or {}).get("system_prompt")
    messages = [{"role": "system", "content": system}] if system else []
    for m in history:
        message = {k: v for k, v in m.to_dict().items() if k in TEMPLATE_FIELDS}
        if m.images:
            message["content"] = with_pictures(m.content, [data_url((pictures or {})[digest]) for digest in m.images])
        messages.append(message)
    if posted is not None:
        messages.append(posted)
    return [ChatMessage.model_validate(m) for m in merge_unanswered(messages)]


def merge_unanswered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user messages (the earlier ones unanswered) as one, their texts joined by a blank line (their
    parts in order, where one has pictures)."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and message["role"] == "user" and merged[-1]["role"] == "user":
            before, after = merged[-1]["content"], message["content"]
            if isinstance(before, str) and isinstance(after, str):
                content: Any = f"{before}\n\n{after}"
            else:
                content = as_parts(before) + [{"type": "text", "text": "\n\n"}] + as_parts(after)
            merged[-1] = {**merged[-1], "content": content}
        else:
            merged.append(message)
    return merged


def as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


TEMPLATE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id")


def tool_settings(conv: Conversation, tool_choice: str | dict | None = None) -> ToolFields:
    """The conversation's tools, tool_choice (or this reply's) and parallel_tool_calls (none set: no tools);
    APIError 400 naming tool_choice for one its tools do not allow."""
    settings = {k: v for k, v in (conv.settings or {}).items() if k in ToolFields.model_fields}
    if tool_choice is not None:
        settings["tool_choice"] = tool_choice
    try:
        return ToolFields.model_validate(settings)
    except ValidationError as exc:  # only the override can be wrong: the stored settings were checked
        raise APIError(400, f"tool_choice: {exc.errors()[0]['msg'].removeprefix('Value error, ')}",
                       "tool_choice") from None


def open_tool_calls(history: list[Message]) -> list[str]:
    """The ids of the history's last reply's tool calls that no tool message after it answers (none: nothing is
    open)."""
    answered: set[str] = set()
    for message in reversed(history):
        if message.role == "tool":
            answered.add(message.tool_call_id)
        elif message.role == "assistant":
            return [call["id"] for call in message.tool_calls or () if call["id"] not in answered]
        else:
            return []
    return []


def reply_stats(out: RequestOutput, prompt_tokens: int, called_tools: bool = False,
                truncation: Truncation | None = None) -> dict:
    """A finished reply's figures as stored (Message.STATS), with what its prompt left out (None: nothing)."""
    m = out.metrics or {}
    tpot = m.get("tpot")
    reason = finish_reason(out, called_tools) if out.finish_reason in ("stop", "length") else out.finish_reason
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
            "cached_tokens": out.num_cached_tokens, "finish_reason": reason,
            "ttft_s": m.get("ttft"), "tokens_per_s": (1 / tpot) if tpot else None, **truncation_field(truncation)}


def title_from(content: str, limit: int = 60) -> str:
    """A new conversation is named after its first message."""
    line = " ".join(content.split())
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "…"


def not_found(exc: NotFound, suffix: str = "") -> APIError:
    return APIError(404, f"{exc}{suffix}", "session_id", "not_found_error", "session_not_found")


def stored_reply(plan: ChatPlan, text: str) -> tuple[dict[str, Any], bool]:
    """A reply's text as stored: its content ("" when it only called tools), reasoning and tool calls (OpenAI's
    shape), and whether it called any."""
    reply = read_whole(plan, text)
    return {"content": reply.content, "reasoning": reply.thinking or None,
            "tool_calls": [tool_call(call) for call in reply.calls] or None}, bool(reply.calls)


@dataclass
class AwaitingResults:
    """A tool result stored while other calls of the same reply still wait for theirs: no reply yet."""
    posted: Message
    open_calls: list[str]  # the ids of the calls still unanswered


@dataclass
class Turn:
    """A queued reply: `posted` is the stored message it answers (the user's, or the last tool result; the reply is
    stored under it, whichever branch is shown by then); iterate
    `events()` exactly once (or call `abort()`): {"type": "delta", "content" | "reasoning_content" |
    "tool_calls"}... (OpenAI's delta fields), then {"type": "done", "message", "usage", ...} (with
    `context_truncated` where older messages were left out of the prompt)."""
    service: ChatService
    session_id: str
    posted: Message
    admitted: Admitted

    @property
    def prompt_tokens(self) -> int:
        return len(self.admitted.prompt)

    @property
    def plan(self) -> ChatPlan:
        return self.admitted.plan

    @property
    def truncation(self) -> Truncation | None:
        """What a conversation longer than the context left out of this reply's prompt (None: nothing)."""
        return self.admitted.truncation

    def abort(self) -> None:
        """Stop the reply and give back its admission; safe to call more than once."""
        self.admitted.close()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Raises RequestTimedOut (after keeping the partial reply, finish_reason "timeout") when the
        reply runs past the server's request timeout."""
        conversations, last, final, ended = self.service.conversations, None, None, "abort"
        try:
            async for item in self.admitted.outputs():
                if isinstance(item, Failed):
                    ended = "timeout" if isinstance(item.error, RequestTimedOut) else ended
                    raise item.error
                last = item.out
                if last.finished:
                    final = last
                for part in item.parts:
                    yield {"type": "delta", **delta(part)}
        finally:
            self.abort()  # no-op once finished; frees the KV blocks if the client went away
            if final is None and last is not None and last.text:  # cut short: keep what was generated
                reply, _ = stored_reply(self.plan, last.text)
                try:
                    conversations.add_message(self.session_id, "assistant", **reply, parent_id=self.posted.id,
                                              finish_reason=ended, prompt_tokens=self.prompt_tokens,
                                              completion_tokens=len(last.token_ids),
                                              cached_tokens=last.num_cached_tokens,
                                              **truncation_field(self.truncation))
                except NotFound:
                    pass  # the conversation was deleted meanwhile
        if final.finish_reason == "abort" and not final.text:
            return  # stopped before any text: nothing to keep
        reply, called = stored_reply(self.plan, final.text)
        try:
            message = await run_in_threadpool(conversations.add_message, self.session_id, "assistant", **reply,
                                              parent_id=self.posted.id,
                                              **reply_stats(final, self.prompt_tokens, called, self.truncation))
        except NotFound as exc:
            raise not_found(exc, " (deleted during the reply)") from None
        yield {"type": "done", "message": message.to_dict(), "usage": usage([final], self.prompt_tokens),
               "timings": timings(final), "token_ids": final.token_ids, **truncation_field(self.truncation)}


class ChatService:
    def __init__(self, context: ServerContext, store: Store) -> None:
        """`store`: the database the server's owner opened (and closes); conversations are kept in it."""
        self.context, self.admission = context, context.admission
        self.conversations = Conversations(store)

    def get(self, session_id: str) -> Conversation:
        try:
            return self.conversations.get(session_id)
        except NotFound as exc:
            raise not_found(exc) from None

    async def start_turn(self, session_id: str, content: str, overrides: dict[str, Any] | None = None,
                         tool_call_id: str | None = None, tool_choice: str | dict | None = None,
                         parent_id: int | None | Leaf = CURRENT, num_ctx: int | None = None,
                         images: list[str] | None = None) -> Turn | AwaitingResults:
        """Validate and queue the reply to `content` (a user message; with `tool_call_id`, a tool's result),
        then store `content`; APIError (nothing stored) for an unknown session, bad sampling fields, a tool
        result for no open call, or a conversation too long for the model. A tool result while other calls of
        the reply are still open is stored without a reply (AwaitingResults).

        `parent_id`: the message `content` follows, on any branch (None: none, a new first message; by default
        the last message of the branch shown). The history rendered is the branch down to it, `content` is
        stored under it (a sibling of its other children: an edit that keeps the old branch), and the reply under
        `content`; both become the branch shown. APIError 400 naming parent_id for a message not in this
        conversation, or a user message under a user message.

        `num_ctx`: this reply's context window, instead of the conversation's (its settings' num_ctx; neither: the
        model's); a history longer than it loses its oldest whole turns from the prompt.

        `images`: the user message's pictures (data URLs; a vision model's), kept with it once the reply is queued
        and rendered before its text in this and every later turn."""
        self.admission.check_open()  # a full server refuses before reading the conversation
        conv = await run_in_threadpool(self.get, session_id)
        tools = tool_settings(conv, tool_choice)
        if parent_id is CURRENT:
            history = conv.messages
        else:
            history = branch_to(conv, parent_id, "parent_id")
            if tool_call_id is None and history and history[-1].role == "user":
                raise APIError(400, f"parent_id: message {parent_id} is a user message; a user message follows a "
                               "reply (an assistant or tool message), or is a first message (null)", "parent_id")
        parent = history[-1].id if history else None
        pictures = [picture_bytes(url, "images", self.context.picture_hosts) for url in images or ()]
        posted = {"role": "user", "content": with_pictures(content, [data_url(data) for data in pictures])}
        if tool_call_id is not None:
            open_calls = open_tool_calls(history)
            if tool_call_id not in open_calls:
                raise APIError(400, f"tool_call_id: {tool_call_id!r} is not an open call of the last reply (open: "
                               f"{', '.join(open_calls) or 'none'})", "tool_call_id")
            posted = {"role": "tool", "content": content, "tool_call_id": tool_call_id}
            if len(open_calls) > 1:
                message = await self._store(session_id, conv, posted, parent)
                return AwaitingResults(message, [c for c in open_calls if c != tool_call_id])
        shown = await run_in_threadpool(self.conversations.pictures, shown_pictures(history))
        admitted = await self._admit(conv, chat_messages(conv, history, posted, shown), overrides, tools, "content",
                                     num_ctx)
        try:
            digests = await run_in_threadpool(self.conversations.add_pictures, pictures) if pictures else None
            message = await self._store(session_id, conv, {**posted, "content": content}, parent,
                                        prompt_tokens=len(admitted.prompt), images=digests)
        except BaseException:
            admitted.close()
            raise
        return Turn(self, session_id, message, admitted)

    async def regenerate(self, session_id: str, message_id: int, overrides: dict[str, Any] | None = None,
                         tool_choice: str | dict | None = None, num_ctx: int | None = None) -> Turn:
        """Queue another reply to a stored user (or tool) message, or, given a reply, to the message it answers:
        the history rendered is the branch down to that message, nothing new is posted, and the reply is stored
        under it beside the earlier replies (and shown). APIError: 404 naming message_id for a message not in
        this conversation, 400 for one that cannot be answered again (a tool result while other calls of its reply
        are open), and those of start_turn."""
        self.admission.check_open()
        conv = await run_in_threadpool(self.get, session_id)
        tools = tool_settings(conv, tool_choice)
        try:
            answered = conv.node(message_id)
        except MessageNotFound as exc:
            raise APIError(404, str(exc), "message_id", "not_found_error", "message_not_found") from None
        if answered.role == "assistant" and answered.parent_id is not None:
            answered = conv.node(answered.parent_id)  # redo this reply: answer its message again
        if answered.role not in ("user", "tool"):
            raise APIError(400, f"message_id: message {message_id} answers no user or tool message", "message_id")
        history = conv.path(answered.id)
        if answered.role == "tool" and open_tool_calls(history):
            raise APIError(400, f"message_id: tool result {answered.id} leaves calls of its reply open "
                           f"({', '.join(open_tool_calls(history))}): it was not answered", "message_id")
        shown = await run_in_threadpool(self.conversations.pictures, shown_pictures(history))
        admitted = await self._admit(conv, chat_messages(conv, history, pictures=shown), overrides, tools,
                                     "message_id", num_ctx)
        return Turn(self, session_id, answered, admitted)

    async def _admit(self, conv: Conversation, messages: list[ChatMessage], overrides: dict[str, Any] | None,
                     tools: ToolFields, field: str, num_ctx: int | None = None) -> Admitted:
        """Check the sampling fields (the conversation's, then this reply's), render and queue the reply; `field`:
        the request field a prompt the template rejects (or too long) is blamed on; the context window is
        `num_ctx`, else the conversation's num_ctx, else the model's (as Ollama's num_ctx: the prompt fitted to it,
        the reply ending where it does, a newest turn that cannot fit a 400 naming num_ctx)."""
        fields = SamplingFields.model_validate({**(conv.settings or {}).get("sampling", {}), **(overrides or {})})
        num_ctx = num_ctx or (conv.settings or {}).get("num_ctx")
        return await admit(self.context, GenerateRequest(prompt=ChatPrompt(messages=messages, tools=tools, field=field),
                                                         sampling=fields,
                                                         window=ContextWindow(num_ctx, "num_ctx") if num_ctx else None))

    async def _store(self, session_id: str, conv: Conversation, posted: dict[str, Any], parent_id: int | None,
                     **stats: Any) -> Message:
        """Store the posted message under `parent_id` (a conversation's first message also names it)."""
        try:
            message = await run_in_threadpool(self.conversations.add_message, session_id, posted["role"],
                                              posted["content"], tool_call_id=posted.get("tool_call_id"),
                                              parent_id=parent_id, **stats)
            if conv.title == DEFAULT_TITLE and not conv.nodes and posted["role"] == "user":
                await run_in_threadpool(self.conversations.update, session_id, title=title_from(posted["content"]))
        except NotFound as exc:  # deleted meanwhile
            raise not_found(exc) from None
        return message


def branch_to(conv: Conversation, message_id: int | None, field: str) -> list[Message]:
    """The branch from a root down to `message_id`; APIError 400 naming `field` for a message not in `conv`."""
    try:
        return conv.path(message_id)
    except MessageNotFound as exc:
        raise APIError(400, f"{field}: {exc}", field) from None
