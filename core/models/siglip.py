"""The SigLIP vision tower both vision-language families use (Idefics3 / SmolVLM, Gemma 3), as transformers'
SiglipVisionTransformer computes it: patch embeddings plus learned position embeddings, pre-norm encoder layers
(bidirectional attention over a tile's patches, GELU-tanh MLP), a final LayerNorm; no pooling head.

Idefics3 feeds tiles of any aspect ratio padded to the tower's size: its patch positions are bucketed as NaViT does
and padded patches masked (`navit_positions`); Gemma 3 feeds one fixed-size square per crop (plain positions).

The tower runs in the model's dtype with torch's own modules (a small share of the weights, run once per image):
quant methods apply to the decoder's projections only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype, navit_positions: bool) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.navit_positions = navit_positions
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.per_side ** 2, config.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        """pixels [tiles, C, H, W]; patch_mask [tiles, H / patch, W / patch] (False: padding; None: none)."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if not self.navit_positions:
            return patches + self.position_embedding.weight[:patches.shape[1]]
        # each real patch's position is its fractional place in its tile's real area, bucketed to the trained grid
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=pixels.device)
        step_h, step_w = 1.0 / patch_mask[:, :, 0].sum(1), 1.0 / patch_mask[:, 0, :].sum(1)  # as transformers: x * step
        h, w = (torch.arange(n, device=pixels.device, dtype=torch.float32)[None] for n in patch_mask.shape[1:])
        fraction_h, fraction_w = h * step_h[:, None], w * step_w[:, None]
        bucket_h = torch.bucketize(fraction_h.clamp(max=1 - 1e-6), boundaries, right=True)
        bucket_w = torch.bucketize(fraction_w.clamp(max=1 - 1e-6), boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.per_side + bucket_w[:, None, :]).flatten(1)
        ids = torch.where(patch_mask.flatten(1), ids, torch.zeros_like(ids))
        return patches + self.position_embedding(ids)


class VisionAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(width, width, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        tiles, patches, width = x.shape
        q, k, v = (proj(x).view(tiles, patches, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # every patch sees every real patch
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, width))


class VisionMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision tower activation {config.hidden_act!r} is not supported (gelu_pytorch_tanh is)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config, dtype) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, navit_positions: bool = False) -> None:
        super().__init__()
        if getattr(config, "vision_use_head", False):
            raise ValueError("a SigLIP tower with its pooling head is not supported (vision-language models use none)")
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config, dtype, navit_positions)
        self.encoder = VisionEncoder(config, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [tiles, C, H, W], pixel_mask [tiles, H, W] (None: no padding) -> [tiles, patches, width]."""
        mask = patch_mask = None
        if pixel_mask is not None:
            size = self.patch_size
            patch_mask = pixel_mask.unfold(1, size, size).unfold(2, size, size).sum((-1, -2)) > 0
            keep = patch_mask.flatten(1)
            mask = None if bool(keep.all()) else keep[:, None, None, :]  # padded patches are never attended to
        x = self.embeddings(pixels, patch_mask)
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


def tower_parameter_count(v) -> int:
    """A SigLIP tower's parameters from its vision_config (without a pooling head)."""
    width, inner = v.hidden_size, v.intermediate_size
    embeddings = v.num_channels * v.patch_size ** 2 * width + width + (v.image_size // v.patch_size) ** 2 * width
    layer = 4 * (width * width + width) + 2 * width * inner + inner + width + 4 * width  # attention, MLP, 2 norms
    return embeddings + v.num_hidden_layers * layer + 2 * width
