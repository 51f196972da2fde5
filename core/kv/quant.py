"""Quantized KV rows: the byte layout of a KV pool stored in int8, fp8 (e4m3 / e5m2) or 4 bits, and its reference
quantize / dequantize in torch.

One row is one token's K (or V) for one KV head: its `head_dim` values in the format's code, then its bf16 scales
(one per row for the 8-bit formats, one per 32 values for q4), so a pool block stays one contiguous run of bytes
[block_size, row_bytes] per (K/V, head): the pool, its blocks, their copies, the persisted tier and the tensor-parallel
split by heads keep the layout of a full-precision pool, with bytes (uint8) for elements. Scales per token and head
(not per block) mean a block that grows one token at a time is never requantized, and a row's codes depend on that
row alone: the same token stored by any path (the C kernel, Triton, this reference) gets the same bytes. Scales are
bf16, not fp16 as llama.cpp's: the codes are computed from the rounded scale, so its precision costs nothing, but its
range does -- fp8_e5m2's max|x| / 57344 is an fp16 subnormal (a few bits) for any row below 3.5.

Every reader dequantizes in registers (core/cpu_kernels/paged_attention.c, core/kernels/); the torch paths that
gather a context (core/layers/attention.py) dequantize what they gathered, as they would convert it. The codes:
- int8: round(x / s), s = max|x| / 127 (llama.cpp's q8_0 with a per-row scale);
- fp8_e4m3, fp8_e5m2: x / s in the fp8 format (round to nearest even), s = max|x| / the format's largest value
  (448, 57344): vLLM's fp8 KV with per-token-head scales instead of one per tensor;
- q4: groups of 32 values, s = m / -8 where m is the group's value of largest magnitude, codes round(x / s) in
  [-8, 7] stored + 8, two per byte (value 2i in the low nibble): llama.cpp's q4_0 arithmetic, on rows rotated first.

Rotation (`KVFormat.rotate`, q4): the attention layer multiplies k and v by the Hadamard matrix H (entries +-1) before
the store, q by H / head_dim, and the output by H / head_dim after (H H^T = head_dim I: scores are unchanged, q H / d
(k H)^T = q k^T, and the weighted values come out as (p v) H, turned back by H / d). Both matrices are exact in any
dtype (head_dim a power of two): each rotation is one fp32 matmul, rounded once to the model's dtype. It spreads a
head's few large channels over all of them, so 4 bits per value no longer spend their range on outliers: on the
embedded model, 2048 tokens of held-out text, q4 without it raised perplexity by 15%, with it by 5% (asymmetric groups
without it: 11%; 16 non-uniform levels: no better). The pool's q4 rows hold the rotated values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    name: str
    code: int  # the kernels' code for it (core/cpu_kernels/common.h, core/kernels/): after the activation dtypes
    bits: int  # per value
    group: int  # values per scale; 0: the whole row (one scale per token and head)
    limit: float  # the largest code magnitude
    rotate: bool = False  # rows hold K and V times `hadamard(head_dim)` (see above)

    def groups(self, head_dim: int) -> int:
        return head_dim // self.group if self.group else 1

    def value_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one head: codes, then bf16 scales."""
        return self.value_bytes(head_dim) + 2 * self.groups(head_dim)

    def unstorable(self, head_dim: int) -> str | None:
        """Why rows of this head size cannot be laid out in this format (a group cut in two), or None."""
        if self.group and head_dim % self.group:
            return (f"{self.name} KV stores groups of {self.group} values; the model's head_dim {head_dim} is not a "
                    "multiple")
        return None

    def unsupported(self, head_dim: int) -> str | None:
        """Why a model with this head size cannot store its KV in this format (its rows, or their rotation), or None."""
        if (why := self.unstorable(head_dim)) is not None:
            return why
        if self.rotate and head_dim & (head_dim - 1):
            return (f"{self.name} KV rotates rows by a Hadamard matrix, which needs a power-of-two head_dim, not "
                    f"{head_dim}")
        return None

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] (any float dtype) -> its rows [..., row_bytes] uint8."""
        lead, head_dim = x.shape[:-1], x.shape[-1]
        size = self.group or head_dim
        grouped = x.float().reshape(*lead, head_dim // size, size)
        if self.name == "q4":  # the group's value of largest magnitude (the first of equals) maps to -8
            biggest = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))
            scale = (biggest / -8).bfloat16()
        else:
            scale = (grouped.abs().amax(-1, keepdim=True) / self.limit).bfloat16()
        wide = scale.float()
        scaled = grouped / torch.where(wide == 0, torch.ones_like(wide), wide)  # past the limit by a rounding: clamped
        if self.name == "int8":
            codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        elif self.name == "q4":
            nibbles = (scaled.round().clamp(-8, 7) + 8).to(torch.uint8).reshape(*lead, head_dim // 2, 2)
            codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
        else:
            codes = scaled.clamp(-self.limit, self.limit).to(FP8_DTYPES[self.name]).view(torch.uint8)
        scales = scale.reshape(*lead, -1).view(torch.uint8)
        return torch.cat((codes.reshape(*lead, -1), scales), -1)

    def dequantize(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """rows [..., row_bytes] uint8 (any strides) -> the values [..., head_dim] in `dtype` (fp32 math)."""
        lead, count = rows.shape[:-1], self.value_bytes(head_dim)
        codes = rows[..., :count]
        scales = rows[..., count:self.row_bytes(head_dim)].contiguous().view(torch.bfloat16).float()
        if self.name == "int8":
            values = codes.view(torch.int8).float()
        elif self.name == "q4":
            values = torch.stack((codes & 15, codes >> 4), -1).reshape(*lead, head_dim).float() - 8
        else:
            values = codes.contiguous().view(FP8_DTYPES[self.name]).float()
        size = self.group or head_dim
        out = values.view(*lead, head_dim // size, size) * scales.unsqueeze(-1)
        return out.view(*lead, head_dim).to(dtype)


FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_FORMATS = {f.name: f for f in (KVFormat("int8", 3, 8, 0, 127.0), KVFormat("fp8_e4m3", 4, 8, 0, 448.0),
                                  KVFormat("fp8_e5m2", 5, 8, 0, 57344.0), KVFormat("q4", 6, 4, 32, 8.0, rotate=True))}


@functools.cache
def hadamard(size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             inverse: bool = False) -> torch.Tensor:
    """The Sylvester Hadamard matrix H of a power-of-two `size` (entries +-1, symmetric, H H = size I), or with
    `inverse` its inverse H / size; both exact in any float dtype."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return (matrix / size if inverse else matrix).to(dtype=dtype, device=device)


