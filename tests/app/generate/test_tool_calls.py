"""Tool calling as text (app/generate/parsers/tool_calls.py): the family of a chat template, the parsers of each
family's real
output (whole and streamed: any split of the stream gives the whole-text parse), the history and system prompt for
templates without tool syntax, and the call grammar, compiled by llguidance against the embedded model's tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.app.dialects.openai.format import tool_call
from kvforge.app.generate.parsers.tool_calls import (
    DEFAULT,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS_FORM,
    ToolCallStream,
    detect_tool_syntax,
    parse_tool_calls,
    tool_names,
)
from kvforge.app.generate.reply import ToolCall
from kvforge.app.generate.tool_grammar import call_grammar
from kvforge.app.generate.tool_prompts import messages_for_template, render_history_for_default, tools_system_prompt

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}, "seconds": {"type": "boolean"}},
                   "required": ["tz"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters
TOOLS = [WEATHER, TIME, PING]
NAMES = tool_names(TOOLS)

# excerpts of real chat templates, the parts that mention their tool syntax
QWEN25_TEMPLATE = ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
                   'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
                   '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
LLAMA31_TEMPLATE = ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                    'and its value}.\' }}{%- if builtin_tools is defined %}{{- "<|python_tag|>" + tool_call.name }}'
                    '{%- elif message.role == "tool" or message.role == "ipython" %}'
                    '{{- "<|start_header_id|>ipython" }}')
LLAMA32_TEMPLATE = ('{{- \'Given the following functions, please respond with a JSON for a function call with its '
                    'proper arguments. Respond in the format {"name": function name, "parameters": dictionary of '
                    'argument name and its value}.\' }}{%- elif message.role == "ipython" %}')
MISTRAL_V3_TEMPLATE = ('{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
                       '{{- {"name": tool_call.function.name, "arguments": tool_call.function.arguments} | tojson }}')
MISTRAL_SMALL_32_TEMPLATE = ("{%- for tool in message['tool_calls'] %}{{- '[TOOL_CALLS]' + tool['function']['name'] "
                             "+ '[ARGS]' + arguments }}{%- endfor %}")


@pytest.fixture(scope="module")
def tokenizers(embedded_path):
    """The embedded model's tokenizer and llguidance's view of it (built once: it takes a few tenths of a second)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_path)
    return tok, llguidance.hf.from_tokenizer(tok)


def call_text(syntax, calls: list[tuple[str, dict]]) -> str:
    """`calls` written as the family writes them, with json.dumps' spacing (what the grammar allows)."""
    if syntax.wire == "hermes":
        return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if syntax.wire == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if syntax.wire == "mistral":
        return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def calls_of(tool_calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in tool_calls]


# ---- detection ----


@pytest.mark.parametrize("template, syntax", [
    (QWEN25_TEMPLATE, HERMES), (LLAMA31_TEMPLATE, LLAMA3), (LLAMA32_TEMPLATE, LLAMA3),
    (MISTRAL_V3_TEMPLATE, MISTRAL), (MISTRAL_SMALL_32_TEMPLATE, MISTRAL_ARGS_FORM), (None, DEFAULT), ("", DEFAULT),
])
def test_detect_tool_syntax(template, syntax):
    assert detect_tool_syntax(template) == syntax
    assert syntax.template_supports_tools is (syntax != DEFAULT)


def test_the_embedded_chatml_template_has_no_tool_syntax(tokenizers):
    tok, _ = tokenizers
    syntax = detect_tool_syntax(tok.chat_template)
    assert syntax == DEFAULT
    assert not syntax.template_supports_tools
    assert syntax.wire == "hermes"


# ---- whole outputs ----

PARIS = ("get_weather", {"city": "Paris"})
TOKYO = ("get_weather", {"city": "Tokyo", "unit": "celsius"})
CET = ("get_time", {"tz": "Europe/Paris", "seconds": False})


