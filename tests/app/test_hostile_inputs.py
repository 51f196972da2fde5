"""Issue 40, findings 1 and 3: grammars and chat templates -- code a request or a model file hands the server -- can
neither crash it, nor hold its event loop, nor run on for a client that left. Against real `kvforge serve` processes:
the README's default server for the grammar that crashed it, and one serving a tiny model (fast steps for the fuzzing)
whose chat template turns hostile on request (`chat_template_kwargs: {"mode": ...}`; a template reaches the server
with any model file). /health is watched from a thread throughout: it answers in under a second."""

from __future__ import annotations

import json
import string
import threading
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.core.sandbox.grammars import MAX_GRAMMAR_CHARS
from kvforge.core.sandbox.pool import GRACE_S
from kvforge.core.sandbox.templates import TIME_BUDGET_S
from tests.helpers.health_watch import HealthWatch
from tests.helpers.server_process import ServeProcess
from tests.helpers.tiny_models import save_tiny_model

# ChatML, after a hostile prelude chosen by the request (the findings; "spin" runs no sandbox hook at all: only
# the worker's kill stops it)
HOSTILE_TEMPLATE = (
    "{%- if mode == 'power' -%}{{ (messages|length + 6) ** (messages[-1].content|length * 1000000) }}"
    "{%- elif mode == 'ranges' -%}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- elif mode == 'doubling' -%}{% set ns = namespace(s=messages[-1].content) %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    "{%- elif mode == 'spin' -%}{% set s = 'ab' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}"
    "{%- endif -%}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")
TEMPLATE_S = TIME_BUDGET_S + GRACE_S + 2  # the budget, the kill's grace, and room for a busy machine


@pytest.fixture(scope="module")
def templated(tmp_path_factory, embedded_path):
    model = tmp_path_factory.mktemp("model") / "hostile-template"
    save_tiny_model("llama3", model, embedded_path, seed=7)
    (model / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    process = ServeProcess("--model", str(model), "--no-ui", "--data-dir", str(tmp_path_factory.mktemp("data")))
    process.health = HealthWatch(process.url)
    yield process
    process.health.stop()
    process.stop()
    assert process.health.slowest < 1.0, f"/health took {process.health.slowest:.2f} s"


def chat(server, mode: str | None = None, timeout: float = 30, content: str = "hello") -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    if mode:
        body["chat_template_kwargs"] = {"mode": mode}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


@pytest.mark.parametrize("mode, reason", [("power", "integer of over"), ("ranges", "time budget"),
                                          ("doubling", "built a value"), ("spin", "was stopped")])
def test_hostile_templates_get_a_400_naming_why(templated, mode, reason):
    rss = psutil.Process(templated.process.pid).memory_info().rss
    start = time.monotonic()
    response = chat(templated, mode)
    assert time.monotonic() - start < TEMPLATE_S
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and reason in error["message"], error
    assert psutil.Process(templated.process.pid).memory_info().rss < rss + (100 << 20)  # the worker's, not ours
    assert chat(templated).status_code == 200


def test_renders_a_client_left_are_stopped(templated):
    """Ten clients send a template that only the worker's kill stops, and leave after half a second: their renders
    are cancelled with them, so a chat sent next is answered at once -- not after the 10 x 3 s the two workers
    would otherwise spend on nobody's renders."""
    def leave_early() -> None:
        try:
            chat(templated, "spin", timeout=0.5)
        except httpx.TimeoutException:
            pass

    clients = [threading.Thread(target=leave_early) for _ in range(10)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    start = time.monotonic()
    assert chat(templated).status_code == 200
    assert time.monotonic() - start < 2.5


# --- grammars ------------------------------------------------------------------------------------------------------

def complete(server, constraint: dict, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0, "structured_outputs": constraint})


def test_the_grammar_that_crashed_the_server(readme_server):
    """3000 chained rules (72 KB) killed the server with SIGSEGV inside llguidance: now it compiles and is honoured;
    one over the size limit is refused naming the field; the server lives on."""
    chained = "start: r0\n" + "".join(f'r{i}: r{i + 1} r{i + 1} | "z"\n' for i in range(3000)) + 'r3000: "z"\n'
    response = complete(readme_server, {"grammar": chained})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "z"
    too_large = complete(readme_server, {"grammar": 'start: "' + "a" * MAX_GRAMMAR_CHARS + '"'})
    assert too_large.status_code == 400
    assert too_large.json()["error"]["param"] == "structured_outputs"
    assert "over the limit" in too_large.json()["error"]["message"]
    assert readme_server.process.poll() is None


def _lark_grammars():
    """Lark grammars of a few rules that may refer to each other (recursion included), literals, regexes, inline
    JSON schemas, repetition and groups; sometimes with a character broken (an invalid grammar)."""
    names = [f"r{i}" for i in range(5)]
    atom = st.one_of(st.text(alphabet="abz{}[]:, ", min_size=1, max_size=4).map(json.dumps),
                     st.sampled_from(names),
                     st.sampled_from(["/[a-z]+/", "/[0-9]{1,3}/", '%json {"type": "integer"}', '%json {"type": '
                                      '"object", "properties": {"a": {"type": "string"}}}', "/(a|b)*c?/"]))
    item = st.tuples(atom, st.sampled_from(["", "", "*", "+", "?"])).map("".join)
    sequence = st.lists(item, min_size=1, max_size=4).map(" ".join)
    group = st.lists(sequence, min_size=1, max_size=3).map(lambda alts: "(" + " | ".join(alts) + ")")
    alternative = st.lists(st.one_of(sequence, group), min_size=1, max_size=3).map(" | ".join)

    @st.composite
    def grammar(draw):
        rules = draw(st.lists(alternative, min_size=len(names), max_size=len(names)))
        text = "start: r0\n" + "".join(f"{name}: {rule}\n" for name, rule in zip(names, rules))
        if draw(st.booleans()) and draw(st.booleans()):
            at = draw(st.integers(0, len(text) - 1))
            text = text[:at] + draw(st.sampled_from(list(string.punctuation))) + text[at + 1:]
        return text

    return grammar()


def _json_schemas():
    leaf = st.one_of(st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
                                      {"type": "number", "minimum": 0}, {"enum": ["a", 1, None]},
                                      {"type": "string", "pattern": "^[a-c]{1,3}$"}, {"$ref": "#"}, {}, {"not": {}},
                                      {"type": "string", "minLength": 5, "maxLength": 2}]))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=2), inner, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": list(props)[:1]}),
        inner.map(lambda items: {"type": "array", "items": items, "maxItems": 2}),
        st.lists(inner, min_size=1, max_size=3).map(lambda options: {"anyOf": options})), max_leaves=8)


def assert_served_or_refused(server, response: httpx.Response) -> None:
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "structured_outputs"
    assert httpx.get(f"{server.url}/health", timeout=1).status_code == 200


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grammar=_lark_grammars())
def test_fuzzed_lark_grammars_never_take_the_server_down(templated, grammar):
    assert_served_or_refused(templated, complete(templated, {"grammar": grammar}))


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_json_schemas())
def test_fuzzed_json_schemas_never_take_the_server_down(templated, schema):
    assert_served_or_refused(templated, complete(templated, {"json": schema}))
