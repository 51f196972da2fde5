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
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=masks[i], scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)
            if out is None:  # a single sequence: no copy into a shared output buffer
                return attended.reshape(attended.shape[0], -1)
            out[start:end] = attended
        return out.flatten(1)


def attention_masks(ctx: StepContext, window: int | None) -> list[torch.Tensor | None]:
    """Boolean [new, context] masks per sequence (None where every key is visible), built once per
    step and window size and shared by all layers."""
    if window not in ctx.masks:
        masks: list[torch.Tensor | None] = []
        starts = ctx.query_start_loc
        for i, context_len in enumerate(ctx.seq_lens):
            new = starts[i + 1] - starts[i]
            if new == 1 and (window is None or context_len <= window):
                masks.append(None)
                continue
            query_pos = torch.arange(context_len - new, context_len).unsqueeze(1)
            key_pos = torch.arange(context_len).unsqueeze(0)
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            masks.append(visible)
        ctx.masks[window] = masks
    return ctx.masks[window]
