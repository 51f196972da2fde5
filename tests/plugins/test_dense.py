"""The built-in dense method: oneDNN prepacked linears (private torch ops) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.plugins.quant.dense import onednn_packing_available

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _layer(dtype: torch.dtype, bias: bool, monkeypatch, onednn: bool) -> tuple[ReplicatedLinear, torch.Tensor]:
    monkeypatch.setenv("KVFORGE_ONEDNN_LINEAR", "1" if onednn else "0")
    layer = ReplicatedLinear(96, 80, bias=bias, params_dtype=dtype)
    weight = torch.randn(80, 96, dtype=dtype)
    layer.weight_loader(layer.weight, weight)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(80, dtype=dtype))
    layer.process_after_loading()
    return layer, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias, monkeypatch):
    if not onednn_packing_available(torch.empty(1, dtype=dtype)):
        pytest.skip("this torch build has no oneDNN prepacked linear; the F.linear path is used")
    layer, weight = _layer(dtype, bias, monkeypatch, onednn=True)
    assert layer.packed_weight is not None and layer.weight is None
    x = torch.randn(rows, 2 * 96, dtype=dtype)[:, ::2]  # a non-contiguous input
    reference = F.linear(x.float(), weight.float(), None if layer.bias is None else layer.bias.float())
    out = layer(x)
    assert out.shape == (rows, 80) and out.dtype == dtype
    error = (out.float() - reference).abs().max() / reference.abs().max()
    assert error < TOLERANCE[dtype], error
    assert layer.quant_method.weight_bytes(layer) == weight.numel() * weight.element_size()


def test_switch_off_uses_f_linear_exactly(monkeypatch):
    layer, weight = _layer(torch.float32, True, monkeypatch, onednn=False)
    assert layer.packed_weight is None
    x = torch.randn(5, 96)
    assert torch.equal(layer(x), F.linear(x, weight, layer.bias))


def test_fp16_is_not_packed(monkeypatch):
    layer, weight = _layer(torch.float16, False, monkeypatch, onednn=True)
    assert layer.packed_weight is None
    x = torch.randn(3, 96, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))