@pytest.mark.parametrize("syntax, text, content, calls", [
    # Qwen2.5 / Hermes: one block, text before, parallel blocks
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    (HERMES, 'Let me look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": '
             '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", '
             '"seconds": false}}\n</tool_call>', "Let me look both up.", [TOKYO, CET]),
    (HERMES, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\nDone.', "Done.", [("ping", {})]),
    (HERMES, '<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {})]),  # no arguments: none needed
    # arguments sent as a JSON string, and non-ASCII kept
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}\n</tool_call>', None,
     [("get_weather", {"city": "Zürich"})]),
    # the output ended inside a block (e.g. "</tool_call>" was a stop string): still a call when its JSON is whole
    (HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "Sure.", [PARIS]),
    (HERMES, "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    (DEFAULT, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    # Llama 3.1 / 3.2: a bare JSON object, maybe after the python tag, ";" between parallel calls
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3, '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3, '\n{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}}; {"name": "get_time", '
             '"parameters": {"tz": "Europe/Paris", "seconds": false}}', None, [TOKYO, CET]),
    (LLAMA3, "It is 18 degrees in Paris.", "It is 18 degrees in Paris.", []),
    (LLAMA3, 'Call {"name": "get_weather", "parameters": {"city": "Paris"}}',
     'Call {"name": "get_weather", "parameters": {"city": "Paris"}}', []),  # only a whole output is a call
    # Mistral: [TOOL_CALLS] and a JSON array (v3 decodes with a space; calls from the history may carry an id)
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}, "id": '
              '"a1B2c3D4e"}, {"name": "get_time", "arguments": {"tz": "Europe/Paris", "seconds": false}}]', None,
     [TOKYO, CET]),
    (MISTRAL, 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking.", [PARIS]),
    # Mistral Small 3.2 and later: [TOOL_CALLS]name[ARGS]{...}, maybe with [CALL_ID]; both forms read either way
    (MISTRAL_ARGS_FORM, '[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo", "unit": "celsius"}[TOOL_CALLS]get_time'
                        '[ARGS]{"tz": "Europe/Paris", "seconds": false}', None, [TOKYO, CET]),
    (MISTRAL, '[TOOL_CALLS]get_weather[CALL_ID]x9Y8z7W6v[ARGS]{"city": "Paris"}', None, [PARIS]),
    (MISTRAL_ARGS_FORM, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
])
def test_parse_real_outputs(syntax, text, content, calls):
    parsed = parse_tool_calls(syntax, text, NAMES)
    assert parsed.content == content
    assert calls_of(parsed.tool_calls) == calls


@pytest.mark.parametrize("syntax, text", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),  # a brace short
    (HERMES, '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'),  # not a tool of the request
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut off by max_tokens
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    (LLAMA3, '{"name": "launch_rockets", "parameters": {}}'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}} and more text'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "launch_rockets", '
              '"arguments": {}}]'),  # one unknown call keeps the whole list as text
    (MISTRAL_ARGS_FORM, "[TOOL_CALLS]launch_rockets[ARGS]{}"),
    (MISTRAL_ARGS_FORM, "[TOOL_CALLS] is a marker"),
    (HERMES, '<tool_call>\n{"name": ["get_weather"], "arguments": {}}\n</tool_call>'),  # a name that is no string
    # nesting too deep for Python's json: no RecursionError escapes
    (HERMES, "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>"),
    (LLAMA3, '{"name": "ping", "parameters": ' + "[" * 100_000),
    (MISTRAL, "[TOOL_CALLS]" + "[" * 100_000),
    (MISTRAL, "[TOOL_CALLS]ping[ARGS]" + "[" * 100_000),
])
def test_unreadable_calls_stay_in_the_content(syntax, text):
    parsed = parse_tool_calls(syntax, text, NAMES)
    assert parsed.tool_calls == []
    assert parsed.content == text.strip()


def test_a_bad_call_keeps_its_text_in_place_and_the_good_ones_are_calls():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    text = f'Trying.\n{bad}\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
    parsed = parse_tool_calls(HERMES, text, NAMES)
    assert parsed.content == f"Trying.\n{bad}"
    assert calls_of(parsed.tool_calls) == [PARIS]


