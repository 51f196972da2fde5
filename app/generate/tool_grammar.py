"""The grammar that forces a tool call (tool_choice "required" or a named function): a Lark grammar in llguidance's
dialect whose outputs are exactly the model family's call syntax around JSON that fits each tool's parameter schema."""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvforge.app.generate.parsers.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_ARGS,
    MISTRAL_MARKER,
    ToolSyntax,
    tool_parameters,
)
from kvforge.core.constraint import closed_objects


def call_grammar(syntax: ToolSyntax, tools: list[dict], tool_choice: str | dict, parallel: bool,
                 special_token_ids: Mapping[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) whose outputs are one tool call, or one or more when `parallel`, in the
    family's wire format, each naming an allowed tool with arguments valid against its parameters schema.
    `tool_choice` is "required" (any tool) or {"type": "function", "function": {"name": X}} (exactly one call of X:
    OpenAI's named choice calls that function, so `parallel` only applies to "required").
    `special_token_ids` maps the tokenizer's special tokens to their ids, e.g.
    `{t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}`: a marker that is one special token
    (Mistral's [TOOL_CALLS] and [ARGS]) must be written as that token, not spelled in text. Raises ValueError on a
    tool_choice that names no tool in `tools` or is not one of those two shapes."""
    allowed = _allowed_tools(tools, tool_choice)
    parallel = parallel and tool_choice == "required"
    specials = special_token_ids or {}

    def marker(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else _lark_string(text)

    if syntax.wire == "mistral-args":
        alternatives = [f"call_{i}" for i in range(len(allowed))]
        rules = [f"call_{i}: {marker(MISTRAL_MARKER)} {_lark_string(tool['function']['name'])} "
                 f"{marker(MISTRAL_ARGS)} %json {_schema_json(closed_objects(tool_parameters(tool)))}"
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
    """{"name": const, <arguments_key>: parameters} for each tool, the parameters' objects closed as a response
    format's are (core/constraint.py closed_objects). Each parameters schema moves to the root's $defs
    (as "tool<i>") with its local $refs rewritten to follow it: a "#/$defs/X" (pydantic writes them) or a
    recursive "#" would otherwise resolve against the call schema instead of the parameters."""
    definitions = {f"tool{i}": _relocated_refs(closed_objects(tool_parameters(tool)), f"#/$defs/tool{i}")
                   for i, tool in enumerate(tools)}
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
