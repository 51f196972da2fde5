"""Reasoning separation (app/generate/parsers/reasoning.py): which models think, where their output starts, and the
split of
`<think>...</think>` from the answer, whole and streamed (any split of the stream gives the whole-text split)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.app.generate.parsers.reasoning import (
    ReasoningStream,
    ReasoningSyntax,
    detect_reasoning,
    split_reasoning,
    starts_in_reasoning,
)

THINK = ReasoningSyntax()

# excerpts of real templates: Qwen3 strips earlier turns' reasoning by the end marker; SmolLM2 is plain ChatML
QWEN3_TEMPLATE = ("{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0] %}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>' + '\\n'}}{% endfor %}")

QWEN3_OUTPUT = ("<think>\nOkay, the user asks for the capital of France. That is Paris.\n</think>\n\n"
                "The capital of France is **Paris**.")
R1_OUTPUT = ("Okay, so I need to add 2 and 3. 2 + 3 = 5.\nWait, let me double-check: yes, 5.\n</think>\n\n"
             "2 + 3 = **5**.")


def test_detect_reasoning_from_template_or_vocabulary():
    assert detect_reasoning(QWEN3_TEMPLATE, set()) == THINK
    assert detect_reasoning(None, {"<think>", "</think>", "hello"}) == THINK
    assert detect_reasoning(CHATML_TEMPLATE, lambda token: token in ("<think>", "</think>")) == THINK
    assert detect_reasoning(CHATML_TEMPLATE, {"<think>", "hello"}) is None  # one marker is not a think block
    assert detect_reasoning(CHATML_TEMPLATE, {"hello"}) is None
    assert detect_reasoning(None, set()) is None


def test_detect_reasoning_on_the_embedded_model(embedded_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_path)
    assert detect_reasoning(tok.chat_template, tok.get_vocab()) is None


def test_detect_reasoning_with_other_markers():
    seed = ReasoningSyntax("<seed:think>", "</seed:think>")
    assert detect_reasoning("... '</seed:think>' ...", set(), seed) == seed
    assert detect_reasoning("... '</seed:think>' ...", set()) is None


@pytest.mark.parametrize("prompt, inside", [
    ("<｜User｜>What is 2 + 3?<｜Assistant｜><think>\n", True),  # DeepSeek-R1's generation prompt
    ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, no thinking
    ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),  # Qwen3 thinking: the model opens the block
    ("<|im_start|>user\nWhat does <think> mean?<|im_end|>\n<|im_start|>assistant\n", False),
])
def test_starts_in_reasoning(prompt, inside):
    assert starts_in_reasoning(prompt) is inside


@pytest.mark.parametrize("text, starts_inside, expected", [
    (QWEN3_OUTPUT, False, ("Okay, the user asks for the capital of France. That is Paris.\n",
                           "The capital of France is **Paris**.")),
    (R1_OUTPUT, True, ("Okay, so I need to add 2 and 3. 2 + 3 = 5.\nWait, let me double-check: yes, 5.\n",
                       "2 + 3 = **5**.")),
    ("\n<think>\nshort</think>answer", False, ("short", "answer")),  # space before the block, none after
    ("<think>\nStill thinking about", False, ("Still thinking about", None)),  # cut off (max_tokens) in the block
    ("Still thinking about", True, ("Still thinking about", None)),
    ("<think>\n\n</think>\n\nHi!", False, (None, "Hi!")),  # an empty block is no reasoning
    ("Hello there.\n", False, (None, "Hello there.\n")),  # no block: the text as it is
    ("  Hello", False, (None, "  Hello")),
    ("Use <think> tags like <think>this</think>.", False, (None, "Use <think> tags like <think>this</think>.")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # the first end marker closes the block
    ("", False, (None, "")),
    ("", True, (None, None)),
    ("<thin", False, (None, "<thin")),
    ("reason</thi", True, ("reason</thi", None)),
])
def test_split_reasoning(text, starts_inside, expected):
    assert split_reasoning(text, starts_inside) == expected


def streamed(text: str, cuts: list[int], starts_inside: bool) -> tuple[str | None, str | None]:
    """The stream's deltas over `text` cut at `cuts`, joined as the server would report them."""
    stream = ReasoningStream(starts_inside)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    outputs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    reasoning = "".join(r for r, _ in outputs)
    content = "".join(c for _, c in outputs)
    return reasoning or None, None if stream.in_reasoning else content


SAMPLES = [
    (QWEN3_OUTPUT, False), (R1_OUTPUT, True), ("<think>\nStill thinking about", False),
    ("\n\n<think>x</think>y", False),
    ("<think>\n\n</think>\n\nHi!", False), ("Hello <think> there </think>", False), ("  <thinking aloud>", False),
    ("a</think>b</think>c", True), ("</thin</think>\r\n\n\nok\n", True), ("<thin", False), ("", True),
]


@pytest.mark.parametrize("text, starts_inside", SAMPLES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_of_the_stream_gives_the_whole_split(text, starts_inside, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    assert streamed(text, cuts, starts_inside) == split_reasoning(text, starts_inside)


@pytest.mark.parametrize("text, starts_inside", SAMPLES)
def test_a_marker_split_at_every_position(text, starts_inside):
    for cut in range(len(text) + 1):
        assert streamed(text, [cut], starts_inside) == split_reasoning(text, starts_inside), cut
    assert streamed(text, list(range(1, len(text))), starts_inside) == split_reasoning(text, starts_inside)


def test_the_stream_holds_back_only_a_possible_marker():
    stream = ReasoningStream(starts_inside=False)
    assert stream.feed("<thi") == ("", "")  # may be the start marker
    assert stream.feed("nk>\nLet me think") == ("Let me think", "")
    assert stream.in_reasoning
    assert stream.feed(" about it.</th") == (" about it.", "")  # "</th" may be the end marker
    assert stream.feed("ink>\n\n") == ("", "")
    assert not stream.in_reasoning
    assert stream.feed("The answer") == ("", "The answer")
    assert stream.feed(" is 5 </") == ("", " is 5 </")  # in the answer nothing is held
    assert stream.finish() == ("", "")


def test_a_stream_without_a_think_block_is_content_at_once():
    stream = ReasoningStream(starts_inside=False)
    assert stream.feed("Hello") == ("", "Hello")
    assert stream.feed(" <think>") == ("", " <think>")
    assert stream.finish() == ("", "")
    assert not stream.in_reasoning


def test_a_stream_cut_off_in_the_reasoning_ends_inside_it():
    stream = ReasoningStream(starts_inside=True)
    assert stream.feed("\nHmm, 2 + 3 </thi") == ("Hmm, 2 + 3 ", "")
    assert stream.finish() == ("</thi", "")
    assert stream.in_reasoning
