"""The built-in `none` method: dense fp32 / bf16 / fp16 weights, registered like any plugin."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvforge.core.plugins import QuantMethod


def onednn_packing_available(weight: torch.Tensor) -> bool:
    """oneDNN prepacked linears: on these CPUs ~2.3x faster than F.linear in fp32 (batch 1 to 1024)
    and ~1.2x in bf16, with fp32-level rounding (see tests/plugins/test_dense.py). They are private
    torch ops, so they are used only where they exist and can be switched off
    (KVFORGE_ONEDNN_LINEAR=0)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and os.environ.get("KVFORGE_ONEDNN_LINEAR", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W.T + b with W prepacked by `pack_weight`."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


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
        layer.packed_weight = None
        layer.weight_bytes = 0

    def process_after_loading(self, layer) -> None:
        w = layer.weight
        layer.weight_bytes = w.numel() * w.element_size()
        if onednn_packing_available(w):
            layer.packed_weight = pack_weight(w)
            del layer.weight  # the packed copy replaces it
            layer.weight = None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        return F.linear(x, layer.weight, bias)

    def weight_bytes(self, layer) -> int:
        return layer.weight_bytes
