"""Fused Triton kernels for the decoder layer's small memory-bound ops, each replacing a torch sequence:

- `rms_norm`: `RMSNorm.forward` (core/layers/norm.py), the residual add fused in: one pass reads x (and the
  residual) and writes the normalised rows (and the new residual);
- `silu_and_mul`: `SiluAndMul` (core/layers/activation.py), silu(gate) * up over the fused gate_up output;
- `rotary_inplace`: `apply_rotary` (core/layers/rotary.py), neox rotate-half, written back into x;
- `store_kv`: the KV-cache write at the top of `Attention.forward` (core/layers/attention.py): each new
  token's K and V go to its slot of one layer's head-major paged cache [2, kv_heads, blocks, block_size, D];
  with a quantized pool (core/kv/quant.py), as the bytes `KVFormat.quantize` gives each (token, head) row.

Launch: one program per row (token), the row held in one masked block of next_power_of_2(width) elements
(silu_and_mul, which needs no reduction, splits long rows over a second grid axis; rotary splits many
heads the same way). Every stride is passed, so inputs may be non-contiguous views (columns of a fused
projection output); row offsets are int64, as row * stride (and a paged pool) can pass 2**31 elements.

Precision: values are loaded, widened to fp32, computed and stored in the tensor's dtype, and every
intermediate that torch rounds to the model dtype is rounded there too (the sum x + residual, the normalised
value before the weight, silu before the multiply, each rotary product and their sum). The fp32 math is
torch's CUDA math: mean = sum * fl(1/N), rsqrt (the approximate one, as torch.rsqrt's rsqrtf), IEEE division
(`div_rn`) and CUDA's expf (libdevice) in silu, and no mul-add contraction into FMA
(`enable_fp_fusion=False`: torch rounds each product). So on a GPU, where casts round to nearest even,
rotary and silu should equal torch bit for bit in every dtype; rms_norm's sum of squares is reduced in
another order than torch's, which can move the fp32 result by an ulp and, rarely, an fp16 / bf16 output by
one ulp. Under the interpreter (TRITON_INTERPRET=1, CPU tests) fp32 -> bf16 casts truncate instead of
rounding, so the kernels round bf16 intermediates to nearest even by hand there first (the cast is then
exact), and silu uses numpy's exp (libdevice has no interpreter version), which now and then differs from
torch's CPU exp in the last fp32 bit.

CUDA graphs: the host code only checks shapes, dtypes and devices, allocates outputs and launches; it never
reads device values (no sync), so every function can be captured (after a warm-up call has compiled it).
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated

import torch

from kvforge.core.kernels.checks import FLOAT_DTYPES, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8, KV_Q4, check_kv_format
from kvforge.core.kernels.runtime import Kernel, check_runnable, interpreting, next_power_of_2, tl, triton
from kvforge.core.kv.quant import KVFormat

try:
    from triton.language.extra import libdevice
except ImportError:  # no triton: the public functions raise through check_runnable
    libdevice = None

_MAX_TILE = 2048  # elements per program where a row is split over programs (silu_and_mul, rotary)


def _num_warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _rne_bf16(dtype: torch.dtype) -> bool:
    """Whether a kernel must round fp32 -> bf16 by hand: the interpreter's casts truncate."""
    return dtype == torch.bfloat16 and interpreting()


# The kernels repeat one 3-line "round to nearest even" block instead of calling a helper: a helper would
# have to be jitted too, and triton decides interpreted vs compiled when a function is jitted (runtime.py).


