"""Triton dequantize-GEMM for GPTQ "v2" weights: y = x @ W.T with W dequantized tile by tile.

Layout (K = in_features, N = out_features, G = number of groups, per = 32 // bits):
- `qweight` int32 [K / per, N], packed along K, lowest bits first: q[k, n] is in word k // per at
  shift (k % per) * bits;
- `qzeros` int32 [G, ceil(N / per)], packed along N the same way, holding the real zero z (the "v2"
  format: no minus one; AWQ weights are converted to this layout at load);
- `scales` [G, N] (fp16 / bf16 / fp32); `g_idx` int32 or int64 [K], the group of each input row, in any
  order (desc_act / act-order makes it non-monotonic).
W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]); the reference is
`kvforge.plugins.quant.packing.Quantized.dequantize`. With `offsets` [G, N] (GGUF's types with a minimum:
Q4_1, Q4_K, Q5_1, Q5_K) W[n, k] = scales * (q - z) + offsets[g_idx[k], n], computed in fp32.

Kernel: one program per (BLOCK_M x BLOCK_N) output tile, looping over K in BLOCK_K steps. Each step
loads the x tile, the BLOCK_K x BLOCK_N slice of qweight words (each word is read once per row it
holds; the repeated loads hit L1), gathers scales and zeros through g_idx for every row of the K tile
(so desc_act needs no reordering), dequantizes in fp32, casts to x's dtype and accumulates with
`tl.dot` into an fp32 accumulator. M, N and K tails are masked. Block sizes are fixed (no autotune):
BLOCK_N = 64, BLOCK_K = 32 and BLOCK_M = 16 / 32 / 64 by M; callers (tests) may pass others (powers of
two >= 16, the least tl.dot takes on GPUs).

Runs on CUDA tensors, or on CPU under `TRITON_INTERPRET=1`. The kernel is jitted on first use, so the
interpreter setting in force at the first call (not at import) decides how it runs.
"""

from __future__ import annotations  # keeps the kernel's `tl.constexpr` annotations unevaluated

import torch

# the plugins import this module to ask `triton_available()` on any machine, with or without triton
from kvforge.core.kernels.checks import FLOAT_DTYPES
from kvforge.core.kernels.runtime import Kernel, check_runnable, interpreting, tl, triton, triton_available

__all__ = ["dequant_gemm", "triton_available"]

DEFAULT_BLOCK_N = 64
DEFAULT_BLOCK_K = 32


