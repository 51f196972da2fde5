"""Shape and dtype checks the paged attention kernels share (host-side only: no device sync)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged_attention(name: str, q: torch.Tensor, kv_cache: torch.Tensor,
                          sliding_window: int | None) -> tuple[int, int, int, int]:
    """q [rows, heads, head_dim] against one layer's paged cache [2, kv_heads, blocks, block_size, head_dim]:
    (heads, kv_heads, head_dim, block_size), or a ValueError naming the kernel and what is wrong."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, kv_heads, blocks, block_size, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    _, heads, head_dim = q.shape
    _, kv_heads, _, block_size, cache_dim = kv_cache.shape
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: q must be float16, bfloat16 or float32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"{name}: kv_cache dtype {kv_cache.dtype} differs from q's {q.dtype}")
    if cache_dim != head_dim:
        raise ValueError(f"{name}: head_dim of q ({head_dim}) and kv_cache ({cache_dim}) differ")
    if head_dim == 0 or block_size == 0:
        raise ValueError(f"{name}: head_dim and block_size must be positive, got {head_dim} and {block_size}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{name}: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{name}: sliding_window must be None or >= 1, got {sliding_window}")
    return heads, kv_heads, head_dim, block_size
