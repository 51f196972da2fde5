"""IncrementalDetokenizer and chat template rendering on the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from kvforge.core.tokenizer import IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"
EMOJI = "🎉🚀 👩‍👩‍👧"
CJK = "今天天气很好"
ACCENTED = "Café naïve résumé Ångström, Zürich, façade, São Paulo"
CODE = ('def fib(n: int) -> int:\n    """Return the n-th number."""\n'
        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
MIXED = f"Weather: {CJK}! {EMOJI} — {ACCENTED}\n```python\n{CODE}```"
TEXTS = [EMOJI, CJK, ACCENTED, CODE, MIXED]


@pytest.fixture(scope="module")
def tokenizer(embedded_path):
    return Tokenizer(embedded_path)


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = tokenizer.detokenizer(skip_special_tokens)
    assert isinstance(detok, IncrementalDetokenizer)
    deltas = [detok.step(i) for i in ids]
    return deltas, detok.text


@pytest.mark.parametrize("text", TEXTS, ids=["emoji", "cjk", "accented", "code", "mixed"])
def test_streamed_deltas_are_valid_text_and_add_up(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, total = stream(tokenizer, ids)
    assert len(deltas) == len(ids)
    for i, delta in enumerate(deltas):
        assert isinstance(delta, str)
        assert REPLACEMENT not in delta, f"delta {i} carries half a character: {delta!r}"
        delta.encode("utf-8")  # a lone surrogate would raise here
    assert "".join(deltas) == total
    assert total == tokenizer.decode(ids)
    assert total == text


@pytest.mark.parametrize("text", [EMOJI, CJK, ACCENTED], ids=["emoji", "cjk", "accented"])
def test_texts_really_use_byte_fallback_tokens(tokenizer, text):
    """Without tokens that are only part of a character, the test above would prove nothing."""
    ids = tokenizer.encode(text)
    partial = [i for i in ids if REPLACEMENT in tokenizer.decode([i])]
    assert partial, f"no token of {text!r} decodes to U+FFFD alone: {ids}"
    # ...and a naive per-token decode would leak replacement characters into the stream
    assert REPLACEMENT in "".join(tokenizer.decode([i]) for i in ids)


def test_some_deltas_are_held_back_until_the_character_is_complete(tokenizer):
    ids = tokenizer.encode(EMOJI)
    deltas, _ = stream(tokenizer, ids)
    assert "" in deltas  # an incomplete character yields nothing yet
    assert any(d.strip() for d in deltas)


def test_detokenizers_are_independent(tokenizer):
    a_ids, b_ids = tokenizer.encode(EMOJI), tokenizer.encode(CJK)
    a, b = tokenizer.detokenizer(), tokenizer.detokenizer()
    for i in range(max(len(a_ids), len(b_ids))):  # interleaved, as in a batch
        if i < len(a_ids):
            a.step(a_ids[i])
        if i < len(b_ids):
            b.step(b_ids[i])
    assert a.text == EMOJI
    assert b.text == CJK


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Hi {EMOJI}"}])
    _, skipped = stream(tokenizer, ids, skip_special_tokens=True)
    _, kept = stream(tokenizer, ids, skip_special_tokens=False)
    assert "<|im_start|>" not in skipped
    assert skipped == tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>user" in kept
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)
    assert EMOJI in skipped and EMOJI in kept


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages)
    assert ids and all(isinstance(i, int) for i in ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    # the markers are single special tokens, not spelled out character by character
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_start) == text.count("<|im_start|>")
    assert ids.count(im_end) == text.count("<|im_end|>")
    # the rendered template is not wrapped in extra BOS/EOS tokens
    assert ids[0] == im_start


def test_chat_template_without_generation_prompt_and_multi_turn(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    with_prompt = tokenizer.apply_chat_template(messages)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    text = tokenizer.decode(without, skip_special_tokens=False)
    assert not text.rstrip().endswith("<|im_start|>assistant")
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<|im_start|>assistant\nHello!<|im_end|>" in text
    assert with_prompt[: len(without)] == without  # prefix-stable: the generation prompt only appends
    # turn N's prompt is a prefix of turn N+1's (what prefix caching relies on)
    shorter = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False)
    assert without[: len(shorter)] == shorter


def test_eos_ids_include_im_end(tokenizer):
    assert tokenizer.hf.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
