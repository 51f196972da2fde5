"""The built-in `none` method: dense fp32 / bf16 / fp16 weights, registered like any plugin.

On CPU it offers two kernels, chosen per shape by timing them on the machine (core/kernel_choice.py): torch's
`F.linear` and oneDNN's prepacked linear (faster on some CPUs, slower on others; docs/MEASUREMENTS.md).

A bf16 / fp16 checkpoint in an fp32 model on CPU (the default dtype where the CPU has no native bf16) keeps its
weights in the checkpoint's dtype (`weights: auto`): half the memory of fp32 copies, and decode, which reads every
weight once a token, reads half the bytes. The C kernel of GGUF's float weights computes with them
(core/cpu_kernels/gguf_blocks.c: each weight converted to fp32 as it is read, exactly, fp32 math on x as given; its
own summation order, not torch's). Zen 2, 2 threads, 8192 x 2048: a BF16 GEMV streams 27.8 GB/s of bf16 where
torch's fp32 one reads twice the bytes; 140 rows x 2048 x 6144: 66 GMAC/s, oneDNN's fp32 69, F.linear's 42.
`weights: model` converts them to the model dtype at load (torch's matmul: the reference's sums bit for bit, what
the parity tests pin)."""

from __future__ import annotations

import functools

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


NARROW_FLOATS = (torch.bfloat16, torch.float16)  # checkpoint dtypes an fp32 model on CPU keeps (`weights: auto`)


def keep_narrow_dtype(param: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """The loader's hook before each checkpoint tensor (or fused shard) of `param` is copied in: the first one's
    bf16 / fp16 dtype becomes the parameter's (its fp32 storage, never written, is dropped); shards of different
    dtypes after it put the parameter back in fp32 (exact: a narrow float widens without rounding)."""
    if getattr(param, "dtype_chosen", False):
        if param.dtype != dtype and param.dtype in NARROW_FLOATS:
            param.data = param.data.float()
        return
    param.dtype_chosen = True
    if dtype in NARROW_FLOATS and param.dtype == torch.float32:
        param.data = torch.empty(param.shape, dtype=dtype)


def keeps_checkpoint_dtype(options: dict, params_dtype: torch.dtype) -> bool:
    """Whether a layer built now keeps a bf16 / fp16 checkpoint's weights as they are (`weights: auto`, an fp32
    model on CPU, the C kernels built here)."""
    from kvforge.core.cpu_kernels import unavailable

    return (options.get("weights", "auto") == "auto" and params_dtype == torch.float32
            and torch.get_default_device().type == "cpu" and unavailable() is None)


class DenseMethod(QuantMethod):
    cuda_graph_safe = True  # plain matmuls: no host syncs
    narrow_floats = NARROW_FLOATS  # read by the core's memory estimate (core/estimate.py)
    name = "none"
    description = "Dense weights in the model dtype (no quantization)."
    settings: dict = {
        "weights": {"type": "string", "enum": ["auto", "model"], "default": "auto",
                    "description": "auto: on CPU an fp32 model keeps a bf16 / fp16 checkpoint's weights in that dtype "
                                   "(half the memory; a C kernel converts them as it reads them, fp32 math); model: "
                                   "converted to the model dtype at load (torch's matmul)"},
    }

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        create_dense_weight(layer, in_features, out_features_per_shard, params_dtype)
        layer.packed_weight = None  # oneDNN's layout of the weight, when that kernel is chosen
        layer.float_segments = None  # the C kernel's view of a weight kept narrower than the model dtype
        layer.compute_dtype = params_dtype
        layer.weight_bytes = 0
        if keeps_checkpoint_dtype(self.options, params_dtype):
            layer.weight.choose_dtype = functools.partial(keep_narrow_dtype, layer.weight)

    def process_after_loading(self, layer) -> None:
        w = layer.weight
        layer.weight_bytes = w.numel() * w.element_size()
        if w.dtype != layer.compute_dtype:  # kept as the checkpoint stores it: read by the GGUF float kernel
            self.use_float_kernel(layer)

    @staticmethod
    def use_float_kernel(layer) -> bool:
        """Serve the loaded layer with the C kernel of GGUF's float weights (its weight read in place, fp32 math,
        the output rounded once to x's dtype) where it runs: a CPU weight, the kernels built; whether it does. A
        weight kept narrower than the model dtype always takes it; a MoE router too (core/layers/moe.py)."""
        from kvforge.core.cpu_kernels import GGUF_FLOATS, GgufSegments, unavailable

        w = layer.weight
        code = next((code for code, dtype in GGUF_FLOATS.items() if dtype == w.dtype), None)
        if code is None or w.device.type != "cpu" or unavailable() is not None:
            return False
        layer.float_segments = GgufSegments([(code, w.data.contiguous().view(torch.uint8))], w.shape[1])
        return True

    def kernels(self, layer) -> dict[str, LinearKernel]:
        if layer.weight is None or getattr(layer, "float_segments", None) is not None or \
                not onednn_packing_available(layer.weight):
            return {}
        return {"torch": TORCH_LINEAR, "onednn": ONEDNN_LINEAR}

    def use_kernel(self, layer, name: str) -> None:
        if name == "onednn":
            layer.packed_weight = pack_weight(layer.weight)
            del layer.weight  # the packed copy replaces it
            layer.weight = None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer, "float_segments", None) is not None:
            from kvforge.core.cpu_kernels import gguf_linear

            out = gguf_linear(x, layer.float_segments, batch_invariant=False)  # as torch's matmul: prefill faster
            return out if bias is None else out + bias
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        return F.linear(x, layer.weight, bias)

    def weight_bytes(self, layer) -> int:
        return layer.weight_bytes
