"""OpenAI tool calling as text: which wire format a model family writes its calls in, the grammar that forces a
call (tool_choice "required" or a named function), and the parsers that turn the model's text back into
OpenAI `tool_calls`, whole or streamed.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvforge.app.generate.parsers.stream_text import partial_marker_length

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


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON string, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def openai_tool_call(call: ToolCall, index: int | None = None) -> dict:
    """The OpenAI shape of a call: a message's `tool_calls` item, or with `index` a stream delta's."""
    shaped = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return shaped if index is None else {"index": index, **shaped}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into its content (None when empty and there are calls) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


# ---- prompts and history for templates without tool syntax ----


def tools_system_prompt(tools: list[dict]) -> str:
    """The system text that describes `tools` to a model whose template cannot (the "default" family): each
    function's name, description and parameter schema, and the hermes format to call them in."""
    signatures = "\n".join(
        json.dumps({"name": tool["function"]["name"], "description": tool["function"].get("description", ""),
                    "parameters": _parameters(tool)}, ensure_ascii=False)
        for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
            "The functions are described within <tools></tools> tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments within "
            "<tool_call></tool_call> tags, one block for each call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
            "The results come back within <tool_response></tool_response> tags.")


def _loads_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    return value if isinstance(value, dict) else None


def _text_of(content) -> str:
    """A message's content as text: OpenAI also sends a list of parts, of which text parts carry the text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_history_for_default(messages: list[dict]) -> list[dict]:
    """Messages a template without tool syntax can render: an assistant's `tool_calls` become `<tool_call>` blocks
    in its content, and each run of `tool` messages becomes one user message of `<tool_response>` blocks (one
    user turn, so templates that insist on alternating roles accept it)."""
    rendered: list[dict] = []
    previous_role = None
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_hermes_block(call["function"]) for call in message["tool_calls"]]
            text = "\n".join(part for part in [_text_of(message.get("content")).strip(), *blocks] if part)
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{_text_of(message.get('content'))}\n</tool_response>"
            if previous_role == "tool":
                rendered[-1] = {"role": "user", "content": rendered[-1]["content"] + "\n" + block}
            else:
                rendered.append({"role": "user", "content": block})
        else:
            rendered.append(message)
        previous_role = role
    return rendered


def _hermes_block(function: dict) -> str:
    arguments = function.get("arguments")
    parsed = _loads_object(arguments) if isinstance(arguments, str) else arguments
    call = {"name": function["name"], "arguments": arguments if parsed is None else parsed}
    return f"{HERMES_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{HERMES_CLOSE}"


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tool calls: they index `function.arguments` as a mapping, while
    OpenAI sends a JSON string, so object strings are parsed (anything else is left as the string)."""
    prepared = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                if isinstance(function.get("arguments"), str):
                    parsed = _loads_object(function["arguments"])
                    function["arguments"] = function["arguments"] if parsed is None else parsed
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        prepared.append(message)
    return prepared


# ---- the grammar that forces a call ----


