"""Idefics3 / SmolVLM: a SigLIP vision tower (any aspect ratio: its patch positions bucketed as NaViT does), the
connector (a pixel shuffle that folds scale_factor^2 neighbouring patches into one row, then a projection into the
decoder's width) and the Llama decoder of core/models/llama.py. An image's rows replace the embeddings of its
`<image>` tokens (core/images.py); the decoder attends causally over them like any token, so a prefill chunk may end
inside an image.

The processor (HF transformers' Idefics3Processor) splits a picture into tiles of the tower's size plus one global
view and writes `<fake_token_around_image><row_i_col_j>` and image_seq_len `<image>` tokens per tile; every tile
becomes exactly image_seq_len rows here, so an image's rows are its tiles' rows in order.

The tower is core/models/siglip.py's (NaViT positions); core/models/vision.py splices the rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.core.images import ImageInput, ImagePrompt
from kvforge.core.models.llama import LlamaForCausalLM
from kvforge.core.models.siglip import VisionTransformer, tower_parameter_count
from kvforge.core.models.vision import ImageRows, processed, split_images
from kvforge.core.quant_config import QuantConfig


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


class Idefics3ForConditionalGeneration(ImageRows, LlamaForCausalLM):
    """The decoder of LlamaForCausalLM with a vision tower and connector beside it (`config`: the decoder's config
    carrying the checkpoint's vision_config, scale_factor and image_token_id: core/loader.py load_config)."""

    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, context_len: int | None = None) -> None:
        super().__init__(config, quant, dtype, context_len)
        self.vision_model = VisionTransformer(config.vision_config, dtype, navit_positions=True)
        self.connector = Connector(config, dtype)
        self.init_image_rows()
        # the checkpoint's names: the decoder under model.text_model, the tower and connector beside it
        self.checkpoint_renames = {"model.text_model.": "model.", "model.vision_model.": "vision_model.",
                                   "model.connector.": "connector."}

    vision_modules = ("vision_model", "connector")
    unfused_prefixes = ("vision_model.",)  # the tower's q / k / v stay three layers (the loader fuses the decoder's)

    def encode_images(self, images: list[ImageInput]) -> None:
        """Run the tower and connector over every tile of `images` at once and keep each image's rows on it."""
        device, dtype = self.connector.modality_projection.proj.weight.device, \
            self.connector.modality_projection.proj.weight.dtype
        pixels = torch.cat([image.pixels["pixel_values"] for image in images]).to(device, dtype)
        masks = torch.cat([image.pixels["pixel_attention_mask"] for image in images]).to(device, torch.bool)
        self.give_rows(images, self.connector(self.vision_model(pixels, masks)))

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


def vision_parameter_count(config) -> int:
    """The tower's and connector's parameters from a decoder config carrying the checkpoint's vision_config and
    scale_factor (core/loader.py decoder_config): what the memory estimate adds for them."""
    width = config.vision_config.hidden_size
    return tower_parameter_count(config.vision_config) + width * config.scale_factor ** 2 * config.hidden_size


def image_prompt(processor, text: str, pictures: list, digests: list[bytes]) -> ImagePrompt:
    """`text` (a rendered prompt with one `<image>` per picture) and its pictures (PIL images) through the model's HF
    processor: the token ids with every image expanded into its tiles' tokens, and each picture's ImageInput (its
    tiles' pixels, the positions of its `<image>` tokens, `digests`' hash)."""
    out = processed(processor, text, pictures)
    tiles = {name: out[name][0] for name in ("pixel_values", "pixel_attention_mask") if pictures}
    return split_images(out, processor.image_token, processor.tokenizer.convert_tokens_to_ids(processor.image_token),
                        processor.image_seq_len, tiles, digests)
