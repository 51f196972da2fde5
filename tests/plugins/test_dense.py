"""The built-in dense method: its two CPU kernels (oneDNN's prepacked linear, a private torch op, against
F.linear), offered to the kernel choice and switched by it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.core.kernel_choice import choose_kernels
from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.plugins.quant.dense import onednn_packing_available

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _layer(dtype: torch.dtype, bias: bool, kernel: str | None) -> tuple[ReplicatedLinear, torch.Tensor]:
    layer = ReplicatedLinear(96, 80, bias=bias, params_dtype=dtype)
    weight = torch.randn(80, 96, dtype=dtype)
    layer.weight_loader(layer.weight, weight)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(80, dtype=dtype))
    layer.process_after_loading()
    if kernel is not None:
        layer.quant_method.use_kernel(layer, kernel)
    return layer, weight


def require_onednn(dtype: torch.dtype) -> None:
    if not onednn_packing_available(torch.empty(1, dtype=dtype)):
        pytest.skip(f"no oneDNN prepacked linear for {dtype} here (the torch build has none, or the CPU cannot run "
                    "oneDNN's bf16, e.g. AVX2 only); F.linear is the only kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    require_onednn(dtype)
    layer, weight = _layer(dtype, bias, "onednn")
    assert layer.packed_weight is not None and layer.weight is None
    x = torch.randn(rows, 2 * 96, dtype=dtype)[:, ::2]  # a non-contiguous input
    reference = F.linear(x.float(), weight.float(), None if layer.bias is None else layer.bias.float())
    out = layer(x)
    assert out.shape == (rows, 80) and out.dtype == dtype
    error = (out.float() - reference).abs().max() / reference.abs().max()
    assert error < TOLERANCE[dtype], error
    assert layer.quant_method.weight_bytes(layer) == weight.numel() * weight.element_size()


def test_torch_kernel_is_f_linear_exactly():
    layer, weight = _layer(torch.float32, True, "torch")
    assert layer.packed_weight is None
    x = torch.randn(5, 96)
    assert torch.equal(layer(x), F.linear(x, weight, layer.bias))


def test_both_kernels_are_offered_on_cpu_in_fp32_and_bf16_only():
    for dtype in (torch.float32, torch.bfloat16):
        require_onednn(dtype)
        layer, _ = _layer(dtype, False, None)
        assert list(layer.quant_method.kernels(layer)) == ["torch", "onednn"]  # the stock kernel first
    layer, weight = _layer(torch.float16, False, None)
    assert layer.quant_method.kernels(layer) == {}  # fp16: nothing to choose
    x = torch.randn(3, 96, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_forced_choice_switches_every_layer_of_a_model(tmp_path):
    require_onednn(torch.float32)
    model = torch.nn.Sequential(*(_layer(torch.float32, False, None)[0] for _ in range(3)))
    x = torch.randn(4, 96)
    with torch.inference_mode():
        first = model[0](x)
    choices = choose_kernels(model, torch.float32, linear="onednn", cache_dir=tmp_path)
    assert [(c.key, c.layers, c.choice) for c in choices] == [("DenseMethod:float32:80x96", 3, "onednn")]
    assert all(layer.packed_weight is not None for layer in model)
    with torch.inference_mode():
        assert torch.allclose(model[0](x), first, atol=1e-5)
    assert not (tmp_path / "kernel_choice").exists()  # a forced choice times nothing and caches nothing
