"""Grammar compilation that cannot take the server with it.

llguidance (native code) compiles a grammar recursively: a Lark grammar of 3000 chained rules (72 KB) overflows an
8 MiB thread stack and the process dies with SIGSEGV (~3 KB of stack per nesting level, measured on AMD EPYC Zen 2).
So: (1) limits before compiling -- the grammar's text (MAX_GRAMMAR_CHARS) and llguidance's own parser limits
(PARSER_LIMITS); (2) every compile runs on a thread whose stack holds the deepest grammar within that text limit
(COMPILE_STACK_BYTES: 64k levels fit about 3x over); (3) a grammar the server has not seen is first compiled, and its
first token mask computed, in a sandbox worker process on the same stack size (core/sandbox/pool.py), so a crash the
limits did not foresee kills the worker and the request gets a 400; only then is it compiled in the server, where the
same input on the same stack compiles the same way.

Imported by the sandbox worker: standard library only at import time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

MAX_GRAMMAR_CHARS = 512 << 10  # the grammar llguidance compiles (a schema's, a tool call's, a request's Lark)
COMPILE_STACK_BYTES = 512 << 20  # reserved, not committed: only the pages a compile touches take memory
# llguidance's ParserLimits, explicit (their defaults, and a smaller total grammar): bounded time per compile and
# per token step. Their units: grammar symbols, lexer "fuel" (~14-50k per ms), Earley items (~20k per ms).
PARSER_LIMITS = {"max_grammar_size": 200_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                 "step_max_items": 50_000, "max_lexer_states": 250_000, "max_items_in_row": 2000,
                 "verbose_errors": False}

T = TypeVar("T")
_STACK_LOCK = threading.Lock()


class GrammarTooLarge(ValueError):
    pass


def check_size(grammar: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar is {len(grammar)} characters, over the limit of {MAX_GRAMMAR_CHARS}")


def parser_limits():
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


def on_compile_stack(fn: Callable[[], T]) -> T:
    """fn() on a fresh thread with COMPILE_STACK_BYTES of stack (the caller waits; exceptions pass through)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            result.append((False, exc))

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only for this thread's creation
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def compile_matcher(lltokenizer, grammar: str):
    """An LLMatcher for `grammar` (llguidance's JSON or Lark form), compiled within the limits on the big stack.
    Errors are the matcher's (is_error / get_error), as llguidance reports them."""
    from llguidance import LLMatcher

    check_size(grammar)
    return on_compile_stack(lambda: LLMatcher(lltokenizer, grammar, log_level=0, limits=parser_limits()))


def trial_compile(lltokenizer, grammar: str) -> str | None:
    """What the sandbox worker runs: the matcher compiled and its first mask computed; None when it compiles, else
    llguidance's error."""
    matcher = compile_matcher(lltokenizer, grammar)
    if matcher.is_error():
        return matcher.get_error()
    on_compile_stack(matcher.compute_bitmask)
    return matcher.get_error() if matcher.is_error() else None
