"""A reply read by the format its tokenizer declares: transformers' response parsing (`response_template` in
tokenizer_config.json, read by `transformers.utils.chat_parsing.ResponseParser`), used for a request whose tools
the model may call as it likes (tool_choice "auto") where the tokenizer declares one, instead of kvforge's
per-family parsers (app/generate/parsers/tool_calls.py, app/generate/parsers/reasoning.py). A forced call is not read
here: the call grammar writes
it in the syntax kvforge's parser reads.

The parser streams: text chunks of the declared content and reasoning fields go out as they come, and each tool
call when its region closes (its arguments cast to the types of the tool's schema). A call of a function that is
not among the request's tools stays in the content, as its JSON.
"""

from __future__ import annotations

import json
from typing import Any

from kvforge.app.generate.parsers.tool_calls import new_call_id
from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall

REASONING_FIELDS = ("reasoning_content", "thinking")  # the name transformers asks for, and one found on the Hub


def declared_template(tokenizer) -> dict | None:
    """The response template a (Hugging Face) tokenizer declares, if any."""
    template = getattr(tokenizer, "response_template", None)
    return template if isinstance(template, dict) else None


class DeclaredResponseReader:
    """Text deltas -> the reply's parts (Thinking, Text, ToolCall), in order."""

    def __init__(self, template: dict, prompt_text: str, tools: list[dict], tool_names: list[str]) -> None:
        from transformers.utils.chat_parsing import ResponseParser

        self._parser = ResponseParser(template, prefix=prompt_text, tools=tools)
        self._names = set(tool_names)
        self.open_field: str | None = None  # the region the reply is in (after finish: the one it ended in)

    def feed(self, text: str) -> list[Part]:
        return self._read(self._parser.feed(text))

    def finish(self) -> list[Part]:
        _, events = self._parser.finalize()
        return self._read(events)

    def _read(self, events: list[dict[str, Any]]) -> list[Part]:
        out: list[Part] = []
        for event in events:
            field = event.get("field")
            if event["type"] == "region_open":
                self.open_field = field
            elif event["type"] == "region_chunk" and not event.get("dirty") and event.get("text"):
                if field in REASONING_FIELDS:
                    out.append(Thinking(event["text"]))
                elif field == "content":
                    out.append(Text(event["text"]))
            elif event["type"] == "region_close" and field == "tool_calls":
                out.append(self._call(event["value"]))
        return out

    def _call(self, value: Any) -> ToolCall | Text:
        function = value.get("function") if isinstance(value, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in self._names:
            return Text(json.dumps(value, ensure_ascii=False))
        arguments = function.get("arguments") or {}
        if not isinstance(arguments, dict | str):  # not an object: kept as its JSON text, verbatim
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(new_call_id(), name, arguments)