def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    N, inv_n, eps,
    stride_xr, stride_xc, stride_rr, stride_rc, stride_w, stride_or, stride_oc, stride_sr, stride_sc,
    HAS_RESIDUAL: tl.constexpr, RNE_X: tl.constexpr, RNE_OUT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_rr + cols * stride_rc, mask=mask, other=0.0).to(tl.float32)
        if RNE_X:  # interpreter, bf16: its cast truncates, so round to nearest even by hand first
            b = x.to(tl.uint32, bitcast=True)
            x = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
        x = x.to(sum_ptr.dtype.element_ty)  # torch's x + residual is rounded to the dtype before the norm
        tl.store(sum_ptr + row * stride_sr + cols * stride_sc, x, mask=mask)
        x = x.to(tl.float32)
    # mean as torch's CUDA reduction computes it: the sum times fl(1/N); masked columns add zeros. tl.sum
    # is itself jitted at import (so unusable under an interpreter switched on later); tl.reduce with its
    # combine function is the same reduction, and the interpreter runs it as np.sum.
    var = tl.reduce(x * x, 0, tl.standard._sum_combine) * inv_n
    y = x * tl.rsqrt(var + eps)
    if RNE_X:
        b = y.to(tl.uint32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    # HF order: the normalised value is cast to the input dtype, then multiplied by the weight
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    if RNE_OUT:
        b = y.to(tl.uint32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * stride_or + cols * stride_oc, y.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm_kernel = Kernel(_rms_norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             inplace: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in one kernel. x [T, N], weight [N]; residual [T, N] like x, or None.

    Without residual: norm(x) * weight. With it: s = x + residual (rounded to x.dtype), and returns
    (norm(s) * weight, s). norm normalises in fp32 and casts to x.dtype before the weight; the output dtype
    is torch's promotion of x's and weight's (x.dtype when they match). `inplace=True` writes the output
    into x and s into residual (and returns them): no allocation, e.g. inside a CUDA graph.
    """
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    t, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}] for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                             f"got {tuple(residual.shape)}, {residual.dtype}")
        tensors.append(residual)
    check_runnable(*tensors, name="rms_norm")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if inplace:
        if out_dtype != x.dtype:
            raise ValueError(f"inplace rms_norm writes the output into x ({x.dtype}), but x and weight "
                             f"({weight.dtype}) give {out_dtype}")
        out, total = x, residual
    else:
        out = torch.empty(t, n, dtype=out_dtype, device=x.device)
        total = None if residual is None else torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t and n:
        has_residual = residual is not None
        res, tot = (residual, total) if has_residual else (x, x)  # unused pointers when there is none
        block = next_power_of_2(n)
        _rms_norm_kernel[(t,)](
            x, res, weight, out, tot,
            n, 1.0 / n, float(eps),
            x.stride(0), x.stride(1), res.stride(0), res.stride(1), weight.stride(0),
            out.stride(0), out.stride(1), tot.stride(0), tot.stride(1),
            HAS_RESIDUAL=has_residual, RNE_X=_rne_bf16(x.dtype), RNE_OUT=_rne_bf16(out_dtype), BLOCK=block,
            num_warps=_num_warps(block), enable_fp_fusion=False,
        )
    return out if residual is None else (out, total)


def _silu_and_mul(
    x_ptr, out_ptr, INTER,
    stride_xr, stride_xc, stride_or, stride_oc,
    INTERPRET: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    x_row = x_ptr + row * stride_xr
    gate = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (cols + INTER) * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:
        e = tl.exp(-gate)  # numpy's exp (libdevice has no interpreter version)
    else:
        e = libdevice.exp(-gate)  # CUDA's expf, as torch's silu uses (tl.exp is a faster approximation)
    act = tl.math.div_rn(gate, 1.0 + e)  # torch: x / (1 + exp(-x)), IEEE division
    if RNE:  # interpreter, bf16: its cast truncates, so round to nearest even by hand first
        b = act.to(tl.uint32, bitcast=True)
        act = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    y = act.to(out_ptr.dtype.element_ty).to(tl.float32) * up  # F.silu rounds to the dtype before the multiply
    if RNE:
        b = y.to(tl.uint32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * stride_or + cols * stride_oc, y.to(out_ptr.dtype.element_ty), mask=mask)


_silu_and_mul_kernel = Kernel(_silu_and_mul)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`SiluAndMul`: x [..., 2I] -> silu(x[..., :I]) * x[..., I:] as [..., I] in x.dtype."""
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * intermediate] (an even last dimension), got {tuple(x.shape)}")
    check_runnable(x, name="silu_and_mul")
    lead, width = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, width)
    inter = width // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(next_power_of_2(inter), _MAX_TILE)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter,
            x2.stride(0), x2.stride(1), out.stride(0), out.stride(1),
            INTERPRET=interpreting(), RNE=_rne_bf16(x.dtype), BLOCK=block,
            num_warps=_num_warps(block), enable_fp_fusion=False,
        )
    return out.view(*lead, inter)


