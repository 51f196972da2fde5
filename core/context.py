"""Per-step batch metadata, set once by the model runner and read by every attention layer.

A step is one flat batch: the new tokens of all scheduled sequences laid end to end (prefill
chunks and single decode tokens mixed), with no padding between sequences. Attention handles
prefill chunks one sequence at a time and decode tokens in groups of similar context length
(the runner lays decode tokens first, sorted by context length, so each group is a row range).

Index tensors address a layer's KV cache [2 (K, V), kv_heads, blocks, block_size, head_dim]
through 2-D views, because index_select over the first dimension of a 2-D view copies at memcpy
speed (measured ~7x faster here than selecting along an inner dimension):
- `write_rows` index the [2 * kv_heads * slots, head_dim] view, one row per (K/V, head, new token);
- `gather_rows` index the [2 * kv_heads * blocks, block_size * head_dim] view, one row per
  (K/V, head, block), so a gather yields [2, kv_heads, tokens, head_dim] with no further copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvforge.core.kv.quant import KVFormat


@dataclass
class PrefillSeq:
    start: int  # first row of this chunk in the flat batch
    end: int
    context_len: int  # cached + new tokens
    gather_rows: torch.Tensor | None  # the blocks of its whole context; None when nothing was cached
    # the last key position each of its rows sees, where some see past their own (an image attended both ways,
    # core/images.py); None: causal
    key_limits: torch.Tensor | None = None


DECODE_GROUP_SIZE = 8  # decode tokens attended together (a DecodeGroup); similar lengths keep the padding small


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the flat batch, one new token each
    end: int
    gather_rows: torch.Tensor  # each context's blocks, padded to `padded_len` tokens with block 0
    padded_len: int
    lengths: torch.Tensor  # [g] context lengths (<= padded_len)


def gather_rows(plane_blocks: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
    """`gather_rows` of sequences with these block tables (of equal length), ordered (K/V, sequence, head, block):
    a gather yields [2, seqs, kv_heads, tokens, head_dim]. `plane_blocks`: [2, 1, kv_heads, 1], the first row of
    each (K/V, head) plane (plane index * blocks)."""
    blocks = torch.tensor(tables, dtype=torch.long).unsqueeze(2)  # [seqs, blocks, 1]
    return (plane_blocks + blocks.transpose(1, 2)).view(-1)


def block_tables_tensor(tables: list[list[int]]) -> torch.Tensor:
    """int32 [seqs, width] block tables, the short ones padded with block 0."""
    width = max(map(len, tables), default=0)
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32).view(-1, width)


@dataclass
class KernelBatch:
    """The Triton kernels' view of the step (tensors on the model's device). Rows [0, num_decodes) of the
    flat batch are single decode tokens, the prefill chunks follow. Padded rows (CUDA graphs) have slot -1
    and context length 0."""

    slots: torch.Tensor  # int32 [tokens] KV slot of each new token (block * block_size + offset)
    num_decodes: int
    decode_block_tables: torch.Tensor  # int32 [decodes, width]
    decode_context_lens: torch.Tensor  # int32 [decodes] context length including the new token
    prefill_block_tables: torch.Tensor  # int32 [prefills, width]
    query_start_loc: torch.Tensor  # int32 [prefills + 1] rows of each chunk, counted from the first prefill row
    prefill_context_lens: torch.Tensor  # int32 [prefills] cached + new tokens
    max_query_len: int  # the longest chunk
    # int32 [prefill rows] the last key position each prefill row sees, where some see past their own; None: causal
    prefill_key_limits: torch.Tensor | None = None


@dataclass
class StepContext:
    positions: torch.Tensor  # [tokens] position of each new token in its sequence
    # the pool this step runs on: [layers, 2, kv_heads, blocks, block_size, head_dim], or a quantized format's rows
    # (uint8 [..., block_size, row_bytes]: kv_format, core/kv/quant.py)
    kv_cache: torch.Tensor
    # the torch attention's batch (below); the Triton attention's is `kernel`
    write_rows: torch.Tensor | None = None  # where each new token's K and V go
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # the paged C kernel's view (every row of the step at once): the sequences' int32 block tables [seqs, width]
    # (decode rows' sequences first, in row order, then the prefill chunks'), each row's sequence [tokens]
    # (None: row r is sequence r) and its context length, position + 1 [tokens]
    block_tables: torch.Tensor | None = None
    row_seqs: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    kernel: KernelBatch | None = None
    # masks shared by all layers, built on first use, keyed by (kind, index, sliding window)
    masks: dict = field(default_factory=dict)
    kv_format: KVFormat | None = None


# per thread: a server with several models loaded runs each engine's steps in its own thread at the same time
_local = threading.local()


def set_context(context: StepContext | None) -> None:
    _local.context = context


def get_context() -> StepContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("attention called outside a model-runner step")
    return context
