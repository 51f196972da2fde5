"""Quantized KV rows: the byte layout of a KV pool stored in int8, fp8 (e4m3 / e5m2) or 4 bits, and its reference
quantize / dequantize in torch.

One row is one token's K (or V) for one KV head: its `head_dim` values in the format's code, then its bf16 scales (one
per row for the 8-bit formats, one per 32 values for q4, whose K scales sit in V's row), so a pool block stays one
contiguous run of bytes [block_size, row_bytes] per (K/V, head): the pool, its blocks, their copies, the persisted tier
and the tensor-parallel split by heads keep the layout of a full-precision pool, with bytes (uint8) for elements. Scales
per token and head (not per block) mean a block that grows one token at a time is never requantized, and a row's codes
depend on that row alone (q4: on that token's K and V): the same token stored by any path (the C kernel, Triton, this
reference) gets the same bytes. Scales are bf16, not fp16 as llama.cpp's: the codes are computed from the rounded scale,
so its precision costs nothing, but its range does -- fp8_e5m2's max|x| / 57344 is an fp16 subnormal (a few bits) for
any row below 3.5.

Every reader dequantizes in registers (core/cpu_kernels/paged_attention.c, core/kernels/); the torch paths that
gather a context (core/layers/attention.py) dequantize what they gathered, as they would convert it. The codes:
- int8: round(x / s), s = max|x| / 127 (llama.cpp's q8_0 with a per-row scale);
- fp8_e4m3, fp8_e5m2: x / s in the fp8 format (round to nearest even), s = max|x| / the format's largest value
  (448, 57344): vLLM's fp8 KV with per-token-head scales instead of one per tensor;
- q4: V in 4 bits, K in 5 (llama.cpp's `-ctk q5_0 -ctv q4_0` arithmetic), groups of 32 values, on rows rotated first:
  s = m / -2^(b-1) where m is the group's value of largest magnitude, codes round(x / s) in [-2^(b-1), 2^(b-1) - 1]
  stored + 2^(b-1); 4-bit codes two per byte (value 2i in the low nibble), K's fifth bits after its nibbles (value
  8j + i in bit i of byte j). K's error is what the attention scores feel: on 2048 tokens of held-out text (fp32),
  4-bit K and V raised perplexity by 6.2% on the embedded model and 15.9% on Gemma 3 270M, 4-bit V alone by 0.4% and
  0.5%, 4-bit K alone by 5.5% and 13.8%; 5-bit K with 4-bit V by 1.7% and 4.3% (K in 4 bits with groups of 16: 4.4%
  and 10.4%, the same bytes; K's channel mean taken out or K's channels rescaled (smoothing, either way): no better).
  So that every pool row keeps one width, K's row holds its codes (5 * head_dim / 8 bytes) and V's row its codes, its
  scales and K's scales (the same size): 5 bits per value on average, 0.31x the bytes of bf16.

Rotation (`KVFormat.rotate`, q4): the attention layer multiplies k and v by the Hadamard matrix H (entries +-1) before
the store, q by H / head_dim, and the output by H / head_dim after (H H^T = head_dim I: scores are unchanged, q H / d
(k H)^T = q k^T, and the weighted values come out as (p v) H, turned back by H / d). Both matrices are exact in any
dtype (head_dim a power of two): in torch each rotation is one fp32 matmul, rounded once to the model's dtype; where
the C kernels take every row of a step (the store and the paged kernel, layers/attention.py) they rotate as they write
and read instead, by the fast transform (core/cpu_kernels/common.h hadamard_row: K, V and q rounded as torch rounds
them, the output rotated back before its one rounding), which took q4's batch-1 decode from 0.85x to 1.05x the bf16
KV's tok/s (four small matmuls a layer gone). It spreads a
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
    bits: int  # per value (V's, where K has more)
    group: int  # values per scale; 0: the whole row (one scale per token and head)
    limit: float  # the largest code magnitude
    rotate: bool = False  # rows hold K and V times `hadamard(head_dim)` (see above)
    key_bits: int = 0  # K's bits per value where they differ from V's (q4: 5); 0: the same
    layout: int = 1  # the row layout's revision: persisted blocks name it, so a block is never read in another layout

    @property
    def stored_as(self) -> str:
        """The name persisted blocks and their fingerprint carry: the format and its layout revision (q4's first layout,
        4-bit K codes and each row's own scales, is never read as its second)."""
        return self.name if self.layout == 1 else f"{self.name}.{self.layout}"

    def groups(self, head_dim: int) -> int:
        return head_dim // self.group if self.group else 1

    def value_bytes(self, head_dim: int) -> int:
        """Bytes of V's codes in a row (and of K's, where K has V's bits)."""
        return head_dim * self.bits // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one head. 8-bit formats: codes, then the bf16 scale. With wider K codes
        (q4): K's row holds its codes (low nibbles, then one byte of fifth bits per 8 values) and V's its codes, its
        scales and K's scales, so both rows have the same size (the pool's rows are all one width)."""
        if self.key_bits:
            return head_dim * self.key_bits // 8
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

    def quantize(self, kv: torch.Tensor) -> torch.Tensor:
        """kv [2 (K, V), ..., head_dim] (any float dtype) -> their rows [2, ..., row_bytes] uint8."""
        if kv.shape[0] != 2:
            raise ValueError(f"quantize takes K and V stacked on the first dimension, got shape {tuple(kv.shape)}")
        head_dim = kv.shape[-1]
        if not self.key_bits:
            codes, scales = self._codes(kv, self.bits)
            return torch.cat((self._packed(codes), scales), -1)
        k_codes, k_scales = self._codes(kv[0], self.key_bits)
        v_codes, v_scales = self._codes(kv[1], self.bits)
        fifth = (k_codes >> 4).reshape(*k_codes.shape[:-1], head_dim // 8, 8)
        high = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # value 8j + i: bit i of byte j
        k_row = torch.cat((self._packed(k_codes & 15), high), -1)
        v_row = torch.cat((self._packed(v_codes), v_scales, k_scales), -1)
        return torch.stack((k_row, v_row))

    def _codes(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., head_dim] -> (codes [..., head_dim] uint8, bf16 scales as bytes [..., 2 * groups])."""
        lead, head_dim = x.shape[:-1], x.shape[-1]
        size = self.group or head_dim
        grouped = x.float().reshape(*lead, head_dim // size, size)
        if self.group:  # the group's value of largest magnitude (the first of equals) maps to the lowest code
            low = 2.0 ** (bits - 1)
            biggest = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))
            scale = (biggest / -low).bfloat16()
        else:
            scale = (grouped.abs().amax(-1, keepdim=True) / self.limit).bfloat16()
        wide = scale.float()
        scaled = grouped / torch.where(wide == 0, torch.ones_like(wide), wide)  # past the limit by a rounding: clamped
        if self.name == "int8":
            codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        elif self.group:  # stored + 2^(bits - 1): 0 .. 2^bits - 1
            codes = (scaled.round().clamp(-low, low - 1) + low).to(torch.uint8)
        else:
            codes = scaled.clamp(-self.limit, self.limit).to(FP8_DTYPES[self.name]).view(torch.uint8)
        return codes.reshape(*lead, head_dim), scale.reshape(*lead, -1).view(torch.uint8)

    def _packed(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., head_dim] -> their bytes: one each, or two 4-bit codes per byte (value 2i in the low nibble)."""
        if self.bits == 8:
            return codes
        pairs = codes.reshape(*codes.shape[:-1], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    def dequantize(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """rows [2 (K, V), ..., row_bytes] uint8 (any strides) -> the values [2, ..., head_dim] in `dtype` (fp32
        math)."""
        if rows.shape[0] != 2:
            raise ValueError(f"dequantize takes K and V rows stacked on the first dimension, got {tuple(rows.shape)}")
        count, lead = self.value_bytes(head_dim), rows.shape[1:-1]
        if not self.key_bits:
            scales = rows[..., count:count + 2].contiguous().view(torch.bfloat16).float()
            return self._values(rows[..., :count], scales, head_dim, dtype)
        k_rows, v_rows, scale_bytes = rows[0], rows[1], 2 * self.groups(head_dim)
        high = k_rows[..., count:count + head_dim // 8]
        fifth = (high.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        k_codes = self._unpacked(k_rows[..., :count], head_dim) + 16 * fifth.reshape(*lead, head_dim).float()
        k_scales = v_rows[..., count + scale_bytes:count + 2 * scale_bytes].contiguous().view(torch.bfloat16).float()
        v_scales = v_rows[..., count:count + scale_bytes].contiguous().view(torch.bfloat16).float()
        return torch.stack((self._scaled(k_codes - 2.0 ** (self.key_bits - 1), k_scales, head_dim, dtype),
                            self._scaled(self._unpacked(v_rows[..., :count], head_dim) - 2.0 ** (self.bits - 1),
                                         v_scales, head_dim, dtype)))

    def _values(self, codes: torch.Tensor, scales: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """An 8-bit format's codes [..., head_dim] and row scales [..., 1] -> values."""
        if self.name == "int8":
            values = codes.view(torch.int8).float()
        else:
            values = codes.contiguous().view(FP8_DTYPES[self.name]).float()
        return self._scaled(values, scales, head_dim, dtype)

    @staticmethod
    def _unpacked(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Two 4-bit codes per byte -> [..., head_dim] fp32 codes."""
        return torch.stack((packed & 15, packed >> 4), -1).reshape(*packed.shape[:-1], head_dim).float()

    def _scaled(self, values: torch.Tensor, scales: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        lead, size = values.shape[:-1], self.group or head_dim
        out = values.reshape(*lead, head_dim // size, size) * scales.unsqueeze(-1)
        return out.reshape(*lead, head_dim).to(dtype)


FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_FORMATS = {f.name: f for f in (
    KVFormat("int8", 3, 8, 0, 127.0), KVFormat("fp8_e4m3", 4, 8, 0, 448.0), KVFormat("fp8_e5m2", 5, 8, 0, 57344.0),
    KVFormat("q4", 6, 4, 32, 8.0, rotate=True, key_bits=5, layout=2))}


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
