"""Attention over the paged KV cache (CPU / portable path).

The cache is head-major and paged: [2 (K, V), kv_heads, num_blocks, block_size, head_dim] per
layer, so a gathered context comes out as [2, kv_heads, tokens, head_dim], the layout the matmuls
want, and gathering copies whole blocks (see context.py). The layer first writes the step's new K/V.
Prefill chunks attend one sequence at a time over their context (SDPA). Decode tokens attend in
groups of similar context length with two batched matmuls, so the number of operations per layer
does not grow with the number of sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.context import DecodeGroup, PrefillSeq, StepContext, get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Set by the model runner: this layer's slice of the KV pool,
        # [2, kv_heads, blocks, block_size, head_dim].
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]."""
        ctx = get_context()
        new_kv = torch.stack((k, v)).transpose(1, 2).reshape(-1, self.head_dim)  # [(2, kv_heads, tokens), d]
        self.kv_cache.view(-1, self.head_dim).index_copy_(0, ctx.write_rows, new_kv)
        if not ctx.prefills and len(ctx.decode_groups) == 1:  # the common decode step: no copies
            return self._decode(ctx, 0, q)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for i, seq in enumerate(ctx.prefills):
            out[seq.start:seq.end] = self._prefill(ctx, i, seq, q, k, v)
        for i, group in enumerate(ctx.decode_groups):
            out[group.start:group.end] = self._decode(ctx, i, q)
        return out

    def _prefill(self, ctx: StepContext, i: int, seq: PrefillSeq, q, k, v) -> torch.Tensor:
        new = seq.end - seq.start
        if seq.context_len == new:  # nothing cached before this chunk: use the fresh K/V
            keys, values = k[seq.start:seq.end].transpose(0, 1), v[seq.start:seq.end].transpose(0, 1)
        else:
            keys, values = self._gather(seq.gather_rows)[:, :, : seq.context_len].unbind(0)
        mask = prefill_mask(ctx, i, seq, self.sliding_window)
        return F.scaled_dot_product_attention(
            q[seq.start:seq.end].transpose(0, 1), keys, values,
            attn_mask=None if mask is CAUSAL else mask, is_causal=mask is CAUSAL, scale=self.scale,
            enable_gqa=True,
        ).transpose(0, 1).flatten(1)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """K and V of the given blocks: [2, kv_heads, blocks * block_size, head_dim]."""
        block_elems = self.kv_cache.shape[3] * self.head_dim
        gathered = self.kv_cache.view(-1, block_elems).index_select(0, rows)
        return gathered.view(2, self.num_kv_heads, -1, self.head_dim)

    def _decode(self, ctx: StepContext, i: int, q: torch.Tensor) -> torch.Tensor:
        group = ctx.decode_groups[i]
        g = group.end - group.start
        keys, values = self._gather(group.gather_rows).view(2, self.num_kv_heads, g, -1, self.head_dim).unbind(0)
        return grouped_decode_attention(q[group.start:group.end], keys, values,
                                        decode_mask(ctx, i, group, self.sliding_window), self.scale)


def grouped_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [g, heads, head_dim]; keys/values [kv_heads, g, context, head_dim]; valid [g, context] or
    None -> [g, heads * head_dim]. Computed in fp32: CPU bf16 batched matmuls at these odd shapes are
    several times slower, and the softmax wants fp32 anyway."""
    dtype = q.dtype
    kv_heads, g, _, head_dim = keys.shape
    if dtype != torch.float32:
        q, keys, values = q.float(), keys.float(), values.float()
    grouped = q.view(g, kv_heads, -1, head_dim).transpose(0, 1)  # [kv_heads, g, queries per kv head, head_dim]
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * scale  # [kv_heads, g, qpk, context]
    if valid is not None:
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [kv_heads, g, qpk, head_dim]
    return out.transpose(0, 1).reshape(g, -1).to(dtype)


CAUSAL = object()  # mask marker: a fresh prompt chunk with no cached context; causal is all it needs


def prefill_mask(ctx: StepContext, i: int, seq: PrefillSeq, window: int | None):
    key = ("prefill", i, window)
    if key not in ctx.masks:
        new, length = seq.end - seq.start, seq.context_len
        if new == length and (window is None or length <= window):
            ctx.masks[key] = CAUSAL
        else:
            query_pos = torch.arange(length - new, length).unsqueeze(1)
            key_pos = torch.arange(length).unsqueeze(0)
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            ctx.masks[key] = visible
    return ctx.masks[key]


def decode_mask(ctx: StepContext, i: int, group: DecodeGroup, window: int | None) -> torch.Tensor | None:
    """[g, blocks * block_size] visible keys (None when every gathered key is visible)."""
    key = ("decode", i, window)
    if key not in ctx.masks:
        padded = group.padded_len
        needs_window = window is not None and int(group.lengths.max()) > window
        if bool((group.lengths == padded).all()) and not needs_window:
            ctx.masks[key] = None
        else:
            pos = torch.arange(padded).unsqueeze(0)
            lengths = group.lengths.unsqueeze(1)
            valid = pos < lengths
            if needs_window:
                valid &= pos >= lengths - window
            ctx.masks[key] = valid
    return ctx.masks[key]
