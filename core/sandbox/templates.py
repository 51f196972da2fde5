"""Chat templates rendered with bounded work: a model file's Jinja template is code from whoever made the file.

HF transformers renders templates in Jinja's ImmutableSandboxedEnvironment, which stops file and attribute access
but not work: `{{ 9 ** 9 ** 9 }}`, nested `range` loops and string doubling run for minutes or fill memory, and a
Python thread cannot be stopped. So the render runs in a sandbox worker process (core/sandbox/pool.py: killed past
its time budget, its memory capped by RLIMIT_AS) in this environment: HF's (same options, filters and globals, so a
template renders the same text: tests/core/test_template_sandbox.py compares them) plus cheap checks that turn the
common runaways into a clear error before the budget runs out: big-integer powers, repetition of strings and lists
past the output cap, a string past that cap read by the template, the output's size, and the deadline at every
attribute, item, call and operator. Written here, not taken from transformers, because its environment is built
inside a private, cached function with no hook for these checks.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 8 << 20  # a rendered prompt, and any one string or list a template builds on its way
MAX_INT_BITS = 4096  # an integer a template computes (powers and products); chat templates count, they do not crypt
TIME_BUDGET_S = 2.0  # one render; the largest request the server takes renders in ~0.08 s (docs/MEASUREMENTS.md)


_FORMAT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")  # a printf-style field: its width and precision


class TemplateLimit(TemplateError):
    """A render stopped by one of the limits; the message says which."""


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF's marker around assistant text (for training masks). A prompt
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class TemplateDict:
    """HF's `dict` global: builds dicts without exposing the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """HF's `namespace` global: no underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        _check_size(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's: no HTML escaping (Jinja's own tojson escapes <, >, &, ')
    if isinstance(indent, int) and indent > 64:
        raise TemplateLimit(f"tojson: indent {indent} is over 64")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _check_size(value: Any) -> None:
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_OUTPUT_CHARS:
        raise TemplateLimit(f"the chat template built a value of {len(value)} items, over {MAX_OUTPUT_CHARS}")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"the chat template computed an integer of over {MAX_INT_BITS} bits")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """HF's chat-template environment with the deadline and size checks of the module's docstring."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=TemplateDict(),
                            namespace=TemplateNamespace)
        self.deadline = float("inf")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template ran past its time budget of {TIME_BUDGET_S:g} s")

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        self.tick()
        if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 \
                and right * max(1, abs(left).bit_length() - 1) > MAX_INT_BITS:
            raise TemplateLimit(f"the chat template computed an integer of over {MAX_INT_BITS} bits")
        if op == "%" and isinstance(left, str) and any(int(n) > MAX_OUTPUT_CHARS for spec in _FORMAT_SPEC.finditer(left)
                                                       for n in spec.groups() if n):
            raise TemplateLimit(f"the chat template formatted a field wider than {MAX_OUTPUT_CHARS} characters")
        if op == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > MAX_OUTPUT_CHARS:
                raise TemplateLimit(f"the chat template repeated a value to over {MAX_OUTPUT_CHARS} items")
        result = super().call_binop(context, op, left, right)
        _check_size(result)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        value = super().getattr(obj, attribute)
        _check_size(value)
        return value

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        value = super().getitem(obj, argument)
        _check_size(value)
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature: no clash with kwargs)
        __self.tick()
        for value in (*args, *kwargs.values()):
            _check_size(value)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(result)
        return result


_ENVIRONMENT: BoundedEnvironment | None = None
_COMPILED: dict[str, jinja2.Template] = {}
_COMPILED_KEEP = 16  # templates kept compiled (a server holds a few models)


def render(template: str, context: dict[str, Any], time_budget_s: float = TIME_BUDGET_S) -> str:
    """`template` rendered with `context` (its variables: messages, tools, add_generation_prompt, the special
    tokens...); TemplateError (TemplateLimit past a limit) when the template fails or refuses the conversation."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        _ENVIRONMENT = BoundedEnvironment()
    env = _ENVIRONMENT
    compiled = _COMPILED.get(template)
    if compiled is None:
        compiled = env.from_string(template)
        if len(_COMPILED) >= _COMPILED_KEEP:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[template] = compiled
    env.deadline = time.monotonic() + time_budget_s
    try:
        parts, size = [], 0
        for part in compiled.generate(**context):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimit(f"the chat template's output passed {MAX_OUTPUT_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except RecursionError:
        raise TemplateLimit("the chat template recursed too deeply") from None
    except (OverflowError, ZeroDivisionError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise TemplateError(f"{type(exc).__name__}: {exc}") from None
    finally:
        env.deadline = float("inf")

