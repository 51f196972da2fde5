"""Tools and tool history in the prompt: the system text that describes tools to a model whose template cannot, and
the earlier calls and results of a conversation rendered as its template expects them (or in the hermes form)."""

from __future__ import annotations

import json

from kvforge.app.generate.parsers.tool_calls import HERMES_CLOSE, HERMES_OPEN, json_object, tool_parameters


def tools_system_prompt(tools: list[dict]) -> str:
    """The system text that describes `tools` to a model whose template cannot (the "default" family): each
    function's name, description and parameter schema, and the hermes format to call them in."""
    signatures = "\n".join(
        json.dumps({"name": tool["function"]["name"], "description": tool["function"].get("description", ""),
                    "parameters": tool_parameters(tool)}, ensure_ascii=False)
        for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
            "The functions are described within <tools></tools> tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments within "
            "<tool_call></tool_call> tags, one block for each call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
            "The results come back within <tool_response></tool_response> tags.")


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
    parsed = json_object(arguments) if isinstance(arguments, str) else arguments
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
                    parsed = json_object(function["arguments"])
                    function["arguments"] = function["arguments"] if parsed is None else parsed
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        prepared.append(message)
    return prepared
