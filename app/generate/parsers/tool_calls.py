"""OpenAI tool calling as text: which wire format a model family writes its calls in, the grammar that forces a
call (tool_choice "required" or a named function), and the parsers that turn the model's text back into tool
calls (app/generate/reply.py), whole or streamed.

Families (detected from the chat template's source):
- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call;
- llama3 (Llama 3.1-3.3): a bare `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`, `;` between;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; mistral-args (templates with `[ARGS]`, Mistral
  Small 3.2 and later): `[TOOL_CALLS]name[ARGS]{...}` a call. Either Mistral form is parsed for both;
- default (a template without tool syntax, e.g. the embedded SmolLM2's ChatML): the hermes wire format, with the
  tools described by `tools_system_prompt` and the history rewritten by `render_history_for_default`.

Text the parsers cannot read as a call of a known tool (bad JSON, an unknown name) stays in the content verbatim:
a call is never dropped and parsing never raises.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from kvforge.app.generate.parsers.stream_text import partial_marker_length
from kvforge.app.generate.reply import ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes tool calls. `wire` is the format of its output ("hermes", "llama3", "mistral" or
    "mistral-args"); `template_supports_tools` says whether its chat template renders `tools=` and tool messages
    (False for "default": the server describes the tools in a system prompt and rewrites the history)."""

    name: str
    wire: str
    template_supports_tools: bool

    @property
    def call_open(self) -> str | None:
        """The marker that starts a call, None for llama3's bare JSON."""
        return {"hermes": HERMES_OPEN, "mistral": MISTRAL_MARKER, "mistral-args": MISTRAL_MARKER}.get(self.wire)

    @property
    def call_close(self) -> str | None:
        """The marker that ends a call; None where a call runs to the next call marker or the end of the output."""
        return HERMES_CLOSE if self.wire == "hermes" else None

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.wire == "llama3" else "arguments"


HERMES = ToolSyntax("hermes", "hermes", True)
LLAMA3 = ToolSyntax("llama3", "llama3", True)
MISTRAL = ToolSyntax("mistral", "mistral", True)
MISTRAL_ARGS_FORM = ToolSyntax("mistral-args", "mistral-args", True)
DEFAULT = ToolSyntax("default", "hermes", False)


def detect_tool_syntax(chat_template: str | None) -> ToolSyntax:
    """The tool-call family of a chat template, from the markers its source mentions."""
    template = chat_template or ""
    if MISTRAL_MARKER in template:
        return MISTRAL_ARGS_FORM if MISTRAL_ARGS in template else MISTRAL
    if HERMES_OPEN in template:
        return HERMES
    if PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3
    return DEFAULT


def tool_names(tools: list[dict]) -> list[str]:
    """The function names of an OpenAI `tools` list."""
    return [tool["function"]["name"] for tool in tools]


def tool_parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into its content (None when empty and there are calls) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


# ---- prompts and history for templates without tool syntax ----


def json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    return value if isinstance(value, dict) else None


# ---- the grammar that forces a call ----


# ---- parsing ----


def _tool_call_from(value, names: set[str]) -> ToolCall | None:
    """A call from a decoded JSON value, or None when it is not a call of a known tool. The arguments may sit
    under "arguments" or "parameters" (families mix them up); a missing one is an empty object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], arguments)


def _parse_segment(syntax: ToolSyntax, body: str, names: set[str]) -> tuple[list[ToolCall], str] | None:
    """The calls in the text after one call marker (up to its close marker, the next call marker or the end),
    with the text after them that is content; None when it holds no valid calls, so it stays content."""
    if syntax.wire == "hermes":
        call = _tool_call_from(json_object(body.strip()), names)
        return None if call is None else ([call], "")
    decoder = json.JSONDecoder()
    stripped = body.lstrip()
    try:
        if stripped.startswith("["):  # [TOOL_CALLS][{...}, ...]
            values, end = decoder.raw_decode(stripped)
            if not isinstance(values, list):
                return None
            calls = [_tool_call_from(value, names) for value in values]
        else:  # [TOOL_CALLS]name[ARGS]{...}, maybe with [CALL_ID]id before [ARGS]
            head = re.match(r"([\w.\-]+)(?:" + re.escape(MISTRAL_CALL_ID) + r"\w+)?" + re.escape(MISTRAL_ARGS),
                            stripped)
            if head is None:
                return None
            arguments, end = decoder.raw_decode(stripped, head.end())
            calls = [_tool_call_from({"name": head.group(1), "arguments": arguments}, names)]
    except (ValueError, RecursionError):
        return None
    if not calls or None in calls:
        return None
    return calls, stripped[end:]


def _parse_bare_json(text: str, names: set[str]) -> list[ToolCall] | None:
    """llama3's calls: the whole (stripped) output is `<|python_tag|>`? then objects separated by `;`."""
    body = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        position = _skip_space(body, position)
        try:
            value, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError):
            return None
        call = _tool_call_from(value, names)
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(body, position)
        if position == len(body):
            return calls
        if body[position] != ";":
            return None
        position += 1


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _starts_bare_json(stripped: str) -> bool:
    return stripped.startswith(("{", PYTHON_TAG))


