"""Per-step batch metadata, set once by the model runner and read by every attention layer.

A step is one flat batch: the new tokens of all scheduled sequences laid end to end (prefill
chunks and single decode tokens mixed), with no padding between sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepContext:
    positions: torch.Tensor  # [tokens] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [tokens] KV-cache slot each new token's K/V is written to
    query_start_loc: list[int]  # [seqs + 1] where each sequence's new tokens start in the flat batch
    seq_lens: list[int]  # [seqs] context length after this step (cached + new tokens)
    context_slots: list[torch.Tensor]  # [seqs] slots of each sequence's whole context, in order
    block_tables: torch.Tensor | None = None  # [seqs, max_blocks] (-1 padded), for paged kernels
    # attention masks per sequence, keyed by sliding-window size (see layers/attention.py)
    masks: dict[int | None, list] = field(default_factory=dict)


_context: StepContext | None = None


def set_context(context: StepContext | None) -> None:
    global _context
    _context = context


def get_context() -> StepContext:
    if _context is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _context