def _dequant_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, g_idx_ptr, offsets_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_og, stride_on2, stride_om, stride_on,
    BITS: tl.constexpr, INPUT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MAXQ: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    # zeros of this N tile: column n is in word n // PER_WORD at shift (n % PER_WORD) * BITS
    zeros_cols = qzeros_ptr + (offs_n // PER_WORD)[None, :] * stride_zn
    zeros_shift = ((offs_n % PER_WORD) * BITS)[None, :]
    scales_cols = scales_ptr + offs_n[None, :] * stride_sn
    q_cols = qweight_ptr + offs_n[None, :] * stride_qn

    # tl.full, not tl.zeros: tl.zeros is itself jitted when triton is imported, so under an interpreter
    # switched on after that import it could not be called; builtins like tl.full always can.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)

        mask_kn = mask_k[:, None] & mask_n[None, :]
        words = tl.load(q_cols + (offs_k // PER_WORD)[:, None] * stride_qk, mask=mask_kn, other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & MAXQ  # [BLOCK_K, BLOCK_N]

        g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)[:, None]  # group of each row of the tile
        scales = tl.load(scales_cols + g * stride_sg, mask=mask_kn, other=0.0).to(tl.float32)
        zwords = tl.load(zeros_cols + g * stride_zg, mask=mask_kn, other=0)
        zeros = (zwords >> zeros_shift) & MAXQ

        w = (q - zeros).to(tl.float32) * scales  # dequantized W.T tile, zero where masked
        if HAS_OFFSETS:
            w = w + tl.load(offsets_ptr + offs_n[None, :] * stride_on2 + g * stride_og, mask=mask_kn,
                            other=0.0).to(tl.float32)
        if BF16_BY_HAND:
            # Interpreter only: its tl.dot multiplies bf16 operands as raw uint16 and its fp32 -> bf16
            # casts truncate. Round w to bf16 (nearest even) in fp32 and dot in fp32: the same numbers.
            wb = w.to(tl.uint32, bitcast=True)
            wb = (wb + 0x7FFF + ((wb >> 16) & 1)) >> 16 << 16
            acc = tl.dot(x.to(tl.float32), wb.to(tl.float32, bitcast=True), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)

    if BF16_BY_HAND:  # round to nearest even by hand, so the truncating cast below is exact
        ab = acc.to(tl.uint32, bitcast=True)
        acc = ((ab + 0x7FFF + ((ab >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_kernel = Kernel(_dequant_gemm_kernel)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {value}")


def dequant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, *, block_m: int | None = None, block_n: int = DEFAULT_BLOCK_N,
                 block_k: int = DEFAULT_BLOCK_K, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ W.T -> [M, N] in x.dtype,
    with W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]) (+ offsets[g_idx[k], n]).

    Leading dimensions of x are flattened ([..., K] -> [..., N]). Accumulates in fp32; fp32 inputs use
    IEEE fp32 products (no TF32), like torch's default matmul. Raises ValueError for shapes, dtypes or
    devices the kernel cannot take; g_idx values must lie in [0, G) (not checked: that would sync).
    """
    if triton is None:
        raise RuntimeError("dequant_gemm needs the `triton` package")
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    per = 32 // bits
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last one is K)")
    k = x.shape[-1]
    if k % per:
        raise ValueError(f"K = {k} (x.shape[-1]) must be a multiple of {per}: {bits}-bit rows fill int32 words")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    if qweight.dim() != 2 or qweight.shape[0] != k // per:
        raise ValueError(f"qweight must be [K*bits/32, N] = [{k // per}, N] for K = {k}, got {tuple(qweight.shape)}")
    n = qweight.shape[1]
    if scales.dtype not in FLOAT_DTYPES:
        raise ValueError(f"scales must be float16, bfloat16 or float32, got {scales.dtype}")
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(f"scales must be [G, N] = [G, {n}], got {tuple(scales.shape)}")
    groups = scales.shape[0]
    zero_words = -(-n // per)
    if tuple(qzeros.shape) != (groups, zero_words):
        raise ValueError(f"qzeros must be [G, N*bits/32] = [{groups}, {zero_words}], got {tuple(qzeros.shape)}")
    if g_idx.dtype not in (torch.int32, torch.int64) or tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx must be int32 or int64 [K] = [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if k and groups == 0:
        raise ValueError("scales and qzeros have no groups")
    if offsets is not None and (offsets.shape != scales.shape or offsets.dtype not in FLOAT_DTYPES):
        raise ValueError(f"offsets must be float [G, N] = {tuple(scales.shape)}, got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    check_runnable(x, qweight, scales, qzeros, g_idx, *([] if offsets is None else [offsets]), name="dequant_gemm")
    interpret = interpreting()

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    block_m = _block_m(m) if block_m is None else block_m
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_block(name, value)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)

    # fp32 dots use IEEE products, not TF32 (input_precision only matters for fp32 operands). Compiled
    # kernels run bf16 tensor-core dots; the interpreter gets the same numbers through fp32 (see kernel).
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    offs = scales if offsets is None else offsets  # a placeholder pointer when there are none
    _kernel[grid](
        x2, qweight, scales, qzeros, g_idx, offs, out,
        m, n, k,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        qzeros.stride(0), qzeros.stride(1), offs.stride(0), offs.stride(1), out.stride(0), out.stride(1),
        BITS=bits, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BF16_BY_HAND=interpret and x.dtype == torch.bfloat16, HAS_OFFSETS=offsets is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.reshape(*lead, n)
