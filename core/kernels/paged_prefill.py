"""Triton flash-attention for prefill chunks, reading every key and value from the paged KV cache.

Inputs (T = the step's prefill tokens, P = sequences, KVH = KV heads, G = query heads per KV head):
- `q` [T, H, D], H = KVH * G: the chunks laid end to end; sequence p owns rows
  [query_start_loc[p], query_start_loc[p + 1]). Query head h reads KV head h // G.
- `kv_cache` [2, KVH, NB, BS, D] (one layer; 0 = K, 1 = V; head-major and paged: block b of a head holds
  BS consecutive tokens). The chunk's own K/V are already stored, so the cache holds all keys of the
  sequence: cached prefix and new tokens alike. A quantized pool (core/kv/quant.py, `kv_format`) is uint8
  [2, KVH, NB, BS, row_bytes]: each tile's codes and scales are loaded and dequantized in registers (code value *
  bf16 scale, in fp32, as `KVFormat.dequantize`); the KV_FORMAT constexpr picks the code at compile time, so a
  full-precision cache compiles to the kernel it always was.
- `block_tables` int32 [P, W]: token t of sequence p lives in slot t % BS of block block_tables[p, t // BS].
- `context_lens` int32 [P]: cached + new tokens. With n = the chunk's length, query row j sits at position
  context_len - n + j and sees keys at positions k <= its own (causal) and, with a sliding window w, k > pos - w.
- `key_limits` int32 [T] (optional): row t sees keys up to key_limits[t] instead of its own position (an image's
  tokens that attend to the whole image, Gemma 3); the window still counts back from its own position.

Tiling: the G query heads of a KV head are folded into the M dimension, so one program loads each K/V tile
once for all heads that share it. Row r of a sequence's folded [n * G, D] query matrix is token r // G,
head kv_head * G + r % G. The grid is (cdiv(max_query_len * G, BLOCK_M), P, KVH): the tile index goes on
axis 0, the only one not capped at 65535 (long prompts times G can exceed it); programs whose tile starts
past their sequence's chunk exit at once. A program loops over key tiles of BLOCK_N positions from the
first key visible to its first query (0, or the window's start) up to the causal limit of its last query,
so tiles wholly outside the window or past the diagonal are never visited. Each key position is mapped to
its cache slot through the block table per token (BS need not be a power of two, nor divide BLOCK_N), and
positions past the causal limit are never loaded, so stale slots and padding block-table columns are
never read. Softmax is online (running max and sum, in fp32, base 2).

Precision: fp16 / bf16 inputs compiled on a GPU dot q.k in the input dtype with an fp32 accumulator and
cast the probabilities to V's dtype for p.v (standard flash-attention). fp32 inputs, and every input under
the Triton interpreter, dot in fp32 with IEEE products: the interpreter multiplies bf16 dot operands as
raw uint16 bits. (Its fp32 -> bf16 store casts truncate, so interpreted bf16 outputs may be 1 ulp low.)

Runs on CUDA tensors, or on CPU under `TRITON_INTERPRET=1` (the interpreter setting at the first launch
decides, see runtime.py).
"""

from __future__ import annotations  # keeps the kernel's `tl.constexpr` annotations unevaluated

import torch

from kvforge.core.kernels.checks import KV_NONE, check_paged_attention
from kvforge.core.kernels.kv_tiles import load_kv_tile
from kvforge.core.kernels.runtime import Kernel, check_runnable, fp32_dots, next_power_of_2, tl, triton
from kvforge.core.kv.quant import KVFormat

_LOG2E = 1.4426950408889634


