"""Shape and dtype checks the paged attention kernels share (host-side only: no device sync), and the code the
kernels specialise on for the KV cache's storage format."""

from __future__ import annotations

import torch

from kvforge.core.kernels.runtime import tl
from kvforge.core.kv.quant import KV_FORMATS, KVFormat, check_kv_cache

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The kernels' KV_FORMAT constexpr: KV_NONE for a cache in the model's dtype, else the format's code. Made triton
# constexprs because jitted code may read no other int globals (plain ints where triton is missing: nothing runs).
NO_FORMAT = 0
READ_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "q4")  # those the kernels are written for (a new one is refused)
_constexpr = int if tl is None else tl.constexpr
KV_NONE = _constexpr(NO_FORMAT)
KV_INT8 = _constexpr(KV_FORMATS["int8"].code)
KV_FP8_E4M3 = _constexpr(KV_FORMATS["fp8_e4m3"].code)
KV_FP8_E5M2 = _constexpr(KV_FORMATS["fp8_e5m2"].code)
KV_Q4 = _constexpr(KV_FORMATS["q4"].code)


def check_kv_format(name: str, kv_format: KVFormat | None, kv_cache: torch.Tensor, head_dim: int) -> int:
    """The KV_FORMAT code of a cache stored as `kv_format`, or a ValueError naming the cache and the format when
    they do not go together. None (full precision) only refuses a uint8 cache here: the callers check its dtype
    and width against the model's. A format needs a uint8 cache of kv_format.row_bytes(head_dim) per row (core/kv/
    quant.py check_kv_cache, as the C kernels check it) and a head size it takes, its rotation's included."""
    if kv_format is not None and not (isinstance(kv_format, KVFormat) and kv_format.name in READ_FORMATS
                                      and KV_FORMATS.get(kv_format.name) == kv_format):
        raise ValueError(f"{name}: the kernels read no KV format {kv_format!r}; they read {', '.join(READ_FORMATS)}")
    check_kv_cache(name, kv_format, kv_cache, head_dim)
    if kv_format is not None and (why := kv_format.unsupported(head_dim)) is not None:
        raise ValueError(f"{name}: {why}")
    return NO_FORMAT if kv_format is None else kv_format.code


def check_paged_attention(name: str, q: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None,
                          kv_format: KVFormat | None = None) -> tuple[int, int, int, int, int]:
    """q [rows, heads, head_dim] against one layer's paged cache [2, kv_heads, blocks, block_size, head_dim] in
    q's dtype, or [2, kv_heads, blocks, block_size, kv_format.row_bytes(head_dim)] uint8 with a format:
    (heads, kv_heads, head_dim, block_size, KV_FORMAT code), or a ValueError naming the kernel and what is wrong."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, kv_heads, blocks, block_size, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    _, heads, head_dim = q.shape
    _, kv_heads, _, block_size, cache_dim = kv_cache.shape
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: q must be float16, bfloat16 or float32, got {q.dtype}")
    code = check_kv_format(name, kv_format, kv_cache, head_dim)
    if kv_format is None:
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
    return heads, kv_heads, head_dim, block_size, code