def test_call_ids_are_random_and_openai_shaped():
    text = call_text(HERMES, [PARIS, PARIS])
    first, second = parse_tool_calls(HERMES, text, NAMES).tool_calls
    for call in (first, second):
        assert call.id.startswith("call_") and len(call.id) == 29
        int(call.id[5:], 16)
    assert first.id != second.id
    assert tool_call(first) == {"id": first.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert tool_call(replace(second, index=1), streamed=True) == {"index": 1, **tool_call(second)}


# ---- streaming ----


def streamed(syntax, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """The stream's events over `text` cut at `cuts`: the content joined, and the calls."""
    stream = ToolCallStream(syntax, NAMES)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += stream.feed(text[a:b])
    events += stream.finish()
    content = "".join(event for event in events if isinstance(event, str))
    return content, calls_of([event for event in events if isinstance(event, ToolCall)])


def whole(syntax, text: str) -> tuple[str, list[tuple[str, dict]]]:
    parsed = parse_tool_calls(syntax, text, NAMES)
    return parsed.content or "", calls_of(parsed.tool_calls)


STREAM_SAMPLES = [
    (HERMES, "I'll check.\n\n" + call_text(HERMES, [TOKYO, CET])),
    (HERMES, "a < b and <tool is not <tool_call! " + call_text(HERMES, [PARIS]) + "\n\nThen  more \n"),
    (HERMES, 'x <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> y'),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),
    (HERMES, "<tool_call>\n<tool_call>" + call_text(HERMES, [PARIS]) + "</tool_c"),
    (DEFAULT, "   \n" + call_text(DEFAULT, [PARIS]) + " \n "),
    (LLAMA3, call_text(LLAMA3, [TOKYO, CET])),
    (LLAMA3, " <|python_tag|>" + call_text(LLAMA3, [PARIS])),
    (LLAMA3, " It is 18 degrees {in} Paris. "),
    (LLAMA3, "<|python"),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    (MISTRAL, "Checking [both] cities. " + call_text(MISTRAL, [TOKYO, CET]) + " done"),
    (MISTRAL, "[TOOL_CALLS] not json [TOOL_CALLS]" + call_text(MISTRAL, [PARIS])[12:] + "[TOOL_"),
    (MISTRAL_ARGS_FORM, "ok " + call_text(MISTRAL_ARGS_FORM, [TOKYO, CET, PARIS])),
]


@pytest.mark.parametrize("syntax, text", STREAM_SAMPLES)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_any_split_of_the_stream_gives_the_whole_parse(syntax, text, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    assert streamed(syntax, text, cuts) == whole(syntax, text)


@pytest.mark.parametrize("syntax, text", STREAM_SAMPLES)
def test_a_marker_split_at_every_position(syntax, text):
    expected = whole(syntax, text)
    for cut in range(len(text) + 1):
        assert streamed(syntax, text, [cut]) == expected, cut
    assert streamed(syntax, text, list(range(1, len(text)))) == expected


def test_the_stream_releases_content_early_and_a_call_when_its_block_closes():
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.feed("Let me check.") == ["Let me check."]
    assert stream.feed("\n\n<tool_c") == []  # whitespace and a possible marker are held
    assert stream.feed('all>\n{"name": "get_weather", ') == []
    [call] = stream.feed('"arguments": {"city": "Paris"}}\n</tool_call>')
    assert (call.name, call.arguments_json) == ("get_weather", '{"city": "Paris"}')
    assert stream.feed("\nAnything <") == ["\n\n\nAnything"]  # held space released once text follows it
    assert stream.feed(" else") == [" < else"]  # "<" was held: it might have started a call
    assert stream.finish() == []


def test_llama3_holds_a_json_output_until_finish_and_streams_text():
    stream = ToolCallStream(LLAMA3, NAMES)
    assert stream.feed(' {"name": "get_weather", ') == []
    assert stream.feed('"parameters": {"city": "Paris"}}') == []
    [call] = stream.finish()
    assert (call.name, call.arguments) == PARIS
    text_stream = ToolCallStream(LLAMA3, NAMES)
    assert text_stream.feed("<|py") == []  # may be the python tag
    assert text_stream.feed("thon is a language") == ["<|python is a language"]
    assert text_stream.feed(" I like.") == [" I like."]


# ---- prompts and history ----


def test_tools_system_prompt_describes_each_function_and_the_call_format():
    prompt = tools_system_prompt(TOOLS)
    for tool in TOOLS:
        assert tool["function"]["name"] in prompt
    assert "Current weather in a city." in prompt
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt
    assert '{"name": "ping", "description": "", "parameters": {"type": "object"}}' in prompt  # no parameters
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in prompt


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Tokyo, and the time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris", "seconds": false}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, clear"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]


def test_render_history_for_default_writes_calls_and_results_as_text(tokenizers):
    tok, _ = tokenizers
    rendered = render_history_for_default(HISTORY)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]  # the two results: one turn
    assert rendered[:2] == HISTORY[:2]
    assert calls_of(parse_tool_calls(DEFAULT, rendered[2]["content"], NAMES).tool_calls) == [TOKYO, CET]
    assert rendered[3]["content"] == ("<tool_response>\n22 C, clear\n</tool_response>\n"
                                      "<tool_response>\n14:05\n</tool_response>")
    prompt = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in prompt
    assert "<|im_start|>user\n<tool_response>\n22 C, clear\n</tool_response>" in prompt
    assert "tool_calls" in HISTORY[2]  # the request's messages are left as they were


