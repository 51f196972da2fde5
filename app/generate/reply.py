"""A reply as the output reader (app/generate/chat_output.py) reads it, in no API's shape: the parts of a choice's
text in order (Thinking, Text, ToolCall) and a finished choice's whole reply. Each dialect writes these in its own
wire format (OpenAI's deltas and messages: app/dialects/openai/format.py; Anthropic's content blocks; Ollama's
messages; the Responses API's output items; a session's stored message), so no dialect re-reads another's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Thinking:
    """Text of a reasoning model's think block."""

    text: str


@dataclass(frozen=True)
class Text:
    """Text of the answer."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One call of a requested tool. `arguments`: the object the model wrote; a string only where the tokenizer's
    declared format hands one over verbatim."""

    id: str
    name: str
    arguments: dict[str, Any] | str
    index: int = 0  # its place among its choice's calls (the reader numbers them)

    @property
    def arguments_json(self) -> str:
        """The arguments as JSON text (OpenAI's `function.arguments`)."""
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)

    @property
    def arguments_value(self) -> Any:
        """The arguments as a value (Ollama's `arguments`, Anthropic's `input`): a verbatim string is read as JSON
        where it is JSON, else kept as it is."""
        if not isinstance(self.arguments, str):
            return self.arguments
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


Part = Thinking | Text | ToolCall


@dataclass(frozen=True)
class WholeReply:
    """A finished choice's reply, read at once."""

    thinking: str
    content: str
    calls: list[ToolCall]
    # no answer: it only called tools, or never left its think block (OpenAI's content is then null)
    no_answer: bool
    reasoning_model: bool  # the model reasons (OpenAI's reasoning_content is present, null when it did not think)
