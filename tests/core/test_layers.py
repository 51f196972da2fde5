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


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 2.0},
], ids=["default", "llama3", "linear"])
def test_rotary_frequencies_are_built_on_the_model_device(rope_scaling):
    """The runner builds the model under `with torch.device(config.device)`: the inverse frequencies must land
    there for every rope type (transformers' init functions compute on the CPU; on an H200 a Llama-3 model's
    first forward met CUDA positions with CPU frequencies). The meta device stands in for CUDA here."""
    from transformers import LlamaConfig

    from kvforge.core.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_theta=500000.0,
                         rope_scaling=rope_scaling)
    on_cpu = RotaryEmbedding(config, 16)
    with torch.device("meta"):
        built = RotaryEmbedding(config, 16)
        cos, sin = built(torch.arange(5), torch.float32)
    assert built.inv_freq.device.type == "meta" and cos.device.type == "meta" and sin.device.type == "meta"
    assert on_cpu.inv_freq.device.type == "cpu" and built.inv_freq.shape == on_cpu.inv_freq.shape
