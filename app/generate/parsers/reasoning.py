"""Reasoning separated from the answer, for models that think in `<think>...</think>` (DeepSeek-R1 distills, Qwen3,
QwQ): the think block becomes OpenAI's `reasoning_content`, the text after it `content`.

Reading of an output:
- a think block is recognised only at the start of the output (after leading whitespace), or is already open when
  the prompt ended inside one (`starts_in_reasoning`); a `<think>` later in the answer is answer text;
- reasoning is the text up to the first `</think>`, with its leading newlines dropped; None when empty;
- content is the text after `</think>` with its leading newlines dropped (the "\\n\\n" these models put after the
  marker, as vLLM's reasoning parsers leave the content starting after it); None when the output ended inside the
  reasoning (no `</think>`).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from kvforge.app.generate.parsers.stream_text import partial_marker_length

_NEWLINES = "\r\n"


@dataclass(frozen=True)
class ReasoningSyntax:
    """The markers of a model's think block."""

    start: str = "<think>"
    end: str = "</think>"


def detect_reasoning(chat_template: str | None, vocab: Container[str] | Callable[[str], bool],
                     syntax: ReasoningSyntax = ReasoningSyntax()) -> ReasoningSyntax | None:
    """`syntax` when the model reasons: its template mentions the end marker, or its vocabulary (a set of token
    strings, or a callable saying whether a string is one token) has both markers; None otherwise."""
    has_token = vocab if callable(vocab) else vocab.__contains__
    if syntax.end in (chat_template or "") or (has_token(syntax.start) and has_token(syntax.end)):
        return syntax
    return None


def starts_in_reasoning(rendered_prompt_text: str, syntax: ReasoningSyntax = ReasoningSyntax()) -> bool:
    """Whether generation begins inside the think block: templates such as DeepSeek-R1's end the generation prompt
    with `<think>\\n`, so the output has no open marker. A prompt ending with a closed (e.g. Qwen3's empty
    `<think>\\n\\n</think>\\n\\n` with enable_thinking=False) or no block starts in the answer."""
    return rendered_prompt_text.rstrip().endswith(syntax.start)


def split_reasoning(text: str, starts_inside: bool,
                    syntax: ReasoningSyntax = ReasoningSyntax()) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, read as the module docstring says."""
    if starts_inside:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(syntax.start):
            return None, text
        body = stripped[len(syntax.start):]
    reasoning, closed, after = body.partition(syntax.end)
    return reasoning.lstrip(_NEWLINES) or None, after.lstrip(_NEWLINES) if closed else None


class ReasoningStream:
    """Streamed output -> (reasoning delta, content delta) pairs, for any split the same as `split_reasoning` of the
    whole. Only a possible partial marker at the tail is held back (and, at the very start, whitespace before a
    possible `<think>`)."""

    _UNDECIDED, _REASONING, _CONTENT = "undecided", "reasoning", "content"

    def __init__(self, starts_inside: bool, syntax: ReasoningSyntax = ReasoningSyntax()) -> None:
        self._syntax = syntax
        self._state = self._REASONING if starts_inside else self._UNDECIDED
        self._buffer = ""
        self._at_section_start = True  # a section's leading newlines are dropped
        self._strip_content = False  # only content after a think block loses its leading newlines

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside the think block: after finish(), that the content is None."""
        return self._state == self._REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == self._UNDECIDED:
            stripped = self._buffer.lstrip()
            if stripped.startswith(self._syntax.start):
                self._buffer = stripped[len(self._syntax.start):]
                self._state = self._REASONING
            elif final or not self._syntax.start.startswith(stripped):
                self._state = self._CONTENT
            else:
                return "", ""  # only space, or a start marker still arriving
        if self._state == self._REASONING:
            end = self._buffer.find(self._syntax.end)
            if end < 0:
                keep = 0 if final else partial_marker_length(self._buffer, self._syntax.end)
                cut = len(self._buffer) - keep
                reasoning = self._section_text(self._buffer[:cut], _NEWLINES)
                self._buffer = self._buffer[cut:]
                return reasoning, ""
            reasoning = self._section_text(self._buffer[:end], _NEWLINES)
            self._buffer = self._buffer[end + len(self._syntax.end):]
            self._state, self._at_section_start, self._strip_content = self._CONTENT, True, True
        content = self._section_text(self._buffer, _NEWLINES if self._strip_content else "")
        self._buffer = ""
        return reasoning, content

    def _section_text(self, text: str, leading: str) -> str:
        """`text` without the section's leading `leading` characters, while the section has released nothing."""
        if self._at_section_start:
            text = text.lstrip(leading)
            self._at_section_start = not text
        return text