def parse_tool_calls(syntax: ToolSyntax, text: str, tool_names: Iterable[str]) -> ParsedOutput:
    """The content and tool calls of a whole output. Content is the text outside the calls, stripped; None when
    empty and there are calls."""
    names = set(tool_names)
    if syntax.wire == "llama3":
        stripped = text.strip()
        calls = _parse_bare_json(stripped, names) if _starts_bare_json(stripped) else None
        return ParsedOutput(None, calls) if calls else ParsedOutput(stripped, [])
    outside: list[str] = []
    calls: list[ToolCall] = []
    if syntax.call_close is not None:
        # vLLM's hermes reading: closed blocks, and a last block the output ended inside
        open_, close = re.escape(syntax.call_open), re.escape(syntax.call_close)
        pattern = re.compile(f"{open_}(.*?){close}|{open_}(.*)", re.DOTALL)
        position = 0
        for match in pattern.finditer(text):
            outside.append(text[position:match.start()])
            parsed = _parse_segment(syntax, match.group(1) if match.group(1) is not None else match.group(2), names)
            if parsed is None:
                outside.append(match.group(0))
            else:
                calls += parsed[0]
                outside.append(parsed[1])
            position = match.end()
        outside.append(text[position:])
    else:
        before, *segments = text.split(syntax.call_open)
        outside.append(before)
        for body in segments:
            parsed = _parse_segment(syntax, body, names)
            if parsed is None:
                outside.append(syntax.call_open + body)
            else:
                calls += parsed[0]
                outside.append(parsed[1])
    content = "".join(outside).strip()
    return ParsedOutput(content or (None if calls else ""), calls)


# ---- streaming ----

StreamEvent = str | ToolCall
"""A content delta (text) or a complete tool call."""


