"""A tile of a quantized KV cache's rows dequantized in registers: what the paged decode and prefill kernels both read
(core/kv/quant.py's layout: a row's codes, then its bf16 scales; q4's K scales in the V row). Jitted with the kernel
that calls it, in the same interpreter mode (runtime.Kernel's `helpers`)."""

from __future__ import annotations  # keeps the `tl.constexpr` annotations unevaluated

from kvforge.core.kernels.checks import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8, KV_Q4
from kvforge.core.kernels.runtime import tl


def load_kv_tile(base, v_base, rows, offs_d, row_mask, mask_d, stride_d,
                 HEAD_DIM: tl.constexpr, KV_GROUP: tl.constexpr, KV_FORMAT: tl.constexpr, KEY: tl.constexpr):
    """The rows [n] (byte offsets from `base`, K's plane where KEY, else V's) x values `offs_d` of a quantized cache,
    as fp32: code value times its bf16 scale, as KVFormat.dequantize; masked rows and columns read 0. `v_base`: V's
    plane (q4's K rows keep their scales in the V rows of the same tokens)."""
    kv_mask = row_mask[:, None] & mask_d[None, :]
    if KV_FORMAT == KV_Q4:  # value 2i in the low nibble of byte i; a scale per value's group
        code_offs = rows[:, None] + (offs_d // 2)[None, :] * stride_d
        if KEY:  # after V's codes and V's scales
            scale_offs = rows[:, None] + (HEAD_DIM // 2 + 2 * (HEAD_DIM // KV_GROUP + offs_d // KV_GROUP))[None, :] \
                * stride_d
        else:
            scale_offs = rows[:, None] + (HEAD_DIM // 2 + 2 * (offs_d // KV_GROUP))[None, :] * stride_d
        scale_mask = kv_mask
    else:  # one scale per row
        code_offs = rows[:, None] + offs_d[None, :] * stride_d
        scale_offs = rows[:, None] + HEAD_DIM * stride_d
        scale_mask = row_mask[:, None]
    c = tl.load(base + code_offs, mask=kv_mask, other=0)
    # the scale's two bytes (little-endian), loaded one by one: no alignment asked of the cache
    scale_base = v_base if KV_FORMAT == KV_Q4 and KEY else base
    bits = (tl.load(scale_base + scale_offs, mask=scale_mask, other=0).to(tl.uint32)
            | (tl.load(scale_base + scale_offs + stride_d, mask=scale_mask, other=0).to(tl.uint32) << 8))
    if KV_FORMAT == KV_INT8:
        x = c.to(tl.int8, bitcast=True).to(tl.float32)
    elif KV_FORMAT == KV_Q4:
        nibble = (c >> ((offs_d % 2) * 4)[None, :]) & 15
        if KEY:  # 5-bit codes: the fifth bits after the nibbles, value 8j + i in bit i of byte j
            high = tl.load(base + rows[:, None] + (HEAD_DIM // 2 + offs_d // 8)[None, :] * stride_d, mask=kv_mask,
                           other=0)
            x = (nibble | (((high >> (offs_d % 8)[None, :]) & 1) << 4)).to(tl.float32) - 16.0
        else:
            x = nibble.to(tl.float32) - 8.0
    elif KV_FORMAT == KV_FP8_E5M2:  # e5m2 is fp16's top byte
        x = (c.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # e4m3's bits placed in an fp16 are its value / 2**8 (biases 7 and 15), subnormals too
        tl.static_assert(KV_FORMAT == KV_FP8_E4M3)
        half = ((c & 0x80).to(tl.uint16) << 8) | ((c & 0x7F).to(tl.uint16) << 7)
        x = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return x * (bits << 16).to(tl.float32, bitcast=True)