def check_kv_cache(name: str, kv_format: KVFormat | None, kv_cache: torch.Tensor, head_dim: int) -> None:
    """A ValueError naming the kernel `name`, the cache and the format where they do not go together: a format needs a
    uint8 cache of its row_bytes(head_dim) per row (whole groups); full precision (None) refuses a uint8 cache (the
    kernels check a float cache's dtype against their own inputs). The C and the Triton kernels' one check."""
    if kv_format is None:
        if kv_cache.dtype == torch.uint8:
            raise ValueError(f"{name}: kv_cache is uint8 (a quantized pool) but kv_format is None")
        return
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"{name}: kv_format {kv_format.name} stores uint8 rows, but kv_cache is {kv_cache.dtype}")
    if (why := kv_format.unstorable(head_dim)) is not None:
        raise ValueError(f"{name}: {why}")
    if kv_cache.shape[-1] != kv_format.row_bytes(head_dim):
        raise ValueError(f"{name}: kv_format {kv_format.name} stores rows of {kv_format.row_bytes(head_dim)} bytes "
                         f"at head_dim {head_dim}, but kv_cache rows have {kv_cache.shape[-1]}")


def kv_format(name: str) -> KVFormat | None:
    """The format named (None for auto: the model's dtype, unquantized), or a ValueError listing the names."""
    if name == "auto":
        return None
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]