class _StrippedText:
    """Releases streamed text so that the concatenation equals the whole text stripped: leading whitespace is
    dropped, trailing whitespace is held until more text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._pending_space = ""

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body):]
        return body


class ToolCallStream:
    """Streamed output -> content deltas and complete tool calls. Content is released as soon as it cannot be the
    start of a call marker (only a possible partial marker, and trailing whitespace, is held back); a call is
    released when its block closes (hermes), when the next call marker starts or at finish() (mistral). llama3's
    output that starts with `{` or `<|python_tag|>` is held whole until finish(). For any split of an output, the
    events add up to `parse_tool_calls` of the whole."""

    def __init__(self, syntax: ToolSyntax, tool_names: Iterable[str], forced: bool = False) -> None:
        """`forced`: the output is held to the call grammar (tool_choice "required" or a named function), so it is
        calls only: a call is read as soon as its JSON closes, text that is not a complete call (the end of a reply
        cut by max_tokens) is dropped, never content, and a call that repeats an earlier one ends the reply (`ended`:
        a small model loops on its first call where the grammar lets it add more)."""
        self._syntax = syntax
        self._names = set(tool_names)
        self._buffer = ""
        self._in_call = False
        self._holding_bare_json: bool | None = None  # llama3: None until the first non-space text decides
        self._content = _StrippedText()
        self._forced = forced
        self._calls_seen: set[tuple[str, str]] = set()
        self.ended = False  # forced: a call repeated an earlier one; what follows is not read

    def feed(self, delta_text: str) -> list[StreamEvent]:
        if self.ended:
            return []
        self._buffer += delta_text
        if self._forced and self._syntax.wire in ("llama3", "mistral"):
            return self._forced_events(self._json_calls())
        if self._syntax.wire == "llama3":
            return self._feed_bare_json()
        return self._forced_events(self._drain(final=False))

    def finish(self) -> list[StreamEvent]:
        if self.ended:
            return []
        if self._forced and self._syntax.wire in ("llama3", "mistral"):
            return []  # what is left is not a complete call
        if self._syntax.wire != "llama3":
            return self._forced_events(self._drain(final=True))
        text, self._buffer = self._buffer, ""
        if self._holding_bare_json is False:
            return self._content_events(text)
        parsed = parse_tool_calls(self._syntax, text, self._names)
        return [*self._content_events(parsed.content or ""), *parsed.tool_calls]

    def _forced_events(self, events: list[StreamEvent]) -> list[StreamEvent]:
        """Forced: the calls up to the first repeated one, and no text; otherwise the events as they are."""
        if not self._forced:
            return events
        calls = []
        for event in events:
            if isinstance(event, ToolCall):
                key = (event.name, json.dumps(event.arguments, sort_keys=True))
                if key in self._calls_seen:
                    self.ended = True
                    break
                self._calls_seen.add(key)
                calls.append(event)
        return calls

    def _json_calls(self) -> list[StreamEvent]:
        """Forced llama3 (`<|python_tag|>`? call `; ` call ...) and Mistral (`[TOOL_CALLS][` call `, ` call `]`):
        the calls whose JSON has closed, read off the front of the buffer."""
        opening = MISTRAL_MARKER if self._syntax.wire == "mistral" else PYTHON_TAG
        if not self._in_call:
            stripped = self._buffer.lstrip()
            if stripped.startswith(opening):
                stripped = stripped[len(opening):]
            elif opening.startswith(stripped):
                return []  # nothing yet, or the opening marker still arriving
            self._buffer, self._in_call = stripped, True
        decoder, calls = json.JSONDecoder(), []
        while True:
            body = self._buffer.lstrip(" \n\t;,[")
            if not body.startswith("{"):
                self._buffer = body
                return calls
            try:
                value, end = decoder.raw_decode(body)
            except (ValueError, RecursionError):  # not closed yet
                self._buffer = body
                return calls
            self._buffer = body[end:]
            call = _tool_call_from(value, self._names)
            if call is not None:
                calls.append(call)

    def _content_events(self, text: str) -> list[StreamEvent]:
        released = self._content.add(text)
        return [released] if released else []

    def _feed_bare_json(self) -> list[StreamEvent]:
        if self._holding_bare_json is None:
            stripped = self._buffer.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return []  # not decided yet: only space, or a python tag still arriving
            self._holding_bare_json = _starts_bare_json(stripped)
        if self._holding_bare_json:
            return []
        text, self._buffer = self._buffer, ""
        return self._content_events(text)

    def _drain(self, final: bool) -> list[StreamEvent]:
        open_, close = self._syntax.call_open, self._syntax.call_close
        events: list[StreamEvent] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(open_)
                if start < 0:
                    keep = 0 if final else partial_marker_length(self._buffer, open_)
                    cut = len(self._buffer) - keep
                    events += self._content_events(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return events
                events += self._content_events(self._buffer[:start])
                self._buffer = self._buffer[start + len(open_):]
                self._in_call = True
                continue
            # a call ends at its close marker, or (no close marker) where the next call marker starts
            end = self._buffer.find(close or open_)
            if end < 0 and not final:
                return events
            closed = end >= 0
            body = self._buffer[:end] if closed else self._buffer
            self._buffer = self._buffer[end + len(close or ""):] if closed else ""
            self._in_call = False
            parsed = _parse_segment(self._syntax, body, self._names)
            if parsed is None:
                raw_close = close if closed and close else ""
                events += self._content_events(open_ + body + raw_close)
            else:
                events += parsed[0]
                events += self._content_events(parsed[1])
