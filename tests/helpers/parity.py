"""Greedy parity with HF transformers `generate`, with the one tolerated difference: at a position
where HF's two best logits are within TIE_TOLERANCE, a different pick ends that prompt's comparison
(fp32 rounding differs between batch shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_TOLERANCE = 1e-3


@dataclass
class ParityReport:
    exact: int
    near_ties: list[str]

    def __str__(self) -> str:
        return f"{self.exact} exact, {len(self.near_ties)} near-tie divergences: {self.near_ties}"


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: set[int]):
    """Run HF generate on the whole batch at once (left padding); return per-prompt generated ids
    (cut after the first EOS) and per-step logits [steps][vocab]."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=pad_id, eos_token_id=sorted(eos_ids))
    ids, logits = [], []
    for row in range(len(prompts)):
        generated = out.sequences[row, width:].tolist()
        cut = next((i + 1 for i, t in enumerate(generated) if t in eos_ids), len(generated))
        ids.append(generated[:cut])
        logits.append([step[row].float() for step in out.logits[:cut]])
    return ids, logits


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where `a` and `b` differ (the shorter one's length where it is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ours: list[list[int]], theirs: list[list[int]], their_logits) -> ParityReport:
    exact, ties = 0, []
    for row, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            exact += 1
            continue
        pos = first_divergence(a, b)
        assert pos < min(len(a), len(b)), f"prompt {row}: one output is a prefix of the other: {a} vs {b}"
        top2 = their_logits[row][pos].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_TOLERANCE, (
            f"prompt {row}: token {pos} differs ({a[pos]} vs HF {b[pos]}) and HF's top-2 gap is {gap:.2e}\n"
            f"ours: {a}\nHF:   {b}")
        ties.append(f"prompt {row} at token {pos} (gap {gap:.1e})")
    return ParityReport(exact, ties)


def logprobs_close(ours: list[int], our_top: list[set[int]], theirs: list[int], their_top: list[set[int]],
                   name: str = "") -> str | None:
    """vLLM's `check_logprobs_close` rule for approximate models (reduced precision, quantized against fp32):
    at the first divergence, each side's token is among the other's top-k. Returns why it fails, or None."""
    if not ours or not theirs:
        return f"{name}: an empty output: {ours} vs {theirs}"
    pos = first_divergence(ours, theirs)
    if pos == min(len(ours), len(theirs)):
        return None
    a, b = ours[pos], theirs[pos]
    if a not in their_top[pos] or b not in our_top[pos]:
        return f"{name}: at position {pos} tokens {a} / {b} are not in each other's top-{len(our_top[pos])}"
    return None  # the first divergence is within the top-k: the rule stops comparing here


def same_or_near_tie(ours: list[int], reference, name: str = "") -> str | None:
    """`ours` equals `reference` (an LLM output, greedy, with logprobs) or passes the one-sided form of vLLM's rule,
    for outputs whose own top-k we do not have (a server's): at the first divergence our token is among the
    reference's top-k, a near-tie rounded the other way. For reduced precision; fp32 asks for equality.
    Returns why it fails, or None."""
    theirs = reference.token_ids
    if ours == theirs:
        return None
    pos = first_divergence(ours, theirs)
    if pos == min(len(ours), len(theirs)):
        return f"{name}: one output is a prefix of the other: {ours} vs {theirs}"
    top = {t for t, _ in reference.logprobs[pos].top}
    if ours[pos] not in top:
        return f"{name}: at position {pos} token {ours[pos]} is not in the reference's top-{len(top)} {sorted(top)}"
    return None
