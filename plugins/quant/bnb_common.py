"""What the bitsandbytes methods (bnb_int8.py, bnb_nf4.py) and their checkpoint loader (bnb_checkpoint.py)
share: bitsandbytes imported on first use (plugin discovery stays cheap; the import takes seconds), the
compute-dtype option, the dequantization of both formats, and the helpers of a quantized matmul."""

from __future__ import annotations

import copy
import logging

import torch

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COMPUTE_DTYPE_SETTING = {
    "type": "string", "enum": list(COMPUTE_DTYPES), "default": "bfloat16",
    "description": "Dtype the matmul runs in (the output is cast back to the model dtype). bfloat16 is the "
                   "fast path on CPU; float16 and float32 dequantize the weight on every call there.",
}

_bitsandbytes = None


def bitsandbytes_module():
    """bitsandbytes, imported on first use. Its CPU backend logs a warning at import when the optional
    `kernels` package is missing; the built-in kernel it falls back to is the one used here."""
    global _bitsandbytes
    if _bitsandbytes is None:
        cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = cpu_ops.level
        cpu_ops.setLevel(logging.ERROR)
        try:
            import bitsandbytes
            import bitsandbytes.functional
            import bitsandbytes.utils  # noqa: F401 - unpack_tensor_to_dict, for checkpoints
        finally:
            cpu_ops.setLevel(level)
        _bitsandbytes = bitsandbytes
    return _bitsandbytes


def dequantize_int8(codes: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    return bitsandbytes_module().functional.int8_vectorwise_dequant(codes, scb.float())


def dequantize_4bit(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight in `dtype` (default: the dtype it was quantized from).

    Dequantized as one flat row: bitsandbytes 0.50.2's CPU kernel gets a 2-D weight wrong when a block
    spans two rows (K % blocksize != 0, e.g. K = 576 with blocks of 128); the flat layout is what the
    blocks index anyway."""
    flat = copy.copy(state)
    flat.shape = torch.Size([state.shape.numel()])
    flat.dtype = dtype or state.dtype
    return bitsandbytes_module().functional.dequantize_4bit(packed, flat).reshape(state.shape)


def take_dense_weight(layer) -> torch.Tensor:
    weight = layer.weight.data
    del layer.weight  # the quantized copy replaces it
    layer.weight = None
    return weight


def rows_of(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, N] in the compute dtype -> x's leading shape and dtype, plus the bias (added in x's dtype)."""
    out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out.add_(bias.to(x.dtype))


def empty_output(layer, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], layer.out_features)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
