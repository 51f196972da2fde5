"""The `bnb-int8` plugin: bitsandbytes LLM.int8() weights (per-row absmax int8), quantized at load with
bitsandbytes' own functions from the dense [N, K] weight (q/k/v and gate/up already fused); the dense copy
is dropped. Pre-quantized checkpoints: bnb_checkpoint.py.

Kernels (timings: docs/MEASUREMENTS.md): on CPU in bfloat16, torch's weight-only `_weight_int8pack_mm` up
to INT8PACK_MAX_ROWS rows, dequantize + F.linear above (and for float16 / float32 compute); bitsandbytes'
own LLM.int8() matmul when `threshold` > 0 asks for its outlier decomposition, and on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvforge.plugins.quant.bnb_checkpoint import BnbMethod, checkpoint_bits
from kvforge.plugins.quant.bnb_common import (
    COMPUTE_DTYPE_SETTING,
    COMPUTE_DTYPES,
    bitsandbytes_module,
    empty_output,
    finish,
    nbytes,
    rows_of,
    take_dense_weight,
)

# Storage of the per-row scales of an int8 weight: the fp32 absmax (SCB) plus the compute-dtype copy
# the CPU kernel reads, 48 bits per row; 0.1 bit per weight covers it for rows of >= 480 inputs.
INT8_ROW_OVERHEAD_BITS = 0.1
# Batches up to this many rows use the weight-only int8 kernel; it does no blocking across rows, so
# longer prefill chunks are faster dequantized to bfloat16 through oneDNN's GEMM.
INT8PACK_MAX_ROWS = 32
INT8PACK_K_MULTIPLE = 16  # the kernel reads 16 inputs per step with aligned loads: K must be a multiple


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 codes [N, K], fp32 row absmax SCB [N]) with W[n] ~= codes[n] * SCB[n] / 127.

    Quantized from float16 like bitsandbytes' `Int8Params` (and so transformers' BitsAndBytesConfig):
    a dense model quantized here has the codes and SCB a bitsandbytes model of it has."""
    bnb = bitsandbytes_module()
    weight16 = weight.detach().to(torch.float16).contiguous()
    if not torch.isfinite(weight16).all():
        raise ValueError("bnb-int8: the weight has values that are not finite in float16 (|w| > 65504); "
                         "bitsandbytes quantizes int8 weights from float16")
    codes, scb, _ = bnb.functional.int8_vectorwise_quant(weight16)
    codes[scb == 0] = 0  # an all-zero row: 0 * (127 / 0) is NaN before the cast
    return codes.contiguous(), scb.float()


def _with_whole_row_absmax(shard: torch.Tensor) -> torch.Tensor:
    """A row-parallel shard [N, K / ranks] plus one column holding each row's absmax over all the ranks:
    quantized by bitsandbytes (then the column dropped), it gets the codes and scales the whole weight
    gets -- the int8 scale is per row, and a rank only sees its part of the row."""
    absmax = shard.detach().to(torch.float16).abs().amax(dim=1, keepdim=True).float()
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX)  # every rank processes its layers in the same order
    return torch.cat([shard, absmax.to(shard.dtype)], dim=1)


class BnbInt8Method(BnbMethod):
    name = "bnb-int8"
    description = ("bitsandbytes LLM.int8(): int8 weights with one absmax scale per output row "
                   "(~1/4 of fp32). Quantized at load; loads bitsandbytes checkpoints saved by transformers.")
    settings = {
        "threshold": {
            "type": "number", "default": 0.0, "minimum": 0.0,
            "description": "Outlier threshold of LLM.int8()'s mixed-precision decomposition (transformers' "
                           "llm_int8_threshold, usually 6.0). 0: no decomposition and, on CPU, the fast "
                           "weight-only kernel (activations stay unquantized); > 0: bitsandbytes' own "
                           "int8 matmul in float16.",
        },
        "compute_dtype": COMPUTE_DTYPE_SETTING,
    }
    devices = ("cpu", "cuda")

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float:
        return 8.0 + INT8_ROW_OVERHEAD_BITS

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        """A transformers `load_in_8bit` checkpoint. Its llm_int8_threshold is how transformers computes,
        not how the weights are stored: `threshold` stays the user's choice."""
        return {} if checkpoint_bits(quantization_config) == 8 else None

    def process_after_loading(self, layer) -> None:
        bnb = bitsandbytes_module()
        weight = take_dense_weight(layer)
        if getattr(layer, "input_split", False):
            weight = _with_whole_row_absmax(weight)
        codes, scb = quantize_int8(weight)
        if getattr(layer, "input_split", False):
            codes = codes[:, :-1].contiguous()
        layer.bnb_codes, layer.bnb_scb = codes, scb
        compute = COMPUTE_DTYPES[self.options["compute_dtype"]]
        layer.bnb_scales = None  # what the CPU weight-only kernel multiplies the int8 rows by
        layer.bnb_state = None  # bitsandbytes' LLM.int8() matmul state
        if codes.device.type == "cpu" and self.options["threshold"] == 0:
            layer.bnb_scales = (scb / 127).to(compute)
        else:
            state = bnb.MatmulLtState()
            state.CB, state.SCB = codes, scb
            state.threshold = float(self.options["threshold"])
            state.has_fp16_weights = False
            state.is_training = False
            layer.bnb_state = state

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows_of(x)
        if rows.shape[0] == 0:
            return empty_output(layer, x)
        if layer.bnb_state is not None:  # bitsandbytes' LLM.int8(): activations quantized from float16
            out = bitsandbytes_module().matmul(rows.to(torch.float16), layer.bnb_codes, state=layer.bnb_state)
            return finish(out, x, bias)
        scales = layer.bnb_scales
        if (scales.dtype == torch.bfloat16 and rows.shape[0] <= INT8PACK_MAX_ROWS
                and rows.shape[1] % INT8PACK_K_MULTIPLE == 0 and hasattr(torch, "_weight_int8pack_mm")):
            a = rows.to(torch.bfloat16).contiguous()
            if a.data_ptr() % 64:  # the kernel's aligned loads need an aligned row start
                a = a.clone()
            return finish(torch._weight_int8pack_mm(a, layer.bnb_codes, scales), x, bias)
        weight = layer.bnb_codes.to(scales.dtype).mul_(scales.unsqueeze(1))
        return finish(F.linear(rows.to(scales.dtype), weight), x, bias)

    def weight_bytes(self, layer) -> int:
        return nbytes(layer.bnb_codes, layer.bnb_scb, layer.bnb_scales)

    @classmethod
    def stored_differently(cls, stored: dict[str, Any], options: dict[str, Any]) -> bool:
        return stored["format"] != "int8"
