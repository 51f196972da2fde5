"""Anthropic's Messages API on the same server, for the coding agents and tools that speak it. A request is translated
into the canonical one (app/dialects/anthropic/protocol.py, app/generate/request.py) and runs the same way: the one
admission gate, the chat template, tools, constraints (`output_config.format`) and reasoning (`thinking`).

    POST /v1/messages               -> a message, or its server-sent events when `stream` is true
    POST /v1/messages/count_tokens  -> {"input_tokens"}: the prompt as /v1/messages would render it

A conversation longer than its context (the model's, or our extra `num_ctx`) loses its oldest whole turns
(app/generate/context_fit.py): the response says so in the X-KVForge-Dropped-Messages header and an extension field
`context_truncated` on the message (message_start's when streamed). count_tokens counts what /v1/messages would send,
as Anthropic's counts what a request would send: the tokens the model would see after that cut (for the same
`num_ctx`, and the same `max_tokens`: our extra there, the reply's room; absent, the most room any max_tokens gets),
said by the same header and field.

A reply's content is a thinking block (a reasoning model's thinking; its signature is empty: nothing here checks
one), a text block and a tool_use block per call, in that order. stop_reason: "tool_use" (it called tools),
"max_tokens", "stop_sequence" (with the stop sequence found) or "end_turn". usage in Anthropic's terms:
input_tokens are the prompt's tokens not read from the prefix cache, cache_read_input_tokens those read from it
(cache_creation_input_tokens is 0: caching is automatic and costs nothing extra).

A stream is Anthropic's events: message_start (sent with the first token, so its arrival is the TTFT), then per
block content_block_start / content_block_delta (text_delta, thinking_delta; a call's input whole in one
input_json_delta) / content_block_stop, then message_delta (stop_reason, output_tokens) and message_stop; an error
after the stream began is an `error` event. Errors before it are Anthropic's {"type": "error", "error": {...}}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response

from kvforge.app.context import ServerContext
from kvforge.app.dialects.anthropic.context_edits import apply_edits
from kvforge.app.dialects.anthropic.protocol import (
    ANTHROPIC_NAMES,
    ConversationFields,
    CountTokensRequest,
    MessagesRequest,
)
from kvforge.app.dialects.openai.protocol import ChatCompletionRequest
from kvforge.app.generate.admit import Admitted, admit, sent_prompt
from kvforge.app.generate.chat_output import read_whole
from kvforge.app.generate.context_fit import truncation_field, truncation_headers
from kvforge.app.generate.off_loop import off_loop
from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall, WholeReply
from kvforge.app.generate.request import UNBOUNDED, ChatPrompt, ContextWindow, GenerateRequest, check_prompt_chars
from kvforge.app.generate.stream import Failed, StreamResponse
from kvforge.app.http.errors import anthropic_error, renaming_route
from kvforge.core.output import RequestOutput


def stop_fields(out: RequestOutput, called_tools: bool) -> dict[str, Any]:
    if called_tools:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if out.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if out.stop_reason is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def input_usage(prompt_tokens: int, cached: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments_value}


def content_blocks(reply: WholeReply) -> list[dict[str, Any]]:
    """A whole reply as Anthropic's content blocks."""
    blocks = []
    if reply.thinking:
        blocks.append({"type": "thinking", "thinking": reply.thinking, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    return blocks + [tool_use_block(call) for call in reply.calls]


def event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class BlockStream:
    """The reply's parts -> Anthropic's content block events: a block opens where the kind of part changes
    (thinking, text, a call) and closes before the next one opens."""

    def __init__(self) -> None:
        self.index, self.open_kind = -1, None

    def add(self, part: Part) -> list[str]:
        if isinstance(part, Thinking | Text) and not part.text:
            return []
        if isinstance(part, Thinking):
            return self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + [
                self._delta({"type": "thinking_delta", "thinking": part.text})]
        if isinstance(part, Text):
            return self._open("text", {"type": "text", "text": ""}) + [
                self._delta({"type": "text_delta", "text": part.text})]
        return self._open("tool_use", tool_use_block(part) | {"input": {}}, always=True) + [
            self._delta({"type": "input_json_delta", "partial_json": part.arguments_json})]

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", index=self.index)]

    def _open(self, kind: str, block: dict[str, Any], always: bool = False) -> list[str]:
        if self.open_kind == kind and not always:
            return []
        events = self.close()
        self.index, self.open_kind = self.index + 1, kind
        return events + [event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.index, delta=delta)


def anthropic_router(context: ServerContext) -> APIRouter:
    router = APIRouter(route_class=renaming_route(ANTHROPIC_NAMES))  # errors name Anthropic's fields

    async def edited(body: ConversationFields) -> tuple[ChatCompletionRequest, dict[str, Any]]:
        """The request in OpenAI's shape, its conversation as context editing leaves it
        (app/dialects/anthropic/context_edits.py), and what the response says of the edits (nothing when the request
        asked for none). Edits that count tokens render the conversation off the event loop, under a ticket."""
        if body.context_management is None:
            messages, _ = apply_edits(body.messages, None, body.thinking_on, count=None)
            return body.chat_request(messages), {}
        ticket = await context.admission.enter(body.model)
        try:
            tokenizer = ticket.engine.tokenizer
            check_prompt_chars(ticket.engine, ChatPrompt.of(body.chat_request()).chars(), "messages")

            def count(messages: list) -> int:
                return len(ChatPrompt.of(body.chat_request(messages)).plan(tokenizer).prompt)

            messages, applied = await off_loop(apply_edits, body.messages, body.context_management,
                                               body.thinking_on, count)
        finally:
            ticket.release()
        return body.chat_request(messages), {"context_management": {"applied_edits": applied}}

    def generate_request(body: ConversationFields, request: ChatCompletionRequest) -> GenerateRequest:
        """The canonical request of /v1/messages (and what count_tokens counts): max_tokens is Anthropic's upper
        bound, cut to what the context leaves (Claude Code asks 32000 of any model); the context is the model's, or
        our extra num_ctx's."""
        window = ContextWindow(body.num_ctx, "num_ctx") if body.num_ctx else ContextWindow(UNBOUNDED, "messages")
        return GenerateRequest(prompt=ChatPrompt.of(request), sampling=request, model=body.model, window=window)

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, response: Response):
        context.admission.check_model(body.model)
        request, edits = await edited(body)
        admitted = await admit(context, generate_request(body, request))
        message_id = "msg_" + uuid.uuid4().hex[:24]
        headers = truncation_headers(admitted.truncation)
        if body.stream:
            return StreamResponse(events(admitted, message_id, edits), admitted.close, headers=headers)
        final = (await admitted.collect()).finals[0]
        reply = read_whole(admitted.plan, final.text)
        response.headers.update(headers)
        return {"id": message_id, "type": "message", "role": "assistant", "model": admitted.model,
                "content": content_blocks(reply), **stop_fields(final, bool(reply.calls)),
                "usage": input_usage(len(admitted.prompt), final.num_cached_tokens) | {
                    "output_tokens": len(final.token_ids)}, **edits, **truncation_field(admitted.truncation)}

    async def events(admitted: Admitted, message_id: str, edits: dict[str, Any]) -> AsyncIterator[str]:
        blocks = BlockStream()
        async for item in admitted.outputs():
            if isinstance(item, Failed):  # the status is sent: say it in the stream
                yield event("error", error=anthropic_error(item.status, item.message)["error"])
                return
            out = item.out
            if item.first:  # with the first token: the prompt's cache use is known, and TTFT is true
                yield event("message_start", message={
                    "id": message_id, "type": "message", "role": "assistant", "content": [],
                    "model": admitted.model, "stop_reason": None, "stop_sequence": None,
                    "usage": input_usage(len(admitted.prompt), out.num_cached_tokens) | {"output_tokens": 0},
                    **truncation_field(admitted.truncation)})
            for part in item.parts:
                for line in blocks.add(part):
                    yield line
            if out.finished:
                for line in blocks.close():
                    yield line
                yield event("message_delta", delta=stop_fields(out, item.called_tools),
                            usage={"output_tokens": len(out.token_ids)}, **edits)
                yield event("message_stop")

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, response: Response):
        context.admission.check_model(body.model)
        request, _ = await edited(body)
        ticket = await context.admission.enter(body.model)
        try:  # a conversation longer than the context: what is left of it after /v1/messages' cut
            prompt, truncation = await off_loop(sent_prompt, context, ticket.engine, generate_request(body, request))
        finally:
            ticket.release()
        response.headers.update(truncation_headers(truncation))
        return {"input_tokens": len(prompt), **truncation_field(truncation)}

    return router
