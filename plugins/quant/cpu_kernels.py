"""torch's CPU weight-only int4 matmul, behind one function pair (pack once, multiply per call).

`_convert_weight_to_int4pack_for_cpu` / `_weight_int4pack_mm_for_cpu` are private aten ops: on this
project's CPUs the embedded model's linears take ~2 ms per token with them against ~49 ms dense fp32
(shared NOTES). They compute in bf16 (their fp32 path is a slow reference) and take groups of 32, 64,
128 or 256 input features with W = (q - 8) * scale + zero. Any group size that is a multiple of 32 is
expressed with a supported group that divides it (scales repeated). Tested against a dequantized
reference in tests/plugins/test_gptq_awq.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4PACK_GROUPS = (256, 128, 64, 32)
COMPUTE_DTYPE = torch.bfloat16


def int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(
        torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4pack_group(group_size: int, in_features: int) -> int | None:
    """The largest group the op supports that divides both the checkpoint's group and K; None: none."""
    for group in INT4PACK_GROUPS:
        if group_size % group == 0 and in_features % group == 0:
            return group
    return None


@dataclass
class Int4Packed:
    weight: torch.Tensor  # uint8 [N, K/2] in the op's layout
    scales_and_zeros: torch.Tensor  # bf16 [K/group, N, 2]
    group: int
    input_perm: torch.Tensor | None  # input features reordered so that groups are contiguous (act-order)

    def nbytes(self) -> int:
        perm = 0 if self.input_perm is None else self.input_perm.numel() * self.input_perm.element_size()
        return (self.weight.numel() * self.weight.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size() + perm)


def pack_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> Int4Packed | None:
    """q [K, N] in [0, 16), zeros / scales [groups, N], g_idx [K]: W[n, k] = scales[g, n] * (q[k, n] - zeros[g, n])
    with g = g_idx[k]. Returns None when the layout cannot be expressed (then use another kernel)."""
    k, n = q.shape
    groups = scales.shape[0]
    if k % groups or n % 16:  # the op packs 16 output features at a time
        return None
    group_size = k // groups
    perm = None
    contiguous = torch.arange(k, dtype=torch.int64) // group_size
    if not torch.equal(g_idx.long(), contiguous):  # act-order: sort the input features by group
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], contiguous):
            return None  # groups of unequal sizes
        q = q[perm]
    group = int4pack_group(group_size, k)
    if group is None:
        return None
    repeat = group_size // group
    s = scales.float().repeat_interleave(repeat, dim=0)
    z = zeros.float().repeat_interleave(repeat, dim=0)
    scales_and_zeros = torch.stack((s, s * (8 - z)), dim=-1).to(COMPUTE_DTYPE).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.to(torch.int32).contiguous(), 1)
    return Int4Packed(weight, scales_and_zeros, group, perm)


def pack_int4_affine(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> Int4Packed | None:
    """q [N, K] in [0, 16), scales / offsets [N, K / group]: W[n, k] = scales[n, g] * q[n, k] + offsets[n, g]
    (g = k // group; GGUF's asymmetric form). None when the op cannot take the shape."""
    n, k = q.shape
    if n % 16 or group not in INT4PACK_GROUPS or k % group:
        return None
    # the op computes (q - 8) * scale + zero: zero = offset + 8 * scale
    scales_and_zeros = torch.stack((scales.T.float(), (offsets.float() + 8 * scales.float()).T), dim=-1)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return Int4Packed(weight, scales_and_zeros.to(COMPUTE_DTYPE).contiguous(), group, None)


def int4_linear(x: torch.Tensor, packed: Int4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias), computed in bf16, returned in x.dtype."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if packed.input_perm is not None:
        flat = flat[:, packed.input_perm]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        flat.to(COMPUTE_DTYPE).contiguous(), packed.weight, packed.group, packed.scales_and_zeros).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])
