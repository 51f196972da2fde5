"""Layers against HF transformers' own modules, bit for bit where the operation order is the same."""

from __future__ import annotations

import pytest
import torch

from kvforge.core.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9])
def test_rms_norm_is_hf_llama_rms_norm_bit_for_bit(dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = RMSNorm(576, 1e-5, dtype), LlamaRMSNorm(576, eps=1e-5).to(dtype)
    weight = torch.randn(576).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, residual = (torch.randn(rows, 576) * 4).to(dtype), torch.randn(rows, 576).to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x))
        normed, total = ours(x, residual)
        assert torch.equal(total, x + residual) and torch.equal(normed, theirs(x + residual))
