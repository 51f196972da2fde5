"""Attention over the paged KV cache (CPU / portable path).

The layer writes the step's new K/V into the cache through the slot mapping, then, sequence by
sequence, attends the new queries over that sequence's whole context read back through its
block table. Sequences are never padded to a common length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.context import StepContext, get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Set by the model runner: this layer's slice of the KV pool, [slots, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]."""
        ctx = get_context()
        self.k_cache.index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.index_copy_(0, ctx.slot_mapping, v)
        masks = attention_masks(ctx, self.sliding_window)
        out = torch.empty_like(q) if len(ctx.seq_lens) > 1 else None
        starts = ctx.query_start_loc
        for i, context_len in enumerate(ctx.seq_lens):
            start, end = starts[i], starts[i + 1]
            if context_len == end - start:  # nothing cached before this chunk: use the fresh K/V
                keys, values = k[start:end], v[start:end]
            else:
                slots = ctx.context_slots[i]
                keys, values = self.k_cache.index_select(0, slots), self.v_cache.index_select(0, slots)
            mask = masks[i]
            if end - start == 1 and mask is None:
                attended = single_query_attention(q[start], keys, values, self.scale)
            else:
                attended = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                    attn_mask=None if mask is CAUSAL else mask, is_causal=mask is CAUSAL, scale=self.scale,
                    enable_gqa=True,
                ).transpose(0, 1).flatten(1)
            if out is None:  # a single sequence: no copy into a shared output buffer
                return attended
            out[start:end] = attended.view(-1, self.num_heads, self.head_dim)
        return out.flatten(1)


def single_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token over its context: q [heads, head_dim], keys/values [context, kv_heads, head_dim]
    -> [1, heads * head_dim]. Two batched matmuls over the kv-head groups: SDPA's general path costs
    several times more per call at this size (a dozen small ops, dtype round trips)."""
    dtype, kv_heads = q.dtype, keys.shape[1]
    if dtype != torch.float32:  # CPU bf16/fp16 bmm at these odd shapes is ~10x slower than fp32
        q, keys, values = q.float(), keys.float(), values.float()
    grouped = q.view(kv_heads, -1, q.shape[-1])  # [kv_heads, queries per kv head, head_dim]
    scores = torch.bmm(grouped, keys.permute(1, 2, 0)) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, values.transpose(0, 1)).view(1, -1).to(dtype)


CAUSAL = object()  # mask marker: a fresh prompt chunk with no cached context; causal is all it needs


def attention_masks(ctx: StepContext, window: int | None) -> list:
    """Per sequence: None (every key visible), CAUSAL, or a boolean [new, context] mask; built once
    per step and window size and shared by all layers."""
    if window not in ctx.masks:
        masks: list = []
        starts = ctx.query_start_loc
        for i, context_len in enumerate(ctx.seq_lens):
            new = starts[i + 1] - starts[i]
            if window is None or context_len <= window:
                if new == 1:
                    masks.append(None)
                    continue
                if new == context_len:
                    masks.append(CAUSAL)
                    continue
            query_pos = torch.arange(context_len - new, context_len).unsqueeze(1)
            key_pos = torch.arange(context_len).unsqueeze(0)
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            masks.append(visible)
        ctx.masks[window] = masks
    return ctx.masks[window]
