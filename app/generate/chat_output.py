"""A chat choice's generated text read back into the reply's parts (app/generate/reply.py): the thinking of a
reasoning model, the answer's text, and tool calls. One reader serves streamed and whole responses (a whole reply
is the stream's parts merged), so the two never disagree. The format the tokenizer declares
(app/generate/parsers/declared_response.py) reads a reply with tools where there is one; kvforge's per-family
readers otherwise."""

from __future__ import annotations

from dataclasses import replace

from kvforge.app.generate.chat_request import ChatPlan
from kvforge.app.generate.parsers.declared_response import REASONING_FIELDS, DeclaredResponseReader
from kvforge.app.generate.parsers.reasoning import ReasoningStream
from kvforge.app.generate.parsers.tool_calls import ToolCallStream
from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall, WholeReply
from kvforge.core.output import RequestOutput


class ChoiceReader:
    """Text deltas of one choice -> its parts, in order: the thinking is split off first, then tool calls are read
    from the answer; calls are numbered in the order they come."""

    def __init__(self, plan: ChatPlan) -> None:
        self._declared = None
        if plan.declared_template is not None:
            self._declared = DeclaredResponseReader(plan.declared_template, plan.prompt_text, plan.tools,
                                                    plan.tool_names or [])
        self._reasoning = ReasoningStream(plan.starts_in_reasoning, plan.reasoning) if plan.reasoning else None
        self._tools = (ToolCallStream(plan.tool_syntax, plan.tool_names, plan.forced_calls)
                       if plan.tool_names is not None else None)
        self.num_tool_calls = 0

    @property
    def ended(self) -> bool:
        """The reply is complete before the output ends: a forced call repeated an earlier one (what follows is not
        read; the sample should be stopped)."""
        return self._tools is not None and self._tools.ended

    @property
    def ended_in_reasoning(self) -> bool:
        """After finish(): the output never left the think block (there is no answer)."""
        if self._declared is not None:
            return self._declared.open_field in REASONING_FIELDS
        return self._reasoning is not None and self._reasoning.in_reasoning

    def feed(self, delta_text: str) -> list[Part]:
        return self._read(delta_text, final=False)

    def finish(self) -> list[Part]:
        return self._read("", final=True)

    def read(self, out: RequestOutput) -> list[Part]:
        """The parts of one of the engine's streamed outputs: its new text, and with the last (finished) one what
        was held back."""
        return self.feed(out.delta_text) + (self.finish() if out.finished else [])

    def read_all(self, text: str) -> list[Part]:
        """The parts of a finished choice's whole text, read at once."""
        return self.feed(text) + self.finish()

    def _read(self, text: str, final: bool) -> list[Part]:
        if self._declared is not None:
            parts = (self._declared.feed(text) if text else []) + (self._declared.finish() if final else [])
            return [self._numbered(p) if isinstance(p, ToolCall) else p for p in parts]
        parts: list[Part] = []
        if self._reasoning is not None:
            thinking, text = self._reasoning.finish() if final else self._reasoning.feed(text)
            if thinking:
                parts.append(Thinking(thinking))
        if self._tools is None:
            return parts + ([Text(text)] if text else [])
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        for event in events:
            if isinstance(event, ToolCall):
                parts.append(self._numbered(event))
            elif event:
                parts.append(Text(event))
        return parts

    def _numbered(self, call: ToolCall) -> ToolCall:
        self.num_tool_calls += 1
        return replace(call, index=self.num_tool_calls - 1)


def read_whole(plan: ChatPlan, text: str) -> WholeReply:
    """A finished choice's whole text, read at once."""
    reader = ChoiceReader(plan)
    parts = reader.read_all(text)
    calls = [p for p in parts if isinstance(p, ToolCall)]
    return WholeReply(thinking="".join(p.text for p in parts if isinstance(p, Thinking)),
                      content="".join(p.text for p in parts if isinstance(p, Text)), calls=calls,
                      no_answer=bool(calls) or reader.ended_in_reasoning, reasoning_model=plan.reasoning is not None)