def _paged_prefill_fn(
    q_ptr, kv_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr, key_limits_ptr,
    qk_scale, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_kv, stride_kh, stride_kb, stride_ks, stride_kd,
    stride_btp, stride_btw,
    stride_ot, stride_oh, stride_od,
    D, GROUP: tl.constexpr, BS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FORMAT: tl.constexpr, KV_GROUP: tl.constexpr, KEY_LIMITS: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    n = tl.load(query_start_loc_ptr + seq + 1) - q_start
    rows = n * GROUP  # the folded query rows of this sequence and KV head
    row0 = tile * BLOCK_M
    if row0 >= rows:
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - n  # position of the chunk's first query

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < rows
    mask_d = offs_d < D
    tok = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    q_pos = first_pos + tok

    # int64 offsets: a KV pool (and a long step's q) can hold more than 2**31 elements
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # key range of this tile: the first query's window start to the last query's causal limit (exclusive)
    last_tok = (tl.minimum(row0 + BLOCK_M, rows) - 1) // GROUP
    hi = first_pos + last_tok + 1
    q_limit = q_pos
    if KEY_LIMITS:  # rows that see keys past their own position (an image's tokens attending to the whole image)
        q_limit = tl.load(key_limits_ptr + q_start + tok, mask=mask_m, other=0)
        hi = tl.maximum(hi, tl.reduce(q_limit, 0, tl.standard._elementwise_max) + 1)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + row0 // GROUP - window + 1, 0)

    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = k_base + stride_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_btp

    # tl.full, not tl.zeros, and tl.reduce with the standard combine functions, not tl.max / tl.sum: those
    # are themselves jitted when triton is imported, so under an interpreter switched on after that import
    # they could not be called; builtins always can (and the interpreter reduces these combines in numpy).
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi  # never read past the causal limit: those slots may hold anything
        block = tl.load(table + (offs_n // BS) * stride_btw, mask=mask_n, other=0)
        slots = block.to(tl.int64) * stride_kb + (offs_n % BS) * stride_ks
        if KV_FORMAT == KV_NONE:
            kv_offs = slots[:, None] + offs_d[None, :] * stride_kd
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0)
        else:  # dequantized here, in registers (core/kernels/kv_tiles.py)
            k = load_kv_tile(k_base, v_base, slots, offs_d, mask_n, mask_d, stride_kd, D, KV_GROUP, KV_FORMAT, True)
            v = load_kv_tile(v_base, v_base, slots, offs_d, mask_n, mask_d, stride_kd, D, KV_GROUP, KV_FORMAT, False)
            if not DOT_FP32:  # tensor cores take the model's dtype (a torch path converts to it too)
                k, v = k.to(q.dtype), v.to(q.dtype)

        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (offs_n[None, :] <= q_limit[:, None]) & mask_n[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = s * qk_scale
        if SOFTCAP:  # softcap * tanh(s / softcap), both in log2 units; tanh from exp (no tl.tanh everywhere)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(visible, s, float("-inf"))

        # A row may see no key of this tile (a window starts later, or the row is padding): keep its max
        # finite for the exponentials so it gets p = 0 and alpha = 1 (or 0 later) instead of NaN.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if DOT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i is 0 only on padding rows (not stored)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty),
             mask=q_mask)


_kernel = Kernel(_paged_prefill_fn, helpers=(load_kv_tile,))


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {value}")


def _launch_config(rows: int, block_d: int, fp32: bool, quantized: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for `rows` folded query rows. Chosen so that sm_90 builds of every
    head dim up to 256 keep all values in registers (ptxas reports no spill): the per-element int64 pointers
    of the K / V gathers cost as many registers as the accumulator. fp32 dots run on FMA units (no tensor
    cores), which need smaller tiles. A quantized cache's K / V tiles are dequantized in registers, which
    takes 16-key tiles, and 32-row ones at head_dim 256 (the 16-bit tiles spilled up to 600 B there)."""
    if fp32:  # 32-row tiles at head_dim 128 spilled 720 B on sm_90 with 4 warps: 8 warps from 128 up
        return (16 if rows <= 16 else 32), (32 if block_d <= 64 and not quantized else 16), (4 if block_d <= 64 else 8)
    if quantized and (rows <= 32 or block_d > 128):
        return (16 if rows <= 16 else 32), 16, (4 if block_d <= 128 else 8)
    if rows <= 32:
        return (16 if rows <= 16 else 32), 32, (4 if block_d <= 128 else 8)
    return 64, (64 if block_d <= 128 else 32), 8


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                            scale: float, sliding_window: int | None = None,
                            out: torch.Tensor | None = None, *, block_m: int | None = None,
                            block_n: int | None = None, softcap: float | None = None,
                            kv_format: KVFormat | None = None, key_limits: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of prefill chunks over the paged KV cache.

    q [T, H, D]; kv_cache [2, KVH, NB, BS, D] (same dtype as q, the chunks' K/V already stored);
    block_tables int32 [P, W]; query_start_loc int32 [P + 1] (starting at 0); context_lens int32 [P]
    (cached + new tokens); max_query_len: the longest chunk (sizes the grid only). Returns `out` [T, H, D]
    (allocated in q.dtype when None). Any strides are accepted. block_m / block_n override the tile sizes
    (powers of two >= 16). `softcap`: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2).
    `kv_format`: the cache is stored in it, uint8 [2, KVH, NB, BS, kv_format.row_bytes(D)], and dequantized as it
    is read. `key_limits`: int32 [T], the last key position each query row sees where some see past their own
    (>= its position; every key up to it must be stored); None: causal. Index values are not checked (that would
    sync with the device).
    """
    name = "paged_prefill_attention"
    heads, kv_heads, head_dim, block_size, code = check_paged_attention(name, q, kv_cache, sliding_window, kv_format)
    tokens = q.shape[0]
    for label, t, dims in (("block_tables", block_tables, 2), ("query_start_loc", query_start_loc, 1),
                           ("context_lens", context_lens, 1)):
        if t.dtype != torch.int32 or t.dim() != dims:
            raise ValueError(f"{name}: {label} must be a {dims}-d int32 tensor, got {t.dtype} {tuple(t.shape)}")
    seqs = block_tables.shape[0]
    if query_start_loc.shape[0] != seqs + 1:
        raise ValueError(f"{name}: query_start_loc needs P + 1 = {seqs + 1} entries (P = block_tables rows), "
                         f"got {query_start_loc.shape[0]}")
    if key_limits is not None and (key_limits.dtype != torch.int32 or key_limits.shape != (tokens,)):
        raise ValueError(f"{name}: key_limits must be int32 [{tokens}], got {key_limits.dtype} "
                         f"{tuple(key_limits.shape)}")
    if context_lens.shape[0] != seqs:
        raise ValueError(f"{name}: context_lens needs P = {seqs} entries, got {context_lens.shape[0]}")
    if max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be >= 0, got {max_query_len}")
    if out is None:
        out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"{name}: out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_runnable(q, kv_cache, block_tables, query_start_loc, context_lens, out,
                   *(() if key_limits is None else (key_limits,)), name=name)
    if tokens == 0 or seqs == 0 or max_query_len == 0:
        return out

    group = heads // kv_heads
    rows = max_query_len * group  # folded query rows of the longest chunk
    block_d = max(16, next_power_of_2(head_dim))
    fp32 = q.dtype == torch.float32
    default_m, default_n, num_warps = _launch_config(rows, block_d, fp32, kv_format is not None)
    block_m, block_n = block_m or default_m, block_n or default_n
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    if (block_m, block_n) != (default_m, default_n):
        num_warps = 8 if block_m >= 64 or block_d > 128 else 4
    grid = (triton.cdiv(rows, block_m), seqs, kv_heads)
    _kernel[grid](
        q, kv_cache, block_tables, query_start_loc, context_lens, out,
        context_lens if key_limits is None else key_limits,
        scale * _LOG2E, sliding_window or 0, (softcap or 0.0) * _LOG2E,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
        head_dim, GROUP=group, BS=block_size, USE_WINDOW=sliding_window is not None,
        DOT_FP32=fp32_dots(q.dtype), SOFTCAP=softcap is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        KV_FORMAT=code, KV_GROUP=0 if kv_format is None else kv_format.group, KEY_LIMITS=key_limits is not None,
        num_warps=num_warps, num_stages=2,
    )
    return out
