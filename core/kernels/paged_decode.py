"""Paged decode attention in Triton (flash-decoding): one query token per sequence over its paged KV cache.

Layout (one layer): `kv_cache` [2, KVH, NB, BS, D], index 0 = K and 1 = V, head-major and paged: block n of
KV head h holds BS consecutive tokens. Sequence b's token t lives in block `block_tables[b, t // BS]` at
slot `t % BS`. `context_lens[b]` = L counts the context including the new token (its K/V is already in
the cache); the query sits at position L - 1 and sees keys [max(0, L - window), L). L == 0 marks a
padding row, whose output is exactly 0. Query heads are grouped (GQA): query head i uses KV head i // G,
G = H / KVH. A quantized pool (core/kv/quant.py, `kv_format`) is uint8 [2, KVH, NB, BS, row_bytes]: each tile's
codes and scales are loaded and dequantized in registers (code value * bf16 scale, in fp32, as
`KVFormat.dequantize`), then go the way of a full-precision tile; the KV_FORMAT constexpr picks the code at compile
time, so a full-precision cache compiles to the kernel it always was.

Kernel 1 (`_split_fn`), grid (B, KVH, S): a program takes all G query heads of one KV head, so each K/V
tile is loaded once for the group; the group is padded to BLOCK_H >= 16 rows and D to BLOCK_D, a power
of two >= 16, both masked (tl.dot needs every dim >= 16 on GPUs). The sequence's visible KV blocks are
cut into S contiguous ranges of cdiv(blocks, S) blocks, computed in the kernel from context_lens, so the
grid depends on shapes only (CUDA graphs, no host sync). A program walks its range in tiles of BLOCK_N
tokens; a tile may span several KV blocks (any BS, also odd ones below 16): each token position t is
translated on its own to its block table entry and slot. Scores (q . k) * scale and an online softmax
(base 2, scale folded with log2 e) accumulate in fp32. Compiled with bf16 / fp16 inputs the dots run on
tensor cores in the input dtype (p cast to v's dtype for p . v, as flash-attention does): fp32 tiles at
head_dim 128 spilled registers on sm_90. fp32 models and the interpreter (whose bf16 dot is wrong) cast
q, k, v to fp32 and use IEEE fp32 products (DOT_FP32). Each split writes its
output normalised by its own sum and its log2-sum-exp into fp32 scratch [B, H, S, D] / [B, H, S]; an
empty split writes 0 and -inf.

Kernel 2 (`_combine_fn`), grid (B, H): weights the S partials by exp2(lse_s - max lse) and normalises,
writing q's dtype. A row whose splits are all empty (L == 0) gets 0, not 0 / 0. With S == 1 kernel 1
writes the output directly and kernel 2 is skipped.

Runs on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1` (kernels are jitted at first use, see
runtime.py).
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated

import functools

import torch

from kvforge.core.kernels.checks import KV_NONE, check_paged_attention
from kvforge.core.kernels.kv_tiles import load_kv_tile
from kvforge.core.kernels.runtime import Kernel, check_runnable, fp32_dots, next_power_of_2, tl
from kvforge.core.kv.quant import KVFormat

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 64  # below this a split's fixed cost (q load, combine) outweighs the parallelism
MAX_SPLITS = 32
NO_WINDOW = 2**31 - 1  # int32 max: length - NO_WINDOW never overflows, and clamps to 0
CPU_MAX_SPLITS = 2  # the interpreter runs programs one after another: splitting only costs time there


def _split_fn(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    qk_scale, window, softcap, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_kvh, stride_kvn, stride_kvs, stride_kvd,
    stride_btb, stride_btw, stride_cl,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr, KV_FORMAT: tl.constexpr, KV_GROUP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    length = tl.load(context_lens_ptr + b * stride_cl)
    low = tl.maximum(length - window, 0)  # window = 2**31 - 1 when there is none
    # This split's blocks among the visible ones [first, last), then its token range [tok_start, tok_end).
    first_block = low // BLOCK_SIZE
    last_block = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    per_split = (last_block - first_block + num_splits - 1) // num_splits
    split_block = first_block + split * per_split
    tok_start = tl.maximum(split_block * BLOCK_SIZE, low)
    tok_end = tl.minimum((split_block + per_split) * BLOCK_SIZE, length)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # query heads of this KV head (int64)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    k_head = k_ptr + kv_head * stride_kvh
    v_head = v_ptr + kv_head * stride_kvh
    table = block_tables_ptr + b * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    # tl.full, not tl.zeros, and tl.reduce with the standard combine functions, not tl.max / tl.sum: those
    # are themselves jitted when triton is imported, so an interpreter switched on after that import could
    # not call them; builtins always can (and the interpreter reduces these combines in numpy).
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_H,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_H, BLOCK_D), 0.0, dtype=tl.float32)
    for start in range(tok_start, tok_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < tok_end  # every tile holds at least one valid key, so the running max stays finite
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_btw, mask=valid, other=0).to(tl.int64)
        # int64: block * stride can pass 2**31 in a large pool
        rows = block * stride_kvn + (pos % BLOCK_SIZE).to(tl.int64) * stride_kvs
        if KV_FORMAT == KV_NONE:
            kv_offs = rows[:, None] + offs_d[None, :] * stride_kvd
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_head + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_head + kv_offs, mask=kv_mask, other=0.0)
        else:  # dequantized here, in registers (core/kernels/kv_tiles.py)
            k = load_kv_tile(k_head, v_head, rows, offs_d, valid, mask_d, stride_kvd, HEAD_DIM, KV_GROUP, KV_FORMAT,
                              True)
            v = load_kv_tile(v_head, v_head, rows, offs_d, valid, mask_d, stride_kvd, HEAD_DIM, KV_GROUP, KV_FORMAT,
                              False)
            if not DOT_FP32:  # tensor cores take the model's dtype (a torch path converts to it too)
                k, v = k.to(q.dtype), v.to(q.dtype)

        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # tensor cores, fp32 accumulation: half the registers of fp32 tiles
            scores = tl.dot(q, tl.trans(k))
        scores = scores * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        if SOFTCAP:  # softcap * tanh(scores / softcap), both in log2 units; tanh from exp (no tl.tanh everywhere)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf, m_new finite)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if DOT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    nonempty = l_i > 0.0
    result = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # an empty split (or L == 0) gives 0, not NaN
    out_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # scratch is contiguous [B, H, S, D] / [B, H, S]
        row = (b * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], result, mask=out_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_h)


def _combine_fn(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    rows = (b * num_heads + head) * num_splits + offs_s

    lse = tl.load(part_lse_ptr + rows, mask=mask_s, other=float("-inf"))
    top = tl.reduce(lse, 0, tl.standard._elementwise_max)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: exp2(-inf - 0) = 0, not -inf - -inf
    weights = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.reduce(weights, 0, tl.standard._sum_combine)
    result = tl.reduce(parts * weights[:, None], 0, tl.standard._sum_combine) / tl.where(total > 0.0, total, 1.0)
    out = out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=mask_d)


_split_kernel = Kernel(_split_fn, helpers=(load_kv_tile,))
_combine_kernel = Kernel(_combine_fn)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(torch.cuda.current_device() if device.index is None else device.index)


def default_num_splits(batch: int, kv_heads: int, max_blocks: int, block_size: int, device: torch.device,
                       sliding_window: int | None = None) -> int:
    """Splits per (sequence, KV head), from static shapes only: enough programs for ~2 waves over the
    SMs, each split keeping at least MIN_TOKENS_PER_SPLIT of the longest possible context, at most
    MAX_SPLITS (CPU_MAX_SPLITS under the interpreter)."""
    tokens = max_blocks * block_size
    if sliding_window is not None:  # a window spans at most window + block_size - 1 tokens of whole blocks
        tokens = min(tokens, sliding_window + block_size - 1)
    cap = max(1, min(MAX_SPLITS, -(-tokens // MIN_TOKENS_PER_SPLIT)))
    if device.type == "cuda":
        want = -(-2 * _sm_count(device) // max(1, batch * kv_heads))
    else:
        want = CPU_MAX_SPLITS
    return max(1, min(cap, want))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           softcap: float | None = None, *, kv_format: KVFormat | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context -> [B, H, D] in q.dtype.

    q [B, H, D]; kv_cache [2, KVH, NB, BS, D] (one layer, K then V; any strides, e.g. a view into a pool);
    block_tables int32 [B, W]; context_lens int32 [B] (L, including the new token; 0 = padding row, whose
    output is 0). Query position L - 1 sees keys [max(0, L - sliding_window), L). `num_splits` splits each
    context (flash-decoding; default from `default_num_splits`). Writes into `out` when given and returns
    it. `softcap`: scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2). `kv_format`: the cache
    is stored in it, uint8 [2, KVH, NB, BS, kv_format.row_bytes(D)], and dequantized as it is read. Never syncs
    with the device (CUDA-graph safe): block ids and lengths are trusted, not checked.
    """
    name = "paged_decode_attention"
    heads, kv_heads, head_dim, block_size, code = check_paged_attention(name, q, kv_cache, sliding_window, kv_format)
    batch = q.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{name}: block_tables must be int32 [batch={batch}, max_blocks], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"{name}: context_lens must be int32 [batch={batch}], "
                         f"got {context_lens.dtype} {tuple(context_lens.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")
    tensors = [q, kv_cache, block_tables, context_lens]
    if out is not None:
        if tuple(out.shape) != (batch, heads, head_dim) or out.dtype != q.dtype:
            raise ValueError(f"{name}: out must be {q.dtype} {(batch, heads, head_dim)}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        tensors.append(out)
    check_runnable(*tensors, name=name)

    if out is None:
        out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0 or heads == 0:
        return out
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_blocks, block_size, q.device, sliding_window)
    group = heads // kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    block_h = max(16, next_power_of_2(group))
    # Tiles of 32 keys; 16 at head_dim 256, so the fp32 K and V tiles stay in registers, and 16 for a quantized
    # cache, whose tiles are dequantized in registers (32 spilled on sm_90 at head_dim 128).
    block_n = 32 if block_d <= 128 and kv_format is None else 16
    direct = num_splits == 1
    if direct:  # kernel 1 writes out itself: no scratch (the pointers are unused)
        part_out = part_lse = out
    else:
        part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)

    _split_kernel[(batch, kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], block_tables, context_lens, part_out, part_lse, out,
        float(scale) * LOG2E, min(sliding_window or NO_WINDOW, NO_WINDOW), (softcap or 0.0) * LOG2E, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0), block_tables.stride(1), context_lens.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, DIRECT=direct,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
        DOT_FP32=fp32_dots(q.dtype), SOFTCAP=softcap is not None,
        KV_FORMAT=code, KV_GROUP=0 if kv_format is None else kv_format.group,
    )
    if not direct:
        _combine_kernel[(batch, heads)](
            part_out, part_lse, out, num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, BLOCK_S=max(2, next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4,
        )
    return out