def _rotary(
    x_ptr, cos_ptr, sin_ptr, H,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_cd, stride_st, stride_sd,
    HEAD_DIM: tl.constexpr, RNE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    mask = (heads < H)[:, None] & d_mask[None, :]
    # rotate_half(x)[d] = -x[d + HALF] for d < HALF, x[d - HALF] after: the partner column and its sign
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    cos = tl.load(cos_ptr + tok * stride_ct + d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + tok * stride_st + d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    rows = x_ptr + tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    # the program owns whole heads, so it reads each partner before anything is written back
    x = tl.load(rows + d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    rot = tl.load(rows + partner[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32) * sign[None, :]
    # torch: x * cos + rotated * sin, each product and the sum rounded to the dtype (products of two
    # fp16 / bf16 values are exact in fp32, so rounding them once here gives torch's values)
    a = x * cos
    c = rot * sin
    if RNE:  # interpreter, bf16: its cast truncates, so round to nearest even by hand first
        b = a.to(tl.uint32, bitcast=True)
        a = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
        b = c.to(tl.uint32, bitcast=True)
        c = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    y = a.to(x_ptr.dtype.element_ty).to(tl.float32) + c.to(x_ptr.dtype.element_ty).to(tl.float32)
    if RNE:
        b = y.to(tl.uint32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    tl.store(rows + d[None, :] * stride_xd, y.to(x_ptr.dtype.element_ty), mask=mask)


_rotary_kernel = Kernel(_rotary)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` written back into x and returned: x [T, heads, D] (any strides, e.g. the q|k columns
    of a fused qkv output viewed as heads); cos, sin [T, 1, D] or [T, D] in x.dtype. Each half of cos / sin
    is used where apply_rotary uses it (no assumption that the halves are equal)."""
    _check_float("x", x)
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [tokens, heads, head_dim] with an even head_dim, got {tuple(x.shape)}")
    t, h, d = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape not in ((t, 1, d), (t, d)):
            raise ValueError(f"{name} must be [{t}, 1, {d}] or [{t}, {d}] for x of shape {tuple(x.shape)}, "
                             f"got {tuple(table.shape)}")
        if table.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype} (the result is written into x), got {table.dtype}")
    check_runnable(x, cos, sin, name="rotary_inplace")
    if x.numel():
        block_d = next_power_of_2(d)
        block_h = min(next_power_of_2(h), max(1, _MAX_TILE // block_d))
        _rotary_kernel[(t, triton.cdiv(h, block_h))](
            x, cos, sin, h,
            x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1),
            HEAD_DIM=d, RNE=_rne_bf16(x.dtype), BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=_num_warps(block_h * block_d), enable_fp_fusion=False,
        )
    return x


def _store_kv(
    k_ptr, v_ptr, cache_ptr, slots_ptr,
    KVH, D, BLOCK_SIZE, NUM_SLOTS,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_ckv, stride_ch, stride_cb, stride_cs, stride_cd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # padding rows (slot < 0) write nothing; nor would a slot past this layer's cache (the next layer's)
    valid = (slot >= 0) & (slot < NUM_SLOTS)
    # as a head count (the interpreter mistypes a block mask and-ed with a scalar one)
    mask = (heads < tl.where(valid, KVH, 0))[:, None] & (d < D)[None, :]
    slot = tl.where(valid, slot, 0)  # keeps even the masked-off addresses inside the cache
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
           + heads[:, None].to(tl.int64) * stride_ch + d[None, :] * stride_cd)
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    tl.store(dst, k, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(dst + stride_ckv, v, mask=mask)


_store_kv_kernel = Kernel(_store_kv)


def _store_kv_quantized(
    k_ptr, v_ptr, cache_ptr, slots_ptr,
    D, VALUE_BYTES, BLOCK_SIZE, NUM_SLOTS,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_ckv, stride_ch, stride_cb, stride_cs, stride_cd,
    KV_FORMAT: tl.constexpr, LIMIT: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= NUM_SLOTS):  # padding rows, and a slot past this layer's cache (the next layer's)
        return
    # the row as GROUPS groups of GROUP values, one scale each (8-bit formats: one group, the padded row)
    group = tl.arange(0, GROUPS)
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < D
    row = cache_ptr + head * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    M: tl.constexpr = 3 if KV_FORMAT == KV_FP8_E4M3 else 2  # fp8's mantissa bits
    B: tl.constexpr = 7 if KV_FORMAT == KV_FP8_E4M3 else 15  # fp8's exponent bias
    SHIFT: tl.constexpr = 23 - M  # fp32 mantissa bits that fp8 drops
    for which in tl.static_range(2):  # K, then V: one copy of the quantization
        if which == 0:
            x = tl.load(k_ptr + tok * stride_kt + head * stride_kh + cols * stride_kd, mask=mask, other=0.0)
        else:
            x = tl.load(v_ptr + tok * stride_vt + head * stride_vh + cols * stride_vd, mask=mask, other=0.0)
        if x.dtype == tl.bfloat16:  # widened by its bits: the interpreter's cast loses bf16 subnormals
            x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)
        dst = row + which * stride_ckv
        top = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max)
        # the scale as KVFormat.quantize computes it in fp32 (div_rn: IEEE division, as torch's; a compiled `/` is
        # approximate), then rounded to bf16 by hand, to nearest even: the interpreter's cast truncates
        if KV_FORMAT == KV_Q4:
            # the group's value of largest magnitude, the first of equals (torch's argmax), maps to -8; a max over
            # that one value and -infs keeps its sign, a zero's too
            first = tl.reduce(tl.where(tl.abs(x) == top[:, None], cols, D), 1, tl.standard._elementwise_min)
            biggest = tl.reduce(tl.where(cols == first[:, None], x, float("-inf")), 1, tl.standard._elementwise_max)
            scale = biggest * (-0.0625 if which == 0 else -0.125)  # exact, as / -16 (K's 5 bits) and / -8 (V's) are
        else:
            scale = tl.math.div_rn(top, tl.full((GROUPS,), LIMIT, tl.float32))
        b = scale.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # the bf16 scale's bits
        wide = (b << 16).to(tl.float32, bitcast=True)
        wide = tl.broadcast_to(tl.where(wide == 0.0, 1.0, wide)[:, None], (GROUPS, GROUP))  # a zero scale: / 1
        y = tl.math.div_rn(x, wide)
        # clamped before rounding: the same as clamping the rounded int8 / q4 codes, whose bounds are integers
        if KV_FORMAT == KV_Q4:
            if which == 0:
                y = tl.minimum(tl.maximum(y, -16.0), 15.0)
            else:
                y = tl.minimum(tl.maximum(y, -8.0), 7.0)
        else:
            y = tl.minimum(tl.maximum(y, -LIMIT), LIMIT)
        if KV_FORMAT == KV_INT8 or KV_FORMAT == KV_Q4:
            # round half to even: adding 1.5 * 2**23 leaves no fraction bits (|y| <= 127 here)
            codes = ((y + 12582912.0) - 12582912.0).to(tl.int32)
        else:
            # fp32 -> fp8 by hand, rounding to nearest even: the interpreter's fp8 casts round ties up and lose
            # the carry into the exponent, and compiled e4m3 casts need sm_89. |y| <= LIMIT, the largest finite.
            tl.static_assert(KV_FORMAT == KV_FP8_E4M3 or KV_FORMAT == KV_FP8_E5M2)
            bits = y.to(tl.int32, bitcast=True)
            mag = bits & 0x7FFFFFFF
            # normal: drop SHIFT mantissa bits rounding to nearest even (a carry moves into the exponent), rebias
            normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - B) << M)
            # below the smallest normal 2**(1 - B): a count of 2**(1 - B - M) steps, rounded as int8's codes are
            # (taken of at most 2**(1 - B), so that the lanes it is not used for stay in int32's range too)
            tiny = tl.minimum(mag.to(tl.float32, bitcast=True), 2.0 ** (1 - B))
            steps = ((tiny * (2.0 ** (B + M - 1)) + 12582912.0) - 12582912.0).to(tl.int32)
            codes = tl.where(mag < ((128 - B) << 23), steps, normal) | ((bits >> 24) & 0x80)
        if KV_FORMAT == KV_Q4:
            codes = codes + (16 if which == 0 else 8)
            low, high = tl.split(tl.reshape(codes & 15, (GROUPS, GROUP // 2, 2)))  # value 2i in byte i's low nibble
            pairs = group[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
            tl.store(dst + pairs * stride_cd, (low | (high << 4)).to(tl.uint8), mask=pairs * 2 < D)
            if which == 0:  # K's fifth bits after its nibbles: value 8j + i in bit i of byte j
                fifth = tl.reshape((codes >> 4) << (cols % 8), (GROUPS, GROUP // 8, 8))
                octets = group[:, None] * (GROUP // 8) + tl.arange(0, GROUP // 8)[None, :]
                fifth_bits = tl.reduce(fifth, 2, tl.standard._sum_combine)  # not tl.sum: see the RMSNorm kernel
                tl.store(dst + (VALUE_BYTES + octets) * stride_cd, fifth_bits.to(tl.uint8), mask=octets * 8 < D)
            # the scales after V's codes: V's, then K's (in the V row: both rows keep one width)
            scales = row + stride_ckv + (VALUE_BYTES + 2 * (1 - which) * (D // GROUP) + 2 * group) * stride_cd
        else:
            tl.store(dst + cols * stride_cd, (codes & 0xFF).to(tl.uint8), mask=mask)
            # the bf16 scales after the codes, byte by byte (little-endian): no alignment asked of the cache
            scales = dst + (VALUE_BYTES + 2 * group) * stride_cd
        tl.store(scales, (b & 0xFF).to(tl.uint8), mask=group * GROUP < D)
        tl.store(scales + stride_cd, (b >> 8).to(tl.uint8), mask=group * GROUP < D)


_store_kv_quantized_kernel = Kernel(_store_kv_quantized)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, *,
             kv_format: KVFormat | None = None) -> None:
    """Write token t's K and V (every head) into slot slots[t] of one layer's paged cache.

    k, v: [T, kv_heads, D] (any strides, e.g. columns of a fused qkv output); kv_cache: [2 (K, V), kv_heads,
    blocks, block_size, D], any strides (a view into a bigger pool is fine); slots: [T] int32 / int64, slot s
    is block s // block_size, offset s % block_size. Slots < 0 (padding rows) are skipped, and so are
    slots >= blocks * block_size (checking on the host would sync).

    With `kv_format` the cache is uint8 [2, kv_heads, blocks, block_size, kv_format.row_bytes(D)] and each row is
    quantized as `KVFormat.quantize` does it, to the same bytes; k and v may then be any float dtype.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [tokens, kv_heads, head_dim], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    t, kvh, d = k.shape
    row = d if kv_format is None else "row_bytes"
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[1] != kvh:
        raise ValueError(f"kv_cache must be [2, {kvh}, blocks, block_size, {row}] for k of shape {tuple(k.shape)}, "
                         f"got {tuple(kv_cache.shape)}")
    code = check_kv_format("store_kv", kv_format, kv_cache, d)  # a quantized cache's dtype and row_bytes
    if kv_format is None:
        if kv_cache.shape[4] != d:
            raise ValueError(f"kv_cache must be [2, {kvh}, blocks, block_size, {d}] for k of shape {tuple(k.shape)}, "
                             f"got {tuple(kv_cache.shape)}")
        _check_float("kv_cache", kv_cache)
        if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
            raise ValueError(f"k, v and kv_cache must share one dtype, got {k.dtype}, {v.dtype}, {kv_cache.dtype}")
    else:
        _check_float("k", k)
        if v.dtype != k.dtype:
            raise ValueError(f"k and v must share one dtype, got {k.dtype} and {v.dtype}")
    if slots.shape != (t,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64 [{t}], got {slots.dtype} {tuple(slots.shape)}")
    check_runnable(k, v, kv_cache, slots, name="store_kv")
    blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    if t == 0 or kvh == 0 or d == 0 or blocks * block_size == 0:
        return
    if kv_format is not None:
        # one program per (token, head) row: a row is one quantization unit
        group = kv_format.group or next_power_of_2(d)
        _store_kv_quantized_kernel[(t, kvh)](
            k, v, kv_cache, slots,
            d, kv_format.value_bytes(d), block_size, blocks * block_size,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *kv_cache.stride(),
            KV_FORMAT=code, LIMIT=kv_format.limit, GROUP=group, GROUPS=next_power_of_2(-(-d // group)),
            num_warps=_num_warps(d), enable_fp_fusion=False,
        )
        return
    block_h, block_d = next_power_of_2(kvh), next_power_of_2(d)
    _store_kv_kernel[(t,)](
        k, v, kv_cache, slots,
        kvh, d, block_size, blocks * block_size,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *kv_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d),
    )