def test_render_history_keeps_an_assistant_text_before_its_calls():
    message = {"role": "assistant", "content": "Checking.",
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "ping", "arguments": "not json"}}]}
    [rendered] = render_history_for_default([message])
    assert rendered == {"role": "assistant",
                        "content": 'Checking.\n<tool_call>\n{"name": "ping", "arguments": "not json"}\n</tool_call>'}


def test_messages_for_template_parses_argument_strings():
    prepared = messages_for_template(HISTORY + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": "{not json"}}]}])
    assert prepared[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Tokyo", "unit": "celsius"}
    assert prepared[2]["tool_calls"][1]["id"] == "call_2"
    assert prepared[-1]["tool_calls"][0]["function"]["arguments"] == "{not json"
    assert prepared[3:5] == HISTORY[3:5]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Tokyo", "unit": "celsius"}'


# ---- the call grammar, against the embedded model's tokenizer ----


def accepts(tokenizers, grammar: str, text: str | list[int]) -> bool:
    """Whether llguidance lets the model write `text` (or these token ids) and then stop."""
    from llguidance import LLMatcher

    tok, lltok = tokenizers
    matcher = LLMatcher(lltok, LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False) if isinstance(text, str) else text
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


WIRES = [HERMES, DEFAULT, LLAMA3, MISTRAL, MISTRAL_ARGS_FORM]


@pytest.mark.parametrize("syntax", WIRES, ids=lambda s: s.name)
def test_the_required_grammar_takes_a_valid_call_of_any_tool(tokenizers, syntax):
    grammar = call_grammar(syntax, TOOLS, "required", parallel=False)
    for call in (PARIS, TOKYO, CET, ("ping", {}), ("ping", {"extra": [1, 2]})):
        text = call_text(syntax, [call])
        assert accepts(tokenizers, grammar, text), text
        assert calls_of(parse_tool_calls(syntax, text, NAMES).tool_calls) == [call]  # the parser reads it back


@pytest.mark.parametrize("syntax", WIRES, ids=lambda s: s.name)
def test_the_grammar_refuses_bad_calls(tokenizers, syntax):
    grammar = call_grammar(syntax, TOOLS, "required", parallel=False)
    for call in (("get_weather", {"city": 7}), ("get_weather", {"unit": "celsius"}),
                 ("get_weather", {"city": "Paris", "unit": "kelvin"}), ("get_time", {"tz": "UTC", "seconds": "no"}),
                 ("get_weather", {"city": "Paris", "country": "FR"}),  # no additionalProperties: closed
                 ("launch_rockets", {})):
        assert not accepts(tokenizers, grammar, call_text(syntax, [call])), call
    assert not accepts(tokenizers, grammar, "The weather is sunny.")
    extra_key = call_text(syntax, [PARIS]).replace('"city": "Paris"}', '"city": "Paris"}, "confidence": 1')
    assert extra_key != call_text(syntax, [PARIS])
    assert not accepts(tokenizers, grammar, extra_key)  # a call object has its name and arguments only
    assert not accepts(tokenizers, grammar, call_text(syntax, [PARIS, CET]))  # one call only
    assert not accepts(tokenizers, grammar, call_text(syntax, [PARIS])[:-1])  # a call must be complete


@pytest.mark.parametrize("syntax", WIRES, ids=lambda s: s.name)
def test_the_parallel_grammar_takes_several_calls(tokenizers, syntax):
    grammar = call_grammar(syntax, TOOLS, "required", parallel=True)
    assert accepts(tokenizers, grammar, call_text(syntax, [PARIS]))
    assert accepts(tokenizers, grammar, call_text(syntax, [TOKYO, CET, ("ping", {})]))
    assert not accepts(tokenizers, grammar, call_text(syntax, [TOKYO, ("get_time", {"tz": 1})]))


@pytest.mark.parametrize("syntax", WIRES, ids=lambda s: s.name)
def test_a_named_tool_choice_allows_only_that_tool(tokenizers, syntax):
    """A named choice is exactly one call of that function, parallel_tool_calls or not."""
    grammar = call_grammar(syntax, TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel=True)
    assert accepts(tokenizers, grammar, call_text(syntax, [CET]))
    assert not accepts(tokenizers, grammar, call_text(syntax, [CET, CET]))
    assert not accepts(tokenizers, grammar, call_text(syntax, [PARIS]))


def forced_stream(syntax, text: str, cuts: list[int]) -> tuple[list, bool]:
    stream = ToolCallStream(syntax, NAMES, forced=True)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += stream.feed(text[a:b])
    return events + stream.finish(), stream.ended


@pytest.mark.parametrize("syntax", WIRES, ids=lambda s: s.name)
def test_a_forced_reply_ends_at_a_repeated_call_and_drops_a_cut_one(syntax):
    """What a small model does under the parallel grammar: its first call again and again until max_tokens. The
    reply is the distinct calls before the first repeat; a call cut by max_tokens is dropped, never content."""
    looping = call_text(syntax, [PARIS, CET, PARIS, TOKYO])
    for cuts in ([], [7], list(range(1, len(looping)))):
        events, ended = forced_stream(syntax, looping, cuts)
        assert all(isinstance(e, ToolCall) for e in events)
        assert calls_of(events) == [PARIS, CET] and ended
    cut = call_text(syntax, [PARIS, CET])
    cut = cut[:cut.rindex("Europe")]
    events, ended = forced_stream(syntax, cut, [])
    assert calls_of(events) == [PARIS] and not ended
    distinct = call_text(syntax, [PARIS, CET])
    events, ended = forced_stream(syntax, distinct, [len(distinct) // 2])
    assert calls_of(events) == [PARIS, CET] and not ended


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3, MISTRAL], ids=lambda s: s.name)
def test_a_forced_call_is_read_as_soon_as_it_closes(syntax):
    """So that the server can stop the sample at a repeat without waiting for the end of the output."""
    first = call_text(syntax, [PARIS, CET])
    stream = ToolCallStream(syntax, NAMES, forced=True)
    at = first.index("Europe")
    assert calls_of(stream.feed(first[:at])) == [PARIS]
    assert calls_of(stream.feed(first[at:])) == [CET]


def test_parameters_with_refs_keep_their_meaning(tokenizers):
    """pydantic's schemas (the OpenAI SDK's pydantic_function_tool) put types in $defs; a tree refers to itself."""
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": {
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}}, "required": ["city", "unit"]}}}
    outline = {"type": "function", "function": {"name": "outline", "parameters": {
        "type": "object", "required": ["title"],
        "properties": {"title": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}}}}
    tools, names = [forecast, outline], ["forecast", "outline"]
    for syntax in WIRES:
        grammar = call_grammar(syntax, tools, "required", parallel=False)
        good = [("forecast", {"city": "Oslo", "unit": "celsius"}),
                ("outline", {"title": "a", "children": [{"title": "b", "children": [{"title": "c"}]}]})]
        bad = [("forecast", {"city": "Oslo", "unit": "kelvin"}),
               ("outline", {"title": "a", "children": [{"title": 1}]})]
        for call in good:
            assert accepts(tokenizers, grammar, call_text(syntax, [call])), (syntax.name, call)
            assert calls_of(parse_tool_calls(syntax, call_text(syntax, [call]), names).tool_calls) == [call]
        for call in bad:
            assert not accepts(tokenizers, grammar, call_text(syntax, [call])), (syntax.name, call)


