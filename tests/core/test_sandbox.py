"""The sandbox for what model files and requests hand us (core/sandbox/): chat templates render the text HF
transformers renders, within bounded work, in a worker process that is killed past its budget, when cancelled, or
when it dies; grammars crash no process but a worker. In-process, against the real worker processes."""

from __future__ import annotations

import os
import re
import signal
import string
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.core.chat_templates import GEMMA
from kvforge.core.sandbox import pool
from kvforge.core.sandbox.grammars import MAX_GRAMMAR_CHARS
from kvforge.core.sandbox.pool import CANCEL, GRACE_S, SandboxCancelled, SandboxRefused, render_template
from kvforge.core.tokenizer import Tokenizer
from tests.helpers.thinking_model import TEMPLATE as THINKING_TEMPLATE

# Written for this test: the constructs Hub templates use (namespace, loop controls, macros, filters, tojson with an
# indent, tools, tool calls, reasoning, role checks, HF's generation tag and globals).
KITCHEN_SINK = """{%- macro render_args(args) -%}{{ args | tojson(indent=2) }}{%- endmacro -%}
{%- set ns = namespace(system='', last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] | trim -%}{%- endif -%}
{{ bos_token }}{%- if tools is defined and tools -%}<tools>{%- for t in tools -%}
{{ t.function.name }}: {{ t.function.parameters | tojson }}{%- if not loop.last %}, {% endif -%}
{%- endfor -%}</tools>{%- endif -%}
{%- if ns.system %}[SYS]{{ ns.system }}[/SYS]{% endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
  {%- if m.role not in ['user', 'assistant', 'tool'] -%}{{ raise_exception('unknown role ' ~ m.role) }}{%- endif -%}
  <{{ m.role | upper }}>
  {%- if m.reasoning_content is defined and loop.index0 > ns.last_user -%}<think>{{ m.reasoning_content }}</think>
  {%- endif -%}
  {%- if m.role == 'assistant' -%}{% generation %}{{ m.content | default('', true) }}{% endgeneration %}
  {%- else -%}{{ m.content }}{%- endif -%}
  {%- for call in m.tool_calls | default([]) -%}
    <call name="{{ call.function.name }}">{{ render_args(call.function.arguments) }}</call>
  {%- endfor -%}
  {%- if m.tool_call_id is defined %} (for {{ m.tool_call_id }}){% endif -%}
  {%- if loop.index > 50 -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{%- set d = dict(a=1, b=2) -%}{{ d.items() | map('first') | join(',') }}
{%- if add_generation_prompt -%}<ASSISTANT>{%- if enable_thinking is defined and not enable_thinking -%}<think></think>
{%- endif -%}{%- endif -%}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 😀 你好"}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
]


@pytest.fixture(scope="module")
def tokenizer(embedded_path):
    return Tokenizer(embedded_path)


@pytest.mark.parametrize("template", ["model", "gemma", "thinking", "kitchen_sink"])
def test_renders_what_transformers_renders(tokenizer, template):
    """The text equals HF apply_chat_template's for the embedded model's own template and others, with tools, tool
    calls, reasoning, None values and template variables; where HF's render fails (a template reading a missing
    content), so does ours."""
    original = tokenizer.hf.chat_template
    tokenizer.hf.chat_template = {"model": original, "gemma": GEMMA, "thinking": THINKING_TEMPLATE,
                                  "kitchen_sink": KITCHEN_SINK}[template]
    try:
        for messages in CONVERSATIONS:
            if template == "gemma" and messages[-1]["role"] == "tool":
                continue  # Gemma's template refuses roles other than user / assistant (tested below)
            for tools, kwargs, prompt in ((None, {}, True), (TOOLS, {"enable_thinking": False}, True),
                                          (None, {}, False)):
                try:
                    expected = tokenizer.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                                                tokenize=False, **kwargs)
                except Exception as exc:
                    with pytest.raises(SandboxRefused, match=re.escape(str(exc))):
                        tokenizer.chat_text(messages, prompt, tools, kwargs)
                    continue
                assert tokenizer.chat_text(messages, prompt, tools, kwargs) == expected
    finally:
        tokenizer.hf.chat_template = original


def test_a_template_refusing_the_conversation_says_why(tokenizer):
    original = tokenizer.hf.chat_template
    tokenizer.hf.chat_template = GEMMA
    try:
        with pytest.raises(SandboxRefused, match="Conversation roles must alternate"):
            tokenizer.chat_text([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    finally:
        tokenizer.hf.chat_template = original


# The findings and their kin: each stopped with its reason, long before the worker's kill where a check sees
# it, at the kill (budget + grace) where none can (a loop over a string runs no hook).
HOSTILE = {
    "power": ("{{ (messages|length+6) ** (messages[-1].content|length*1000000) }}", "integer of over"),
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "time budget"),
    "string doubling": ("{% set ns = namespace(s=messages[-1].content) %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "over 8388608"),
    "repetition": ("{{ messages[-1].content * 100000000 }}", "repeated a value"),
    "exponential macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "time budget"),
    "deep recursion": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    "huge field": ("{{ '%999999999d' % 1 }}", "wider than"),
    "huge filter": ("{{ 'x' | center(2000000000) }}", "memory budget"),
    "loop without hooks": ("{% set s = 'ab' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
                           "was stopped"),
    "output size": ("{% for i in range(100000) %}{{ messages[-1].content * 100 }}{% endfor %}", "output passed"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_stop_with_their_reason(name):
    template, reason = HOSTILE[name]
    rss = psutil.Process().memory_info().rss
    start = time.monotonic()
    with pytest.raises(SandboxRefused, match=reason):
        render_template(template, {"messages": [{"role": "user", "content": "hello"}]}, time_budget_s=0.5)
    assert time.monotonic() - start < 0.5 + GRACE_S + 1.0
    assert psutil.Process().memory_info().rss < rss + (64 << 20)  # the work happened elsewhere
    assert render_template("{{ 1 + 1 }}", {}) == "2"  # and the pool still serves


def test_cancel_kills_the_worker_at_once():
    """A render whose caller cancels (its client left) stops at the next poll: its worker is killed, not left
    running to its budget."""
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    token = CANCEL.set(cancel)
    start = time.monotonic()
    try:
        with pytest.raises(SandboxCancelled):
            render_template(HOSTILE["loop without hooks"][0], {}, time_budget_s=30)
    finally:
        CANCEL.reset(token)
    assert time.monotonic() - start < 1.5
    assert render_template("{{ 'ok' }}", {}) == "ok"


def test_a_crashed_worker_fails_its_job_only():
    """A worker that dies mid-job (killed here with SIGSEGV, as a native crash would) fails that job with a
    SandboxRefused naming the signal; the next job gets a fresh worker."""
    result: list[BaseException] = []

    def render() -> None:
        try:
            render_template(HOSTILE["loop without hooks"][0], {}, time_budget_s=30)
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=render)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the worker that took the job: a sandbox worker no longer idle
        idle = {worker.process.pid for worker in pool.pool()._idle}
        busy = [p for p in psutil.Process().children() if p.pid not in idle
                and "kvforge.core.sandbox.worker" in " ".join(p.cmdline())]
        if busy:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # into the render
    os.kill(busy[0].pid, signal.SIGSEGV)
    thread.join(10)
    assert isinstance(result[0], SandboxRefused) and "crashed the sandbox worker (signal 11)" in str(result[0])
    assert render_template("{{ 'ok' }}", {}) == "ok"
    assert pool.pool()._started <= pool.WORKERS


def test_grammars_past_the_limits_are_refused_and_deep_ones_compile(embedded_llm):
    """The issue's crash (3000 chained rules killed the server inside llguidance) compiles on the compile stack;
    the deepest chain that fits the text limit too; past the limit: refused before compiling."""
    from kvforge.core.constraint import Constraint, InvalidConstraint

    compiler = embedded_llm.engine.grammars
    chained = "start: r0\n" + "".join(f'r{i}: r{i + 1} r{i + 1} | "z"\n' for i in range(3000)) + 'r3000: "z"\n'
    compiler.compile(Constraint.grammar(chained))
    symbols = string.ascii_lowercase + string.digits + "_"

    def name(i: int) -> str:  # the shortest distinct rule names: the most nesting per character
        return "r" + symbols[i // 1369 % 37] + symbols[i // 37 % 37] + symbols[i % 37]

    levels = min(MAX_GRAMMAR_CHARS // 10 - 10, 37 ** 3 - 2)
    deepest = f"start: {name(0)}\n" + "".join(f"{name(i)}:{name(i + 1)}\n" for i in range(levels)) + \
        f'{name(levels)}:"z"\n'
    assert len(deepest) <= MAX_GRAMMAR_CHARS
    compiler.compile(Constraint.grammar(deepest))
    with pytest.raises(InvalidConstraint, match="over the limit"):
        compiler.compile(Constraint.grammar(deepest + "x" * MAX_GRAMMAR_CHARS))
    with pytest.raises(InvalidConstraint, match="unknown name"):
        compiler.compile(Constraint.grammar("start: nowhere"))


# --- fuzz: generated templates within the limits never fail any other way, and never run long -------------------

def _expressions():
    leaves = st.sampled_from(["1", "7", "-3", "2.5", "'ab'", "messages|length", "messages[-1].content",
                              "range(50)|list", "ns.v", "loop_index"])
    return st.recursive(leaves, lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "**", "//", "%", "~", "==", "and"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda e: f"({e})|string|length"),
        inner.map(lambda e: f"({e})|tojson")), max_leaves=6)


def _statements():
    leaf = st.one_of(_expressions().map(lambda e: "{{ " + e + " }}"),
                     _expressions().map(lambda e: "{% set ns.v = " + e + " %}"),
                     st.sampled_from(["text", "{{ raise_exception('no') }}", "{% break %}"]))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.tuples(st.integers(0, 3000), st.lists(inner, max_size=3)).map(
            lambda t: "{% for loop_index in range(" + str(t[0]) + ") %}" + "".join(t[1]) + "{% endfor %}"),
        st.tuples(_expressions(), st.lists(inner, max_size=3)).map(
            lambda t: "{% if " + t[0] + " %}" + "".join(t[1]) + "{% endif %}")), max_leaves=8)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.lists(_statements(), min_size=1, max_size=4))
def test_fuzzed_templates_render_or_are_refused(body):
    template = "{% set ns = namespace(v=0) %}{% set loop_index = 0 %}" + "".join(body)
    start = time.monotonic()
    try:
        text = render_template(template, {"messages": [{"role": "user", "content": "hi"}]}, time_budget_s=0.3)
        assert isinstance(text, str)
    except SandboxRefused:
        pass
    assert time.monotonic() - start < 0.3 + GRACE_S + 1.0
