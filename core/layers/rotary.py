"""Rotary position embedding with a precomputed cos/sin table indexed by position.

The inverse frequencies of scaled variants (Llama 3, linear, YaRN, long-rope, ...) come from transformers'
own ROPE_INIT_FUNCTIONS, so every rope_scaling type a config names is computed exactly as the
reference computes it. Long-rope (Phi-3 / Phi-4-mini) has two sets of factors: transformers switches to the long
ones for a forward pass whose sequence passes original_max_position_embeddings, which would leave the KV of the
earlier tokens computed with the other set (and make a cached prefix depend on what followed it). We choose once,
by the engine's context length, as llama.cpp does by its context size: a context longer than the original one gets
the long factors for every token, otherwise the short ones (`--max-model-len 4096` keeps Phi-3-128k / Phi-4-mini
on the short factors they were pretrained with). A partial rotary factor turns only the first dimensions of a head.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core.cpu_kernels import fused_elementwise_for, rotary_inplace


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rotary_dim_of(config, head_dim: int) -> int:
    """How many dimensions of a head turn (all but with a partial rotary factor)."""
    factor = _rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def _inverse_frequencies(config, head_dim: int, context_len: int | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (fp32, on the CPU whatever device the model is being built on) and the scaling."""
    with torch.device("cpu"):  # transformers' init functions mix their own CPU tensors with default-device ones
        return _inverse_frequencies_cpu(config, head_dim, context_len)


def _inverse_frequencies_cpu(config, head_dim: int, context_len: int | None) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = rotary_dim_of(config, head_dim)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    # seq_len matters to long-rope only: the long factors past original_max_position_embeddings (see above)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=context_len)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin for the step's positions, computed once per step and shared by every layer
    (no table sized by max_position_embeddings, which reaches 128k for some models)."""

    def __init__(self, config, head_dim: int, context_len: int | None = None) -> None:
        super().__init__()
        inv_freq, self.scaling = _inverse_frequencies(config, head_dim, context_len)
        # computed on the CPU: the buffer goes where the model is being built (the runner's `with
        # torch.device(...)`), else a scaled rope's CPU frequencies met CUDA positions in the first forward
        inv_freq = inv_freq.to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary; in place, one pass of the C kernel where it takes x (bf16 / fp32 on CPU, heads contiguous), with
    the same roundings: its results are torch's bit for bit (core/cpu_kernels/elementwise.c). cos / sin narrower
    than a head (a partial rotary factor): the first dimensions turn, in place, the rest pass."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        x[..., :turned] = apply_rotary(x[..., :turned], cos, sin)
        return x
    if x.stride(-1) == 1 and x.stride(1) == x.shape[-1] and fused_elementwise_for(x, fp32=True):
        return rotary_inplace(x, cos, sin)
    return apply_rotary(x, cos, sin)
