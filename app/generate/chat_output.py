"""A chat choice's generated text read back into OpenAI's message fields: the thinking of a reasoning model as
`reasoning_content`, tool calls as `tool_calls`, the rest as `content`. One reader serves streamed and whole
responses (a whole response is the stream's deltas merged), so the two never disagree. The format the
tokenizer declares (app/generate/parsers/declared_response.py) reads a reply with tools where there is one; kvforge's
per-family readers otherwise."""

from __future__ import annotations

from typing import Any

from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.parsers.declared_response import REASONING_FIELDS, DeclaredResponseReader
from kvforge.app.generate.parsers.reasoning import ReasoningStream
from kvforge.app.generate.parsers.tool_calls import ToolCall, ToolCallStream, openai_tool_call
from kvforge.core.output import RequestOutput


class ChoiceReader:
    """Text deltas of one choice -> OpenAI delta dicts ({"reasoning_content"}, {"content"}, {"tool_calls"}):
    the thinking is split off first, then tool calls are read from the answer."""

    def __init__(self, plan: ChatPlan) -> None:
        self._declared = None
        if plan.declared_template is not None:
            self._declared = DeclaredResponseReader(plan.declared_template, plan.prompt_text, plan.tools,
                                                    plan.tool_names or [])
        self._reasoning = ReasoningStream(plan.starts_in_reasoning, plan.reasoning) if plan.reasoning else None
        self._tools = ToolCallStream(plan.tool_syntax, plan.tool_names) if plan.tool_names is not None else None
        self.num_tool_calls = 0

    @property
    def ended_in_reasoning(self) -> bool:
        """After finish(): the output never left the think block (there is no answer)."""
        if self._declared is not None:
            return self._declared.open_field in REASONING_FIELDS
        return self._reasoning is not None and self._reasoning.in_reasoning

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        return self._read(delta_text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._read("", final=True)

    def read(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The deltas of one of the engine's streamed outputs: its new text, and with the last (finished) one
        what was held back."""
        return self.feed(out.delta_text) + (self.finish() if out.finished else [])

    def read_whole(self, text: str) -> list[dict[str, Any]]:
        """The deltas of a finished choice's whole text, read at once."""
        return self.feed(text) + self.finish()

    def _read(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._declared is not None:
            events = (self._declared.feed(text) if text else []) + (self._declared.finish() if final else [])
            return [self._tool_call_delta(e) if isinstance(e, ToolCall) else
                    {"reasoning_content" if e[0] == "reasoning" else "content": e[1]} for e in events]
        deltas = []
        if self._reasoning is not None:
            thinking, text = self._reasoning.finish() if final else self._reasoning.feed(text)
            if thinking:
                deltas.append({"reasoning_content": thinking})
        if self._tools is None:
            return deltas + ([{"content": text}] if text else [])
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        for event in events:
            if isinstance(event, ToolCall):
                deltas.append(self._tool_call_delta(event))
            elif event:
                deltas.append({"content": event})
        return deltas

    def _tool_call_delta(self, call: ToolCall) -> dict[str, Any]:
        self.num_tool_calls += 1
        return {"tool_calls": [openai_tool_call(call, self.num_tool_calls - 1)]}


def whole_message(plan: ChatPlan, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished choice and whether it called tools."""
    reader = ChoiceReader(plan)
    deltas = reader.read_whole(text)
    content = "".join(d.get("content", "") for d in deltas)
    thinking = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in call.items() if k != "index"} for d in deltas for call in d.get("tool_calls", [])]
    no_answer = bool(calls) or reader.ended_in_reasoning
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if no_answer else "")}
    if plan.reasoning is not None or thinking:  # a reasoning model's (null: it did not think); a declared format's
        message["reasoning_content"] = thinking or None
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)
