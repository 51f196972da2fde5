"""OpenAI's Responses API on the same server (`POST /v1/responses`), which OpenAI's SDK pushes for new code. A request
is translated into the canonical one (app/dialects/openai/responses_protocol.py, app/generate/request.py) and runs
the same way: the one admission gate, the chat template, tools, constraints (`text.format`) and reasoning.

The response's `output` items, in order: a `reasoning` item (a reasoning model's thinking, as `reasoning_text`
content), a `message` (its `output_text`), one `function_call` per call. `status` is "completed", or "incomplete"
with `incomplete_details.reason` "max_output_tokens"; `usage` counts `input_tokens_details.cached_tokens` (prefix
cache hits). Nothing is stored (`store` is false). Streamed: OpenAI's events with sequence numbers
(response.created / in_progress, output_item.added, content_part.added, output_text.delta, reasoning_text.delta,
function_call_arguments.delta / done (a call's arguments whole in one delta), the .done events, then
response.completed or response.incomplete), which the SDK's `responses.stream()` reassembles; an error after the
stream began is an `error` event. Whole and streamed responses are built by the same OutputItems, so they agree.
`truncation: "auto"` cuts an input too long for the context (the model's, or our extra `num_ctx`) by its oldest whole
turns (app/generate/context_fit.py), said by the X-KVForge-Dropped-Messages header and the response's extension field
`context_truncated`; "disabled" (OpenAI's default) refuses it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.responses_protocol import RESPONSES_NAMES, ResponsesRequest
from kvforge.app.generate.admit import Admitted, admit
from kvforge.app.generate.chat_output import ChoiceReader
from kvforge.app.generate.context_fit import truncation_field, truncation_headers
from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall
from kvforge.app.generate.request import ChatPrompt, ContextWindow, GenerateRequest
from kvforge.app.generate.stream import Failed, StreamResponse
from kvforge.app.http.errors import renaming_route
from kvforge.core.output import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputItems:
    """The reply's parts (ChoiceReader's) -> the Responses output items and the stream events that build them: an
    item opens where the kind of part changes (reasoning, text, a call) and is done before the next."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item still receiving text

    def add(self, part: Part) -> list[dict[str, Any]]:
        events = []
        if isinstance(part, Thinking) and part.text:
            events += self._open("reasoning", {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                               "content": [{"type": "reasoning_text", "text": ""}],
                                               "status": "in_progress"})
            events.append(self._text_delta("response.reasoning_text.delta", part.text))
        if isinstance(part, Text) and part.text:
            if self._open_kind() != "message":
                events += self._open("message", {"type": "message", "id": new_id("msg"), "status": "in_progress",
                                                 "role": "assistant", "content": []})
                self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                events.append(self._event("response.content_part.added", content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            events.append(self._text_delta("response.output_text.delta", part.text))
        if isinstance(part, ToolCall):
            events += self.close("completed")
            item = {"type": "function_call", "id": new_id("fc"), "call_id": part.id, "name": part.name,
                    "arguments": "", "status": "in_progress"}
            events += self._open("function_call", item)
            arguments = part.arguments_json
            item["arguments"] = arguments
            events.append(self._event("response.function_call_arguments.delta", delta=arguments))
            events.append(self._event("response.function_call_arguments.done", arguments=arguments,
                                      name=item["name"]))
            events += self.close("completed")
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The open item done, with `status` ("completed", or "incomplete" where the output was cut)."""
        item, self.open = self.open, None
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item, content_index=0, text=part["text"],
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", item, content_index=0, part=part))
        elif item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", item, content_index=0,
                                      text=item["content"][0]["text"]))
        item["status"] = status
        return events + [self._event("response.output_item.done", item, item=item)]

    def _open_kind(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _open(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        if self._open_kind() == kind:
            return []
        events = self.close("completed")
        self.items.append(item)
        self.open = item
        return events + [self._event("response.output_item.added", item=dict(item))]

    def _text_delta(self, kind: str, text: str) -> dict[str, Any]:
        self.open["content"][0]["text"] += text
        return self._event(kind, content_index=0, delta=text, **({"logprobs": []} if "output_text" in kind else {}))

    def _event(self, kind: str, of: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """An event about item `of` (default: the open one)."""
        of = of or self.open
        at = {"output_index": self.items.index(of)}
        if "item" not in fields:
            at["item_id"] = of["id"]
        return {"type": kind, **at, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}}


def responses_router(context: ServerContext) -> APIRouter:
    router = APIRouter(route_class=renaming_route(RESPONSES_NAMES))  # errors name the Responses fields

    def envelope(body: ResponsesRequest, admitted: Admitted, response_id: str, created: float, status: str,
                 output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        """The response object around its output: the request's settings echoed, as OpenAI's does."""
        prompt_tokens = len(admitted.prompt)
        request_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and \
            body.text.format else {"type": "text"}
        usage = None
        if out is not None:
            cached, generated = out.num_cached_tokens, len(out.token_ids)
            usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt_tokens + generated}
        choice = body.tool_choice
        return {"id": response_id, "object": "response", "created_at": created, "status": status,
                "completed_at": time.time() if status != "in_progress" else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": admitted.model,
                "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature, "top_p": body.top_p,
                "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "text": {"format": request_format}, "truncation": body.truncation or "disabled", "store": False,
                "metadata": body.metadata or {}, "usage": usage, **truncation_field(admitted.truncation)}

    def status_of(out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, response: Response):
        context.admission.check_model(body.model)
        request = body.chat_request()
        window = ContextWindow(body.num_ctx, "num_ctx") if body.num_ctx else None
        admitted = await admit(context, GenerateRequest(prompt=ChatPrompt.of(request, field="input"),
                                                        sampling=request, model=body.model, window=window,
                                                        truncate=body.truncation == "auto"))
        response_id, created = new_id("resp"), time.time()
        headers = truncation_headers(admitted.truncation)
        if body.stream:
            return StreamResponse(events(body, admitted, response_id, created), admitted.close, headers=headers)
        response.headers.update(headers)
        out = (await admitted.collect()).finals[0]
        reader, items = ChoiceReader(admitted.plan), OutputItems()
        for part in reader.read_all(out.text):
            items.add(part)
        items.close(status_of(out))
        return envelope(body, admitted, response_id, created, status_of(out), items.items, out)

    async def events(body: ResponsesRequest, admitted: Admitted, response_id: str,
                     created: float) -> AsyncIterator[str]:
        number = 0

        def sse(event: dict[str, Any]) -> str:
            nonlocal number
            line = f"event: {event['type']}\ndata: {json.dumps(event | {'sequence_number': number})}\n\n"
            number += 1
            return line

        started = envelope(body, admitted, response_id, created, "in_progress", [], None)
        yield sse({"type": "response.created", "response": started})
        yield sse({"type": "response.in_progress", "response": started})
        items = OutputItems()
        async for item in admitted.outputs():
            if isinstance(item, Failed):  # the status is sent: say it in the stream
                yield sse({"type": "error", "code": item.code, "message": item.message, "param": None})
                return
            for part in item.parts:
                for event in items.add(part):
                    yield sse(event)
            if item.out.finished:
                out = item.out
                for event in items.close(status_of(out)):
                    yield sse(event)
                done = envelope(body, admitted, response_id, created, status_of(out), items.items, out)
                yield sse({"type": f"response.{status_of(out)}", "response": done})

    return router
