"""A mixture-of-experts MLP in two grouped GEMM launches (the Triton backend's path for core/layers/moe.py):
every (token, slot) pair's row of the gate/up projection by its expert, SiLU-and-multiply, then every pair's row of
the down projection times its routing weight, summed over each token's slots.

Grouping (`align_by_expert`, torch ops with no host sync, so a CUDA graph may hold it): the T x k pairs sorted by
expert (stable: tokens in order within an expert), each expert's run padded to a multiple of BLOCK_M with a sentinel
(T x k, past every pair), and each block of BLOCK_M sorted slots labelled with its expert (-1: a block past the
end, skipped). The buffer has room for the worst case (every expert padded by BLOCK_M - 1).

Kernel: one program per (block of BLOCK_M pairs, BLOCK_N output columns); its rows are gathered through the sorted
pair ids (A's row: the pair's token for the first GEMM, the pair itself for the second), the expert's weight tile
read once for all of them (vLLM's fused_moe idea: one weight read per block, not per token), fp32 accumulation,
optionally times the pair's routing weight, stored at the pair's row. Sentinel rows are masked. Runs on CUDA
tensors, or on CPU under TRITON_INTERPRET=1 (jitted on first launch: see runtime.py).
"""

from __future__ import annotations  # keeps the kernel's `tl.constexpr` annotations unevaluated

import torch

from kvforge.core.kernels.checks import FLOAT_DTYPES
from kvforge.core.kernels.runtime import Kernel, check_runnable, interpreting, tl, triton

BLOCK_M = 16  # pairs per program: tl.dot's least; decode steps route few pairs to each expert
BLOCK_N = 64
BLOCK_K = 32


def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
    N, K, pairs, a_rows_per_pair,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    MUL_WEIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < pairs
        a_rows = a_ptr + (ids // a_rows_per_pair).to(tl.int64)[:, None] * stride_am
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        # tl.full, not tl.zeros (jitted at triton's import: not callable under an interpreter switched on later)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if BF16_BY_HAND:  # the interpreter's tl.dot multiplies bf16 as raw uint16: the same numbers in fp32
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        if MUL_WEIGHT:
            acc = acc * tl.load(weight_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
        if BF16_BY_HAND:  # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates
            bits = acc.to(tl.uint32, bitcast=True)
            acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
        out = out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


_kernel = Kernel(_moe_gemm_kernel)


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """experts [T, k] -> (sorted pair ids [P], each BLOCK_M block's expert [P / block_m]): see the module's text."""
    flat = experts.flatten()
    pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: CUDA's bincount reads the largest id back to the host (a sync, no CUDA graph)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded  # where each expert's run starts in the padded order
    sorted_start = torch.cumsum(counts, 0) - counts  # where it starts in the sorted order
    sorted_experts = flat[order]
    slot = padded_start[sorted_experts] + torch.arange(pairs, device=device) - sorted_start[sorted_experts]
    capacity = pairs + num_experts * (block_m - 1)
    capacity += -capacity % block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_ids[slot] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    padded_end = torch.cumsum(padded, 0)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids, block_experts


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_experts: torch.Tensor, pairs: int, a_rows_per_pair: int,
                  weights: torch.Tensor | None) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _kernel[grid](
        a, w, out, sorted_ids, block_experts, weights if weights is not None else a,
        n, k, pairs, a_rows_per_pair,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        MUL_WEIGHT=weights is not None, INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BF16_BY_HAND=interpreting() and a.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, activation) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows); w_down [E, H, I]; experts and
    weights [T, k] (the router's choice, weights in x's dtype); activation: [rows, 2I] -> [rows, I] (SiLU-and-mul).
    Returns the experts' weighted sum [T, H] in x's dtype."""
    if x.dtype not in FLOAT_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"fused_moe: x and the expert weights must share one of float32 / bfloat16 / float16, got "
                         f"{x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    tokens, hidden = x.shape
    num_experts, inter2, _ = w_gate_up.shape
    if w_gate_up.shape[2] != hidden or tuple(w_down.shape) != (num_experts, hidden, inter2 // 2):
        raise ValueError(f"fused_moe: w_gate_up [E, 2I, {hidden}] and w_down [E, {hidden}, I] expected, got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if experts.shape != weights.shape or experts.shape[0] != tokens:
        raise ValueError(f"fused_moe: experts and weights must both be [{tokens}, k]")
    check_runnable(x, w_gate_up, w_down, experts, weights, name="fused_moe")
    top_k = experts.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    sorted_ids, block_experts = align_by_expert(experts, num_experts)
    gate_up = x.new_empty(pairs, inter2)
    _grouped_gemm(x, w_gate_up, gate_up, sorted_ids, block_experts, pairs, top_k, None)
    act = activation(gate_up)
    down = x.new_empty(pairs, hidden)
    _grouped_gemm(act, w_down, down, sorted_ids, block_experts, pairs, 1, weights.flatten().contiguous())
    return down.view(tokens, top_k, hidden).sum(dim=1)
