"""GPTQ and AWQ weight layouts: packing 4/8-bit integers into int32 words, and dequantization.

Pure torch, no GPTQ/AWQ package needed (K = in_features, N = out_features, G = group size):
- GPTQ: `qweight` int32 [K*bits/32, N] packed along K, lowest bits first; `qzeros` int32
  [K/G, N*bits/32] packed along N; `scales` [K/G, N]; `g_idx` int32 [K] (desc_act permutes only g_idx,
  rows keep their order). W[n, i] = scales[g_idx[i], n] * (q[i, n] - z[g_idx[i], n]). Checkpoint format
  "gptq" (v1) stores z - 1, "gptq_v2" stores z.
- AWQ "gemm": `qweight` int32 [K, N/8] packed along N in the interleaved order AWQ_ORDER; `qzeros`
  [K/G, N/8] packed the same way; `scales` [K/G, N]; no g_idx, no zero offset.

`quantize_rtn` (round to nearest, per group) and the packers write small golden checkpoints for tests
and the reference the plugins' kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column AWQ_ORDER[j] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE_ORDER[c]


def _per_word(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    return 32 // bits


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] integers in [0, 2**bits) -> int32 [R*bits/32, C], consecutive rows in one word."""
    per = _per_word(bits)
    if values.shape[0] % per:
        raise ValueError(f"{values.shape[0]} rows do not fill {bits}-bit words of {per}")
    v = values.to(torch.int64).view(-1, per, values.shape[1])
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return _to_int32((v << shifts).sum(dim=1))


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    per = _per_word(bits)
    shifts = (torch.arange(per, dtype=torch.int32) * bits).view(1, per, 1)
    values = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1])


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] integers -> int32 [R, C*bits/32], consecutive columns in one word (in `order`)."""
    per = _per_word(bits)
    if values.shape[1] % per:
        raise ValueError(f"{values.shape[1]} columns do not fill {bits}-bit words of {per}")
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, 1, per)
    return _to_int32((v << shifts).sum(dim=2))


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per = _per_word(bits)
    shifts = (torch.arange(per, dtype=torch.int32) * bits).view(1, 1, per)
    values = (words.unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    if order is not None:  # undo the interleave: column c is in slot reverse[c]
        reverse = [order.index(c) for c in range(per)]
        values = values[:, :, reverse]
    return values.reshape(words.shape[0], -1)


@dataclass
class Quantized:
    """A linear layer's weight, quantized per group along the input dimension."""
    q: torch.Tensor  # int64 [K, N] in [0, 2**bits)
    zeros: torch.Tensor  # int64 [groups, N]
    scales: torch.Tensor  # [groups, N]
    g_idx: torch.Tensor  # int32 [K]: the group of each input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for, [N, K] (out, in)."""
        g = self.g_idx.long()
        return (self.scales[g].float() * (self.q - self.zeros[g]).float()).T.contiguous()


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 desc_act: bool = False, order: torch.Tensor | None = None) -> Quantized:
    """Round-to-nearest quantization of weight [N, K] (group_size -1: one group per row); with
    `desc_act`, groups follow the input features in `order` (default: decreasing magnitude, what
    GPTQ's act-order does with activations), so g_idx is not monotonic while the rows keep their order."""
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features {k}")
    maxq = (1 << bits) - 1
    groups = k // group_size
    # Whole-tensor ops on [N, groups, group_size] rather than a loop over groups (~3x less CPU, and ~10x less wall
    # time on a busy 2-core machine, where each small op waits on OpenMP threads); each step is elementwise or a
    # min / max per (row, group), so the values are what the loop computed.
    w = weight.float()  # [N, K]
    if desc_act and order is None:
        order = torch.argsort(w.T.abs().sum(dim=1), descending=True)
    # group g holds the input features order[g * group_size:(g + 1) * group_size]
    grouped = (w.index_select(1, order) if desc_act else w).reshape(n, groups, group_size)
    lo, hi = grouped.amin(dim=2).clamp(max=0), grouped.amax(dim=2).clamp(min=0)  # [N, groups]
    if sym:
        scales = torch.maximum(hi, -lo) * 2 / maxq
        zeros = torch.full((n, groups), (maxq + 1) // 2, dtype=torch.int64)
    else:
        scales = (hi - lo) / maxq
        zeros = torch.round(-lo / scales.clamp(min=1e-12)).to(torch.int64)
    scales, zeros = scales.clamp(min=1e-12), zeros.clamp(0, maxq)
    q = torch.round(grouped / scales.unsqueeze(2) + zeros.unsqueeze(2)).clamp(0, maxq).to(torch.int64).view(n, k)
    g_idx = torch.empty(k, dtype=torch.int32)
    if desc_act:  # back to the input features' order: column j of the grouped layout is feature order[j]
        q = torch.empty_like(q).index_copy_(1, order, q)
        g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    else:
        g_idx.copy_(torch.arange(k) // group_size)
    scale_dtype = weight.dtype if weight.is_floating_point() else torch.float16
    return Quantized(q.T.contiguous(), zeros.T.contiguous(), scales.T.to(scale_dtype).contiguous(), g_idx, bits)


def pack_gptq(quant: Quantized, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The layer's GPTQ tensors; "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    zeros = quant.zeros - 1 if checkpoint_format == "gptq" else quant.zeros
    mask = (1 << quant.bits) - 1
    return {"qweight": pack_rows(quant.q, quant.bits), "qzeros": pack_cols(zeros & mask, quant.bits),
            "scales": quant.scales.to(torch.float16), "g_idx": quant.g_idx.clone()}


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str = "gptq") -> Quantized:
    q = unpack_rows(tensors["qweight"], bits).to(torch.int64)
    zeros = unpack_cols(tensors["qzeros"], bits).to(torch.int64)
    if checkpoint_format == "gptq":
        # v1 stores zero - 1. A zero of 0 was stored as -1 masked to 2**bits - 1; read it back as the 0
        # the quantizer meant (auto-gptq's kernels read 2**bits there, and GPTQModel's v1 -> v2 word
        # addition carries into the next zero: both corrupt that group; sym checkpoints never hit this).
        zeros = zeros + 1
        zeros = torch.where(zeros == 1 << bits, torch.zeros_like(zeros), zeros)
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        groups = tensors["scales"].shape[0]
        g_idx = torch.arange(q.shape[0], dtype=torch.int32) // (q.shape[0] // groups)
    return Quantized(q, zeros, tensors["scales"], g_idx.to(torch.int32), bits)


def pack_awq(quant: Quantized) -> dict[str, torch.Tensor]:
    """AWQ "gemm" tensors (4-bit, contiguous groups: no desc_act)."""
    if quant.bits != 4:
        raise ValueError("AWQ gemm checkpoints are 4-bit")
    k = quant.q.shape[0]
    groups = quant.scales.shape[0]
    if not torch.equal(quant.g_idx, torch.arange(k, dtype=torch.int32) // (k // groups)):
        raise ValueError("AWQ has no g_idx: groups must be contiguous (no desc_act)")
    return {"qweight": pack_cols(quant.q, 4, AWQ_ORDER), "qzeros": pack_cols(quant.zeros, 4, AWQ_ORDER),
            "scales": quant.scales.to(torch.float16)}


def unpack_awq(tensors: dict[str, torch.Tensor]) -> Quantized:
    q = unpack_cols(tensors["qweight"], 4, AWQ_ORDER).to(torch.int64)
    zeros = unpack_cols(tensors["qzeros"], 4, AWQ_ORDER).to(torch.int64)
    k, groups = q.shape[0], tensors["scales"].shape[0]
    g_idx = torch.arange(k, dtype=torch.int32) // (k // groups)
    return Quantized(q, zeros, tensors["scales"], g_idx, 4)
