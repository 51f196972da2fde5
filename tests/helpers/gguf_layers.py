"""GGUF test weights: random blocks of each type, and a gguf-method linear layer loaded with them as the loader reads
them from a file (tests/plugins/test_gguf.py, test_gguf_triton.py)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.plugins.quant.gguf import GgufMethod

T = GGMLQuantizationType
# byte offsets of each type's fp16 scale(s): random bytes elsewhere are valid codes, there they could be NaN
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` with random codes and sub-scales and small random fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.normal(0, 0.01, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return raw


def blocks_tensor(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """Blocks [rows, row bytes] as core/gguf_source.py yields a GGUF's quantized tensor (file row order)."""
    blocks = torch.from_numpy(raw)
    blocks.gguf_type, blocks.gguf_in_features, blocks.gguf_rows = int(qtype), cols, None
    return blocks


def gguf_layer(qtype: GGMLQuantizationType, dtype: torch.dtype, kernel: str, rows: int = 64, cols: int = 512):
    """A linear layer of the gguf method loaded with `qtype` blocks as the loader gives them; and W."""
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):  # gguf-py quantizes these from real values
        raw = quantize(np.random.default_rng(1).normal(0, 0.05, size=(rows, cols)).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, rows, cols, seed=1)
    layer = ReplicatedLinear(cols, rows, quant_method=GgufMethod(kernel=kernel), params_dtype=dtype)
    layer.qblocks.weight_loader(layer.qblocks, blocks_tensor(raw, qtype, cols))
    layer.process_after_loading()
    return layer, torch.from_numpy(dequantize(raw, qtype))
