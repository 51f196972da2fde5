"""Transformers' response parsing where the tokenizer declares its reply format (`response_template` in
tokenizer_config.json): the embedded tokenizer given Gemma 4's declared format, whose calls
(`<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|>`) no kvforge family parser reads, read by the same plan and
reader the chat route and the sessions API use, streamed in any split."""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.app.dialects.openai.format import delta, message
from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.tools import ToolFields
from kvforge.app.generate.chat_output import ChoiceReader, read_whole
from kvforge.app.generate.chat_request import plan_conversation
from kvforge.app.generate.parsers.tool_calls import parse_tool_calls
from kvforge.core.tokenizer import Tokenizer

GEMMA4_FORMAT = {  # transformers' own declaration for Gemma 4 (cli/serving/utils.py), anchored at ChatML's turn
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<|channel>thought\n", "close": "<channel|>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>\w+)", "close": "<tool_call|>", "repeats": True,
            "content": "json", "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close": ["<|im_end|>"], "content": "text"},
    },
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
REPLY = ('<|channel>thought\nThe user wants the weather.<channel|>Let me look. '
         '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:<|"|>3<|"|>}<tool_call|>')
QUESTION = [ChatMessage(role="user", content="Weather in Paris for 3 days?")]


@pytest.fixture(scope="module")
def tokenizer(embedded_path, tmp_path_factory):
    directory = tmp_path_factory.mktemp("declared")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded_path / name).exists():
            shutil.copy(embedded_path / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "response_template": GEMMA4_FORMAT}))
    return Tokenizer(directory)


def read(plan, text: str, step: int) -> list[dict]:
    """The reply streamed in pieces of `step` characters, as OpenAI's deltas."""
    reader = ChoiceReader(plan)
    parts = [p for i in range(0, len(text), step) for p in reader.feed(text[i:i + step])]
    return [delta(part) for part in parts + reader.finish()]


def whole_message(plan, text: str) -> tuple[dict, bool]:
    """The whole reply as OpenAI's message, and whether it called tools."""
    reply = read_whole(plan, text)
    return message(reply), bool(reply.calls)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_the_declared_format_reads_the_reply_in_any_split(tokenizer, step):
    plan = plan_conversation(tokenizer, QUESTION, ToolFields(tools=[WEATHER]))
    assert plan.declared_template == GEMMA4_FORMAT and not plan.skip_special_tokens
    deltas = read(plan, REPLY, step)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}  # cast by the tool's schema
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather."
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    whole, called = whole_message(plan, REPLY)
    assert called and whole["tool_calls"][0]["function"]["name"] == "get_weather"
    assert whole["content"].strip() == "Let me look." and whole["reasoning_content"]
    # no family parser reads this syntax: without the declared format there would be no call
    assert parse_tool_calls(plan.tool_syntax, REPLY, ["get_weather"]).tool_calls == []


def test_a_call_of_another_function_stays_in_the_content(tokenizer):
    plan = plan_conversation(tokenizer, QUESTION, ToolFields(tools=[WEATHER]))
    whole, called = whole_message(plan, '<|tool_call>call:delete_files{path:<|"|>/<|"|>}<tool_call|>')
    assert not called and "delete_files" in whole["content"]


def test_without_tools_or_with_a_forced_call_kvforge_reads_the_reply(tokenizer):
    """No tools: the text is the content. A forced call is written by the call grammar in the template's (here
    the default, Hermes) syntax, which the family parser reads."""
    plain = plan_conversation(tokenizer, QUESTION, ToolFields())
    assert plain.declared_template is None
    assert whole_message(plain, "Sunny.") == ({"role": "assistant", "content": "Sunny."}, False)
    forced = plan_conversation(tokenizer, QUESTION, ToolFields(tools=[WEATHER], tool_choice="required"))
    assert forced.declared_template is None and forced.constraint is not None
    whole, called = whole_message(forced, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                          '</tool_call>')
    assert called and json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
