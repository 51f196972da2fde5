"""What the GPTQ and AWQ plugins share: weights quantized per group of input features, loaded in the
checkpoint's own layout, then converted once into the layout of the kernel that runs them.

Kernels (option `kernel`):
- `int4pack` (CPU, 4-bit): torch's weight-only int4 matmul (see cpu_kernels.py), bf16 compute;
  act-order checkpoints get their input features reordered once at load and the activations gathered.
- `blocks` (CPU, 4-bit, every 32 consecutive input features in one group, fp16 scales): the weight rewritten once
  into GGUF blocks, W = scale * (code - centre) exactly (Q4_0 where every zero is 8, the symmetric checkpoints;
  else Q5_0, codes q - zero + 16), served by the GGUF plugin's C kernels in any model dtype (gguf.py's
  `blocks_linear`, `auto` activations: int16 decode steps, bf16 / fp32 prefill tiles).
- `triton` (CUDA): our dequantize-GEMM over the GPTQ v2 layout (triton_gemm.py).
- `dequant`: pure torch, any bit width / group size / device; the weight is dequantized to the
  activations' dtype for each matmul (slow, but exact and memory-lean at rest: the reference path).
`auto` picks int4pack on CPU when the layout allows, triton on CUDA when it is installed, else dequant. (`blocks`
against int4pack on Zen 5, bf16, a 4-bit 8192 x 2048 layer in groups of 128: 1 row 0.24 -> 0.20 ms, 16 rows 1.56 ->
1.73, 140 rows 13.7 -> 6.8; not yet `auto`'s choice: the weight estimates count int4pack's bytes.)
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from kvforge.core.plugins import QuantMethod
from kvforge.plugins.quant.cpu_kernels import int4_linear, int4pack_available, pack_int4
from kvforge.plugins.quant.packing import Quantized, pack_cols, pack_rows, unpack_cols, unpack_rows

log = logging.getLogger(__name__)

KERNEL_SETTING = {"type": "string", "enum": ["auto", "int4pack", "blocks", "triton", "dequant"], "default": "auto",
                  "description": "matmul kernel: int4pack (CPU, 4-bit), blocks (CPU, 4-bit: the GGUF C kernels), "
                                 "triton (CUDA), dequant (pure torch)"}
GROUP_SIZE_SETTING = {"type": "integer", "default": 128, "minimum": -1,
                      "description": "input features per scale / zero group (-1: one group per output row)"}


class GroupQuantMethod(QuantMethod):
    """Subclasses create the checkpoint's parameters and read them back as a `Quantized`."""

    cuda_graph_safe = True  # every kernel (Triton dequant-GEMM, int4pack, dequantize) runs without host syncs

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.bits: int = self.options["bits"]
        self.group_size: int = self.options["group_size"]
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"option 'group_size' must be -1 or positive, got {self.group_size}")
        self.pack_factor = 32 // self.bits

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float:
        options = cls.validate_options(options)
        group = options["group_size"]
        # a bf16 scale and zero per group and output feature, as the kernels store them
        return options["bits"] + (32 / group if group > 0 else 0.0)

    def groups(self, in_features: int) -> int:
        group = in_features if self.group_size == -1 else self.group_size
        if in_features % group:
            raise ValueError(f"{self.name}: group size {group} does not divide the layer's {in_features} input "
                             "features (with tensor parallelism: this split cannot be aligned with the groups)")
        return in_features // group

    def add_param(self, layer: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  **axes: int | None) -> None:
        """A checkpoint tensor's parameter, tagged with the axes the layer's weight loader slices."""
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        for axis, value in axes.items():
            setattr(param, axis, value)
        param.weight_loader = layer.weight_loader
        layer.register_parameter(name, param)

    @abstractmethod
    def read_checkpoint_layout(self, layer: torch.nn.Module) -> Quantized:
        """The loaded parameters as integers, zeros, scales and g_idx (and drop the parameters)."""

    def process_after_loading(self, layer: torch.nn.Module) -> None:
        quant = self.read_checkpoint_layout(layer)
        device = quant.scales.device
        kernel = self._choose_kernel(device)
        layer.int4 = layer.segments = None
        if kernel == "blocks":
            why = self._blocks(layer, quant)
            if why is not None:
                raise ValueError(f"{self.name}: {layer.prefix or 'a layer'} cannot use the blocks kernel: {why}")
            layer.kernel = kernel
            return
        if kernel == "int4pack":
            layer.int4 = pack_int4(quant.q, quant.zeros, quant.scales, quant.g_idx)
            if layer.int4 is not None:
                layer.kernel = kernel
                return
            if self.options["kernel"] == "int4pack":
                raise ValueError(f"{self.name}: this layer's layout ({self.bits}-bit, group size {self.group_size}) "
                                 "cannot use the int4pack kernel")
            kernel = "dequant"
        layer.kernel = kernel
        # the GPTQ v2 layout (real zeros) is what the dequant and triton kernels read
        layer.register_buffer("q_packed", pack_rows(quant.q, self.bits).to(device))
        layer.register_buffer("zeros_packed", pack_cols(quant.zeros, self.bits).to(device))
        layer.register_buffer("group_scales", quant.scales.to(device))
        layer.register_buffer("g_idx", quant.g_idx.to(torch.int32).to(device))

    def _blocks(self, layer: torch.nn.Module, quant: Quantized) -> str | None:
        """Serve the layer from GGUF blocks written once from `quant` (layer.segments); why not, or None."""
        from kvforge.core.cpu_kernels import GgufSegments, unavailable
        from kvforge.plugins.quant.block_paths import int16_rows
        from kvforge.plugins.quant.gguf_blocks import encode_centred

        k, n = quant.q.shape
        why = unavailable()
        if why is not None:
            return why
        if quant.scales.device.type != "cpu" or self.bits != 4 or k % 32:
            return f"it takes 4-bit weights on CPU in groups of 32 input features ({self.bits}-bit, {k} inputs here)"
        groups = quant.g_idx.long().view(k // 32, 32)
        if not bool((groups == groups[:, :1]).all()):
            return "its groups do not hold 32 consecutive input features each (act-order, or groups under 32)"
        first = groups[:, 0]
        scales, zeros = quant.scales[first].float().T, quant.zeros[first].T  # [N, K / 32]
        if not torch.equal(scales.half().float(), scales):
            return "its scales are not fp16 values"
        symmetric = bool((zeros == 8).all())
        codes = quant.q.T if symmetric else quant.q.T - zeros.repeat_interleave(32, dim=1) + 16
        qtype, blocks = encode_centred(codes, scales)
        layer.segments = GgufSegments([(int(qtype), blocks)], k)
        layer.int16_rows = int16_rows(torch.get_num_threads(), layer.params_dtype)
        return None

    def _choose_kernel(self, device: torch.device) -> str:
        wanted = self.options["kernel"]
        if wanted == "int4pack" and (device.type != "cpu" or self.bits != 4 or not int4pack_available()):
            raise ValueError(f"{self.name}: the int4pack kernel needs 4-bit weights on CPU "
                             f"(this is {self.bits}-bit on {device.type})")
        if wanted == "triton":
            from kvforge.plugins.quant.triton_gemm import triton_available

            if not triton_available():
                raise ValueError(f"{self.name}: the triton kernel needs triton and a CUDA device")
        if wanted != "auto":
            return wanted
        if device.type == "cpu" and self.bits == 4 and int4pack_available():
            return "int4pack"
        if device.type == "cuda":
            from kvforge.plugins.quant.triton_gemm import triton_available

            if triton_available():
                return "triton"
        return "dequant"

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.kernel == "int4pack":
            return int4_linear(x, layer.int4, bias)
        if layer.kernel == "blocks":
            from kvforge.plugins.quant.block_paths import blocks_linear

            return blocks_linear(x, layer.segments, layer.int16_rows, "auto", bias)
        if layer.kernel == "triton":
            from kvforge.plugins.quant.triton_gemm import dequant_gemm

            shape = x.shape
            out = dequant_gemm(x.reshape(-1, shape[-1]), layer.q_packed, layer.group_scales,
                               layer.zeros_packed, layer.g_idx, self.bits)
            out = out.view(*shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        return F.linear(x, self.dequantize(layer, x.dtype), bias)

    def dequantize(self, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` from the stored GPTQ v2 tensors (dequant kernel and reference), or the blocks."""
        if layer.kernel == "blocks":
            from kvforge.core.cpu_kernels import gguf_dequant

            (qtype, blocks), = layer.segments.parts
            return gguf_dequant(qtype, blocks, layer.segments.in_features, dtype=dtype)
        g = layer.g_idx.long()
        q = unpack_rows(layer.q_packed, self.bits)
        zeros = unpack_cols(layer.zeros_packed, self.bits)
        return (layer.group_scales[g].to(dtype) * (q - zeros[g]).to(dtype)).T

    def weight_bytes(self, layer: torch.nn.Module) -> int:
        if layer.int4 is not None:
            return layer.int4.nbytes()
        if layer.segments is not None:
            return sum(blocks.numel() for _, blocks in layer.segments.parts)
        return super().weight_bytes(layer)
