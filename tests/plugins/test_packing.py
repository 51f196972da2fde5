"""GPTQ / AWQ packing: round trips, the exact bit layouts the checkpoints use, and golden checkpoints
made by our own packer (sym / asym / desc_act / v1 / v2, 4 and 8 bits) that dequantize to the
quantizer's own reconstruction and close to the original weight."""

from __future__ import annotations

import pytest
import torch

from kvforge.plugins.quant.packing import (
    AWQ_ORDER,
    pack_awq,
    pack_cols,
    pack_gptq,
    pack_rows,
    quantize_rtn,
    unpack_awq,
    unpack_cols,
    unpack_gptq,
    unpack_rows,
)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_row_and_column_packing_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (64, 48), generator=g)
    assert pack_rows(values, bits).shape == (64 * bits // 32, 48)
    assert torch.equal(unpack_rows(pack_rows(values, bits), bits).long(), values)
    assert pack_cols(values, bits).dtype == torch.int32 and pack_cols(values, bits).shape == (64, 48 * bits // 32)
    assert torch.equal(unpack_cols(pack_cols(values, bits), bits).long(), values)
    if bits == 4:
        assert torch.equal(unpack_cols(pack_cols(values, 4, AWQ_ORDER), 4, AWQ_ORDER).long(), values)


def test_bit_layouts_match_the_checkpoint_formats():
    # GPTQ qweight: 8 consecutive input rows per word, row 0 in the lowest bits
    rows = torch.arange(8).view(8, 1)
    assert pack_rows(rows, 4).item() == 0x76543210
    # AWQ: nibble j holds column AWQ_ORDER[j] = [0, 2, 4, 6, 1, 3, 5, 7]
    cols = torch.arange(8).view(1, 8)
    word = pack_cols(cols, 4, AWQ_ORDER).item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    # a top nibble >= 8 makes the int32 negative; unpacking must not sign-extend into the values
    assert unpack_rows(pack_rows(torch.full((8, 1), 15), 4), 4).flatten().tolist() == [15] * 8


def test_misaligned_shapes_are_refused():
    with pytest.raises(ValueError, match="rows"):
        pack_rows(torch.zeros(7, 8, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="columns"):
        pack_cols(torch.zeros(8, 7, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="group size"):
        quantize_rtn(torch.randn(8, 100), 4, 64, sym=True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_golden_checkpoints(bits, sym, desc_act, checkpoint_format):
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * torch.linspace(0.2, 2.0, 128)  # columns of different magnitude
    quant = quantize_rtn(weight, bits, 32, sym=sym, desc_act=desc_act)
    tensors = pack_gptq(quant, checkpoint_format)
    assert tensors["qweight"].shape == (128 * bits // 32, 96) and tensors["qzeros"].shape == (4, 96 * bits // 32)
    assert tensors["scales"].shape == (4, 96) and tensors["g_idx"].shape == (128,)
    if desc_act:  # act-order permutes g_idx only
        assert not torch.equal(tensors["g_idx"], torch.arange(128, dtype=torch.int32) // 32)
    if sym and checkpoint_format == "gptq":  # v1 stores zero - 1: 7 for symmetric 4-bit
        stored = unpack_cols(tensors["qzeros"], bits)
        assert (stored == (1 << (bits - 1)) - 1).all()

    back = unpack_gptq(tensors, bits, checkpoint_format)
    assert torch.equal(back.q, quant.q) and torch.equal(back.zeros, quant.zeros)
    assert torch.equal(back.g_idx, quant.g_idx)
    assert torch.allclose(back.dequantize(), quant.dequantize(), rtol=1e-3, atol=1e-3)  # fp16 scales
    # round to nearest: every weight within half a step of its reconstruction
    step = quant.scales.float()[quant.g_idx.long()].T
    assert ((quant.dequantize() - weight).abs() <= step * 0.5 + 1e-6).all()


def test_gptq_v1_zero_of_zero_is_read_back_as_zero():
    weight = torch.rand(8, 32) + 0.5  # all positive: asymmetric zeros of 0
    quant = quantize_rtn(weight, 4, 32, sym=False)
    assert (quant.zeros == 0).all()
    back = unpack_gptq(pack_gptq(quant, "gptq"), 4, "gptq")
    assert torch.equal(back.zeros, quant.zeros)


def test_awq_golden_checkpoint():
    torch.manual_seed(1)
    weight = torch.randn(64, 128)
    quant = quantize_rtn(weight, 4, 64, sym=False)
    tensors = pack_awq(quant)
    assert tensors["qweight"].shape == (128, 8) and tensors["qzeros"].shape == (2, 8)
    back = unpack_awq(tensors)
    assert torch.equal(back.q, quant.q) and torch.equal(back.zeros, quant.zeros)
    assert torch.allclose(back.dequantize(), quant.dequantize(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="contiguous"):
        pack_awq(quantize_rtn(weight, 4, 64, sym=False, desc_act=True))