@pytest.mark.parametrize("syntax, marker", [(MISTRAL, "[TOOL_CALLS]"), (MISTRAL_ARGS_FORM, "[TOOL_CALLS]"),
                                            (HERMES, "<tool_call>")], ids=lambda x: getattr(x, "name", x))
def test_a_marker_that_is_a_special_token_must_be_that_token(tokenizers, syntax, marker):
    """Mistral's [TOOL_CALLS] is one special token: the grammar names its id, so spelling it in text is refused.
    The embedded tokenizer has no such marker: its special token <file_sep> stands in for it."""
    tok, _ = tokenizers
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    marker_id = specials["<file_sep>"]
    grammar = call_grammar(syntax, TOOLS, "required", parallel=False, special_token_ids={marker: marker_id})
    assert f"<[{marker_id}]>" in grammar
    text = call_text(syntax, [PARIS])
    assert text.startswith(marker)
    assert accepts(tokenizers, grammar, [marker_id, *tok.encode(text[len(marker):], add_special_tokens=False)])
    assert not accepts(tokenizers, grammar, text)


@pytest.mark.parametrize("tool_choice", ["auto", "none", {"type": "function", "function": {"name": "nope"}}])
def test_the_grammar_refuses_a_tool_choice_it_cannot_force(tool_choice):
    with pytest.raises(ValueError):
        call_grammar(HERMES, TOOLS, tool_choice, parallel=False)
