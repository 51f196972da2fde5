"""Per-step batch metadata, set once by the model runner and read by every attention layer.

A step is one flat batch: the new tokens of all scheduled sequences laid end to end (prefill
chunks and single decode tokens mixed), with no padding between sequences. Attention handles
prefill chunks one sequence at a time and decode tokens in groups of similar context length
(the runner lays decode tokens first, sorted by context length, so each group is a row range).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    start: int  # first row of this chunk in the flat batch
    end: int
    context_len: int  # cached + new tokens
    context_slots: torch.Tensor  # [context_len] KV slots of the whole context, in order


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the flat batch, one new token each
    end: int
    slots: torch.Tensor  # [g, max_len] KV slots of each context, padded with slot 0
    lengths: torch.Tensor  # [g] context lengths
    max_len: int
    uniform: bool  # all lengths equal: no padding mask needed


@dataclass
class StepContext:
    positions: torch.Tensor  # [tokens] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [tokens] KV-cache slot each new token's K/V is written to
    prefills: list[PrefillSeq]
    decode_groups: list[DecodeGroup]
    num_tokens: int
    # masks shared by all layers, built on first use, keyed by (kind, index, sliding window)
    masks: dict = field(default_factory=dict)


_context: StepContext | None = None


def set_context(context: StepContext | None) -> None:
    global _context
    _context = context


def get_context() -> StepContext:
    if _context is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _context
