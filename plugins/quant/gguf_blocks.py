"""GGUF's quantized block types, decoded into one affine form: W = scale * code + offset per group.

Every type kvforge keeps quantized stores, per group of 16 or 32 input features, small integer codes with
one fp32 scale and (for the asymmetric types) one fp32 offset, and the `gguf` package dequantizes them in
fp32 as `scale * code + offset` (or `scale * code`). Decoding to that form is lossless: the fp32 scale and
offset are the products GGUF's own dequantizer forms (an fp16 times a 6- or 8-bit integer: exact in fp32),
so `scale * code + offset` here is bit for bit `gguf.quants.dequantize` (tested per type).

The bit layouts follow gguf-py's `quants.py` (the reference the tests compare with). Written here because
gguf-py only offers the dequantized product, and the kernels need the codes, scales and offsets apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # features per K-quant super-block


def affine_weight(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int) -> torch.Tensor:
    """W [N, K] in fp32 from codes [N, K] and scales / offsets [N, K / group]: scale * code (+ offset), as GGUF
    computes it."""
    w = scales.repeat_interleave(group, dim=1) * codes.float()
    return w if offsets is None else w + offsets.repeat_interleave(group, dim=1)


@dataclass
class GroupCodes:
    """A [N, K] weight as codes [N, K] (int8), scales / offsets [N, K / group] (fp32; offsets None: zero)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in fp32, computed as GGUF computes it."""
        return affine_weight(self.codes, self.scales, self.offsets, self.group)

    def stored(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scales and offsets at a `group` dividing the type's own (each scale repeated; zero offsets for a
        symmetric type): the layout the gguf checkpoint stores and its method loads."""
        repeat = self.group // group
        offsets = self.offsets if self.offsets is not None else torch.zeros_like(self.scales)
        return (self.codes.contiguous(), self.scales.repeat_interleave(repeat, dim=1).contiguous(),
                offsets.repeat_interleave(repeat, dim=1).contiguous())


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [..., width / 2] -> [..., width]: low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """The little-endian bit i of a block's `qh` bytes, for i < count, as 0 / 1."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits[..., :count]


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 32).astype(np.int8) - 8, d, None, 32


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 32).astype(np.int8), d, m, 32


def _q5_0(b: np.ndarray):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:], 32) | (_high_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int8) - 16, d, None, 32


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:], 32) | (_high_bits(b[:, 4:8], 32) << 4)
    return q.astype(np.int8), d, m, 32


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32


def _q4_k(b: np.ndarray):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)  # 4 x 32 bytes: sub-blocks 2j (low nibbles) and 2j+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, QK_K)
    return q.astype(np.int8), d * sc, -(dmin * mn), 32


def _q5_k(b: np.ndarray):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]  # bit j of byte i: the fifth bit of feature 32 j + i
    qs = b[:, 48:].reshape(n, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).reshape(n, QK_K)
    return q.astype(np.int8), d * sc, -(dmin * mn), 32


def _q6_k(b: np.ndarray):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)  # two halves of 128 features
    qh = b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # [low 64 | high 64] per half
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    q = (low | (high << 4)).reshape(n, QK_K).astype(np.int8) - 32
    return q, d * scales, None, 16


DECODERS = {
    GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0, GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k, GGMLQuantizationType.Q6_K: _q6_k,
}
FOUR_BIT = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)  # codes in 4 bits
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED = tuple(t.name for t in (*DECODERS, *FLOAT_TYPES))


def decode(data: np.ndarray, qtype: GGMLQuantizationType) -> GroupCodes:
    """A quantized GGUF tensor's bytes, [N, K * type_size / block_size] as gguf's reader maps them, as codes."""
    decoder = DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(f"GGUF tensor type {qtype.name} is not supported natively (supported: "
                         f"{', '.join(SUPPORTED)}); load the file with --gguf-dense to dequantize it")
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    codes, scales, offsets, group = decoder(blocks)
    per_row = blocks.shape[0] // rows * block
    codes = torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, per_row))
    scales = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, per_row // group))
    if offsets is not None:
        offsets = torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, per_row // group))
    return GroupCodes(codes, scales, offsets, group)


def encode_centred(codes: torch.Tensor, scales: torch.Tensor) -> tuple[GGMLQuantizationType, torch.Tensor]:
    """W = scale * (code - centre) per 32 input features as GGUF blocks the C kernels read: codes [N, K] in 0..15
    (centre 8) as Q4_0, in 0..31 (centre 16) as Q5_0; scales [N, K / 32], each an fp16 value (stored as fp16, so
    exactly). Returns the type and the blocks, uint8 [N, K / 32 * block bytes] (the layouts _q4_0 / _q5_0 read)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 32)
    d = scales.to(torch.float16).contiguous().reshape(n, k // 32, 1).view(torch.uint8)  # 2 bytes, little-endian
    low = (c[..., :16] & 0x0F) | ((c[..., 16:] & 0x0F) << 4)  # weight j's low nibble, weight j + 16's in the high one
    if int(codes.max()) < 16:
        qtype, parts = GGMLQuantizationType.Q4_0, [d, low]
    else:
        bits = (c >> 4) & 1  # the fifth bit of each of the 32 codes, little-endian over 4 bytes
        bit_values = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
        qh = (bits.view(n, k // 32, 4, 8) * bit_values).sum(-1, dtype=torch.uint8)
        qtype, parts = GGMLQuantizationType.Q5_0, [d, qh, low]
    return qtype, torch.cat(parts, dim=-1).reshape(n, -1).contiguous()
