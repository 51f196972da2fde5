"""The `bnb-nf4` plugin: bitsandbytes 4-bit weights (NF4 or FP4 codes in blocks with one absmax each),
quantized at load with bitsandbytes' own functions from the dense [N, K] weight (q/k/v and gate/up already
fused); the dense copy is dropped. Pre-quantized checkpoints: bnb_checkpoint.py.

Kernels (timings: docs/MEASUREMENTS.md): on AVX512-BF16 CPUs in bfloat16, bitsandbytes' packed CPU layout
(what its `Linear4bit` converts to on the first forward there) through its fused kernel; without that CPU
feature, for other compute dtypes, or when N % 32 or K % blocksize, the weight is dequantized to the
compute dtype for each call (F.linear); on CUDA `bitsandbytes.matmul_4bit`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvforge.plugins.quant.bnb_checkpoint import BnbMethod, checkpoint_bits
from kvforge.plugins.quant.bnb_common import (
    COMPUTE_DTYPE_SETTING,
    COMPUTE_DTYPES,
    bitsandbytes_module,
    dequantize_4bit,
    empty_output,
    finish,
    nbytes,
    rows_of,
    take_dense_weight,
)

NESTED_BLOCKSIZE = 256  # bitsandbytes' double quantization: absmax in 8-bit blocks of 256


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  double_quant: bool = False):
    """[N, K] -> (packed uint8 [(N*K+1)//2, 1], bitsandbytes QuantState): blocks of `blocksize`
    consecutive values of the row-major weight, each with its absmax (itself 8-bit quantized in blocks
    of 256 with double quantization)."""
    functional = bitsandbytes_module().functional
    return functional.quantize_4bit(weight.detach().contiguous(), blocksize=blocksize,
                                    compress_statistics=double_quant, quant_type=quant_type)


def _cpu_packing_supported(weight: torch.Tensor, blocksize: int) -> bool:
    """bitsandbytes' packed CPU layout: a fused bf16 kernel on AVX512-BF16 CPUs, 32 output rows per tile,
    absmax per (row, block) so blocks must not straddle rows."""
    functional = bitsandbytes_module().functional
    n, k = weight.shape
    return (weight.device.type == "cpu" and hasattr(functional, "_convert_weight_packed_for_cpu")
            and functional.has_avx512bf16() and n % 32 == 0 and k % blocksize == 0 and k % 2 == 0)


class BnbNf4Method(BnbMethod):
    name = "bnb-nf4"
    description = ("bitsandbytes 4-bit: NF4 (or FP4) codes in blocks of 64 with one absmax per block "
                   "(~1/7 of fp32). Quantized at load; loads bitsandbytes checkpoints saved by transformers.")
    settings = {
        "quant_type": {
            "type": "string", "enum": ["nf4", "fp4"], "default": "nf4",
            "description": "4-bit data type: nf4 (normal float, for normally distributed weights) or fp4.",
        },
        "double_quant": {
            "type": "boolean", "default": False,
            "description": "Quantize the absmax values too (8-bit blocks of 256): ~0.37 bit per weight less "
                           "on CUDA. bitsandbytes' packed CPU kernel keeps the absmax in bfloat16 either way.",
        },
        "blocksize": {
            "type": "integer", "enum": [64, 128, 256], "default": 64,
            "description": "Weights per absmax block. A block never spans two rows only when it divides the "
                           "input size (the embedded model's 576 needs 64).",
        },
        "compute_dtype": COMPUTE_DTYPE_SETTING,
    }
    devices = ("cpu", "cuda")

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float:
        blocksize = options.get("blocksize", 64)
        if options.get("double_quant", False):  # 8-bit absmax per block + an fp32 absmax per 256 blocks
            return 4.0 + 8.0 / blocksize + 32.0 / (blocksize * NESTED_BLOCKSIZE)
        return 4.0 + 32.0 / blocksize

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        """A transformers `load_in_4bit` checkpoint: quantizing its dequantized weights again with its own
        data type, double quantization and blocks (bitsandbytes' 64; the tensors record theirs) gives back
        its codes. The compute dtype stays the user's choice."""
        if checkpoint_bits(quantization_config) != 4:
            return None
        quant_type = quantization_config.get("bnb_4bit_quant_type", "fp4")  # transformers' default
        if quant_type not in ("nf4", "fp4"):
            raise ValueError(f"bitsandbytes 4-bit data type {quant_type!r} is not supported (nf4, fp4)")
        return {"quant_type": quant_type, "blocksize": 64,
                "double_quant": bool(quantization_config.get("bnb_4bit_use_double_quant", False))}

    def process_after_loading(self, layer) -> None:
        weight = take_dense_weight(layer)
        opts = self.options
        packed, state = quantize_4bit(weight, opts["quant_type"], opts["blocksize"], opts["double_quant"])
        compute = COMPUTE_DTYPES[opts["compute_dtype"]]
        layer.bnb_cpu_packed = compute == torch.bfloat16 and _cpu_packing_supported(weight, opts["blocksize"])
        if layer.bnb_cpu_packed:  # what Linear4bit does on the first forward on such a CPU
            packed, state = bitsandbytes_module().functional._convert_weight_packed_for_cpu(packed, state)
        layer.bnb_packed, layer.bnb_quant_state = packed, state
        layer.bnb_compute_dtype = compute

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        compute = layer.bnb_compute_dtype
        rows = rows_of(x).to(compute).contiguous()  # the packed CPU kernel assumes unit stride along K
        if rows.shape[0] == 0:  # ... and crashes on an empty batch
            return empty_output(layer, x)
        if layer.bnb_cpu_packed or rows.device.type != "cpu":
            out = bitsandbytes_module().matmul_4bit(rows, layer.bnb_packed, layer.bnb_quant_state)
        else:  # what matmul_4bit does on CPU, without its 2-D dequantization (see dequantize_4bit)
            out = F.linear(rows, dequantize_4bit(layer.bnb_packed, layer.bnb_quant_state, compute))
        return finish(out, x, bias)

    def weight_bytes(self, layer) -> int:
        state = layer.bnb_quant_state
        total = nbytes(layer.bnb_packed, state.absmax, state.code)
        if state.nested:
            total += nbytes(state.state2.absmax, state.state2.code)
        return total

    @classmethod
    def stored_differently(cls, stored: dict[str, Any], options: dict[str, Any]) -> bool:
        return (stored["format"] != options.get("quant_type") or stored.get("blocksize") != options.get("blocksize")
                or stored.get("double_quant") != options.get("double_quant"))