def call_grammar(syntax: ToolSyntax, tools: list[dict], tool_choice: str | dict, parallel: bool,
                 special_token_ids: Mapping[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) whose outputs are one tool call, or one or more when `parallel`, in the
    family's wire format, each naming an allowed tool with arguments valid against its parameters schema.
    `tool_choice` is "required" (any tool) or {"type": "function", "function": {"name": X}} (only X).
    `special_token_ids` maps the tokenizer's special tokens to their ids, e.g.
    `{t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}`: a marker that is one special token
    (Mistral's [TOOL_CALLS] and [ARGS]) must be written as that token, not spelled in text. Raises ValueError on a
    tool_choice that names no tool in `tools` or is not one of those two shapes."""
    allowed = _allowed_tools(tools, tool_choice)
    specials = special_token_ids or {}

    def marker(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else _lark_string(text)

    if syntax.wire == "mistral-args":
        alternatives = [f"call_{i}" for i in range(len(allowed))]
        rules = [f"call_{i}: {marker(MISTRAL_MARKER)} {_lark_string(tool['function']['name'])} "
                 f"{marker(MISTRAL_ARGS)} %json {_schema_json(_parameters(tool))}"
                 for i, tool in enumerate(allowed)]
        calls = f"({' | '.join(alternatives)})" + ("+" if parallel else "")
        return "\n".join([f"start: {calls}", *rules]) + "\n"
    call_rule = f"call: %json {_schema_json(_call_schema(allowed, syntax.arguments_key))}"
    if syntax.wire == "hermes":
        block = f'{marker(HERMES_OPEN)} "\\n" call "\\n" {marker(HERMES_CLOSE)}'
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        return "\n".join([start, f"block: {block}", call_rule]) + "\n"
    if syntax.wire == "llama3":
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, call_rule]) + "\n"
    if syntax.wire == "mistral":
        calls = 'call (", " call)*' if parallel else "call"
        return "\n".join([f'start: {marker(MISTRAL_MARKER)} "[" {calls} "]"', call_rule]) + "\n"
    raise ValueError(f"unknown tool-call wire format {syntax.wire!r}")


def _allowed_tools(tools: list[dict], tool_choice: str | dict) -> list[dict]:
    if tool_choice == "required":
        allowed = list(tools)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        wanted = tool_choice.get("function", {}).get("name")
        allowed = [tool for tool in tools if tool["function"]["name"] == wanted]
        if not allowed:
            raise ValueError(f"tool_choice names function {wanted!r}, which is not in tools")
    else:
        raise ValueError(f"a call grammar is for tool_choice 'required' or a named function, not {tool_choice!r}")
    if not allowed:
        raise ValueError("tool_choice 'required' with no tools")
    return allowed


def _call_schema(tools: list[dict], arguments_key: str) -> dict:
    """{"name": const, <arguments_key>: parameters} for each tool. Each parameters schema moves to the root's $defs
    (as "tool<i>") with its local $refs rewritten to follow it: a "#/$defs/X" (pydantic writes them) or a
    recursive "#" would otherwise resolve against the call schema instead of the parameters."""
    definitions = {f"tool{i}": _relocated_refs(_parameters(tool), f"#/$defs/tool{i}") for i, tool in enumerate(tools)}
    alternatives = [{"type": "object",
                     "properties": {"name": {"const": tool["function"]["name"]},
                                    arguments_key: {"$ref": f"#/$defs/tool{i}"}},
                     "required": ["name", arguments_key], "additionalProperties": False}
                    for i, tool in enumerate(tools)]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {"$defs": definitions, **schema}


def _relocated_refs(schema, root: str):
    """`schema` with each local "$ref" ("#...") made relative to `root`, the pointer to where the schema now sits."""
    if isinstance(schema, dict):
        return {key: root + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _relocated_refs(value, root) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_relocated_refs(item, root) for item in schema]
    return schema


def _schema_json(schema: dict) -> str:
    # json.dumps' own separators, the spacing these families were trained on (and their templates' tojson writes);
    # fixed spacing also keeps a small model from padding the JSON with whitespace.
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# ---- parsing ----


def _tool_call_from(value, names: set[str]) -> ToolCall | None:
    """A call from a decoded JSON value, or None when it is not a call of a known tool. The arguments may sit
    under "arguments" or "parameters" (families mix them up); a missing one is an empty object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_segment(syntax: ToolSyntax, body: str, names: set[str]) -> tuple[list[ToolCall], str] | None:
    """The calls in the text after one call marker (up to its close marker, the next call marker or the end),
    with the text after them that is content; None when it holds no valid calls, so it stays content."""
    if syntax.wire == "hermes":
        call = _tool_call_from(_loads_object(body.strip()), names)
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

    def __init__(self, syntax: ToolSyntax, tool_names: Iterable[str]) -> None:
        self._syntax = syntax
        self._names = set(tool_names)
        self._buffer = ""
        self._in_call = False
        self._holding_bare_json: bool | None = None  # llama3: None until the first non-space text decides
        self._content = _StrippedText()

    def feed(self, delta_text: str) -> list[StreamEvent]:
        self._buffer += delta_text
        if self._syntax.wire == "llama3":
            return self._feed_bare_json()
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        if self._syntax.wire != "llama3":
            return self._drain(final=True)
        text, self._buffer = self._buffer, ""
        if self._holding_bare_json is False:
            return self._content_events(text)
        parsed = parse_tool_calls(self._syntax, text, self._names)
        return [*self._content_events(parsed.content or ""), *parsed.tool_calls]

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
