"""The gguf plugin's triton path (CUDA's; interpreted on CPU here): every GGUF type from its codes packed in 4 or 8
bits with an integer zero and fp32 scales / offsets through the Triton dequantize-GEMM equals x @ W.T with W the
`gguf` package's own dequantization."""

from __future__ import annotations

import pytest
import torch

from kvforge.plugins.quant.gguf_blocks import DECODERS, FOUR_BIT
from tests.helpers.gguf_layers import T, gguf_layer

pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WITH_OFFSETS = (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K)  # the types with a minimum per group


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_type_through_the_dequantize_gemm(qtype, dtype):
    with torch.device(DEVICE):  # built where it runs, as the runner builds a model (the kernel's tensors with it)
        layer, weight = gguf_layer(qtype, dtype, "triton", rows=48, cols=256)
    args = layer.triton
    assert layer.weight is None and layer.int4 is None and layer.int8 is None
    assert args["bits"] == (4 if qtype in FOUR_BIT else 8)
    assert (args["offsets"] is not None) == (qtype in WITH_OFFSETS)
    assert args["qweight"].device.type == DEVICE
    x = torch.randn(5, 256)
    expected = x.double() @ weight.double().T
    got = layer(x.to(dtype).to(DEVICE)).double().cpu()
    if dtype == torch.float32:  # fp32 products: only the order of the sums differs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    else:  # W rounded to bf16 for the dot, the output rounded once
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_auto_keeps_the_cpu_paths_on_cpu():
    """Under the interpreter on a CPU tensor, auto still takes the CPU kernels (triton only when named)."""
    layer, _ = gguf_layer(T.Q4_K, torch.float32, "auto")
    assert layer.triton is None and layer.segments is not None
