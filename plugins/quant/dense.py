"""The built-in `none` method: dense fp32 / bf16 / fp16 weights, registered like any plugin.

On CPU it offers two kernels, chosen per shape by timing them on the machine (core/kernel_choice.py): torch's
`F.linear` and oneDNN's prepacked linear (faster on some CPUs, slower on others; docs/MEASUREMENTS.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.core.plugins import LinearKernel, QuantMethod


def onednn_packing_available(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked linear (fp32-level rounding, see tests/plugins/test_dense.py): private torch ops, so
    offered only where they exist -- and for bf16 only where oneDNN computes it (an AVX2-only CPU, e.g. AMD
    EPYC Zen 2, refuses to pack a bf16 weight)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype != torch.bfloat16 or _onednn_bf16()))


def _onednn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W.T + b with W prepacked by `pack_weight`."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


TORCH_LINEAR = LinearKernel(prepare=lambda weight: weight, run=F.linear)
ONEDNN_LINEAR = LinearKernel(prepare=pack_weight, run=packed_linear)


def create_dense_weight(layer: torch.nn.Module, in_features: int, out_features_per_shard: list[int],
                        params_dtype: torch.dtype) -> None:
    """The layer's [out, in] weight in the model dtype, loaded through the layer's weight loader (methods
    that quantize at load start from it too)."""
    weight = torch.nn.Parameter(torch.empty(sum(out_features_per_shard), in_features, dtype=params_dtype),
                                requires_grad=False)
    weight.weight_loader = layer.weight_loader
    layer.register_parameter("weight", weight)


class DenseMethod(QuantMethod):
    cuda_graph_safe = True  # plain matmuls: no host syncs
    name = "none"
    description = "Dense weights in the model dtype (no quantization)."
    settings: dict = {}

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        create_dense_weight(layer, in_features, out_features_per_shard, params_dtype)
        layer.packed_weight = None  # oneDNN's layout of the weight, when that kernel is chosen
        layer.weight_bytes = 0

    def process_after_loading(self, layer) -> None:
        w = layer.weight
        layer.weight_bytes = w.numel() * w.element_size()

    def kernels(self, layer) -> dict[str, LinearKernel]:
        if layer.weight is None or not onednn_packing_available(layer.weight):
            return {}
        return {"torch": TORCH_LINEAR, "onednn": ONEDNN_LINEAR}

    def use_kernel(self, layer, name: str) -> None:
        if name == "onednn":
            layer.packed_weight = pack_weight(layer.weight)
            del layer.weight  # the packed copy replaces it
            layer.weight = None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        return F.linear(x, layer.weight, bias)

    def weight_bytes(self, layer) -> int:
        return layer.weight_bytes
