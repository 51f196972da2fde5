"""Idefics3 / SmolVLM: a SigLIP vision tower (any aspect ratio: its patch positions bucketed as NaViT does), the
connector (a pixel shuffle that folds scale_factor^2 neighbouring patches into one row, then a projection into the
decoder's width) and the Llama decoder of core/models/llama.py. An image's rows replace the embeddings of its
`<image>` tokens (core/images.py); the decoder attends causally over them like any token, so a prefill chunk may end
inside an image.

The processor (HF transformers' Idefics3Processor) splits a picture into tiles of the tower's size plus one global
view and writes `<fake_token_around_image><row_i_col_j>` and image_seq_len `<image>` tokens per tile; every tile
becomes exactly image_seq_len rows here, so an image's rows are its tiles' rows in order.

The tower runs in the model's dtype with torch's own modules (a small share of the weights, run once per image): quant
methods apply to the decoder's projections only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.images import EncodedImages, ImageInput, ImagePrompt
from kvforge.core.models.llama import LlamaForCausalLM
from kvforge.core.quant_config import QuantConfig


class VisionEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.per_side ** 2, config.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, C, H, W]; patch_mask [tiles, H / patch, W / patch] (False: padding)."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
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
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config, dtype)
        self.encoder = VisionEncoder(config, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, C, H, W], pixel_mask [tiles, H, W] -> [tiles, patches, width]."""
        size = self.patch_size
        patch_mask = pixel_mask.unfold(1, size, size).unfold(2, size, size).sum((-1, -2)) > 0
        x = self.embeddings(pixels, patch_mask)
        keep = patch_mask.flatten(1)
        mask = None if bool(keep.all()) else keep[:, None, None, :]  # padded patches are never attended to
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False, dtype=dtype)


class Connector(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = ModalityProjection(config.vision_config.hidden_size * config.scale_factor ** 2,
                                                      config.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, width] -> [tiles, patches / scale^2, decoder width]: each scale x scale square of
        neighbouring patches folded into one row (transformers' pixel_shuffle, the same order)."""
        tiles, patches, width = x.shape
        side, scale = int(patches ** 0.5), self.scale_factor
        x = x.view(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(tiles, side // scale, side // scale, width * scale * scale).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(tiles, patches // scale ** 2, width * scale * scale))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The decoder of LlamaForCausalLM with a vision tower and connector beside it (`config`: the decoder's config
    carrying the checkpoint's vision_config, scale_factor and image_token_id: core/loader.py load_config)."""

    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, context_len: int | None = None) -> None:
        super().__init__(config, quant, dtype, context_len)
        self.vision_model = VisionTransformer(config.vision_config, dtype)
        self.connector = Connector(config, dtype)
        self.images_encoded = 0  # images through the tower since loading (a picture seen lately: none)
        self.encoded = EncodedImages()
        # the checkpoint's names: the decoder under model.text_model, the tower and connector beside it
        self.checkpoint_renames = {"model.text_model.": "model.", "model.vision_model.": "vision_model.",
                                   "model.connector.": "connector."}

    unfused_prefixes = ("vision_model.",)  # the tower's q / k / v stay three layers (the loader fuses the decoder's)

    def encode_images(self, images: list[ImageInput]) -> None:
        """Run the tower and connector over every tile of `images` at once and keep each image's rows on it."""
        device, dtype = self.connector.modality_projection.proj.weight.device, \
            self.connector.modality_projection.proj.weight.dtype
        pixels = torch.cat([image.pixels["pixel_values"] for image in images]).to(device, dtype)
        masks = torch.cat([image.pixels["pixel_attention_mask"] for image in images]).to(device, torch.bool)
        rows = self.connector(self.vision_model(pixels, masks))
        first = 0
        for image in images:
            tiles = image.pixels["pixel_values"].shape[0]
            image.embeddings = rows[first:first + tiles].reshape(-1, rows.shape[-1])
            if image.embeddings.shape[0] != len(image.positions):
                raise ValueError(f"an image's {tiles} tiles give {image.embeddings.shape[0]} rows for "
                                 f"{len(image.positions)} image tokens")
            first += tiles
        self.images_encoded += len(images)

    def embed_with_images(self, input_ids: torch.Tensor, splices: list[tuple[ImageInput, list[int], list[int]]]
                          ) -> torch.Tensor:
        """The step's input embeddings with image rows in place: `splices` (image, flat rows of the step, the image's
        rows for them); images not encoded yet are encoded here, together."""
        pending = []
        for image in {id(image): image for image, _, _ in splices if image.embeddings is None}.values():
            image.embeddings = self.encoded.get(image.digest)
            if image.embeddings is None:
                pending.append(image)
        if pending:
            self.encode_images(pending)
            for image in pending:
                self.encoded.put(image.digest, image.embeddings)
        hidden = self.model.embed_tokens(input_ids)
        rows = torch.tensor([row for _, flat, _ in splices for row in flat], device=hidden.device)
        values = torch.cat([image.embeddings[taken] for image, _, taken in splices])
        hidden[rows] = values.to(hidden.dtype)
        return hidden


def vision_parameter_count(config) -> int:
    """The tower's and connector's parameters from a decoder config carrying the checkpoint's vision_config and
    scale_factor (core/loader.py decoder_config): what the memory estimate adds for them."""
    v = config.vision_config
    width, inner = v.hidden_size, v.intermediate_size
    embeddings = v.num_channels * v.patch_size ** 2 * width + width + (v.image_size // v.patch_size) ** 2 * width
    layer = 4 * (width * width + width) + 2 * width * inner + inner + width + 4 * width  # attention, MLP, 2 norms
    return embeddings + v.num_hidden_layers * layer + 2 * width + width * config.scale_factor ** 2 * config.hidden_size


def image_prompt(processor, text: str, pictures: list, digests: list[bytes]) -> ImagePrompt:
    """`text` (a rendered prompt with one `<image>` per picture) and its pictures (PIL images) through the model's HF
    processor: the token ids with every image expanded into its tiles' tokens, and each picture's ImageInput (its
    tiles' pixels, the positions of its `<image>` tokens, `digests`' hash)."""
    out = processor(text=[text], images=[pictures] if pictures else None, return_tensors="pt",
                    return_text_replacement_offsets=True, add_special_tokens=False)
    token_ids = out["input_ids"][0].tolist()
    if not pictures:
        return ImagePrompt(token_ids, [])
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    counts = [part["replacement"].count(processor.image_token) for part in out["text_replacement_offsets"][0]]
    images, first_position, first_tile = [], 0, 0
    for count, digest in zip(counts, digests):
        tiles = count // processor.image_seq_len
        pixels = {name: out[name][0, first_tile:first_tile + tiles]
                  for name in ("pixel_values", "pixel_attention_mask")}
        images.append(ImageInput(positions[first_position:first_position + count], pixels, digest))
        first_position, first_tile = first_position + count, first_tile + tiles
    return ImagePrompt(token_ids, images)
