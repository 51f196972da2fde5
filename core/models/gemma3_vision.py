"""Gemma 3's vision-language model (Gemma3ForConditionalGeneration: 4B, 12B, 27B): a SigLIP tower over one fixed-size
square per crop (896 pixels, 14-pixel patches: 64 x 64 patches), the projector (the patches average-pooled to
mm_tokens_per_image rows -- 256 -- then Gemma's RMSNorm and a projection into the decoder's width) and the Gemma 3
decoder of core/models/gemma.py.

As transformers computes it: the image rows replace the embeddings of the `<image_soft_token>`s after the decoder's
sqrt(hidden) scaling (they are not scaled), and in the prefill each image's tokens attend to every token of the image,
later ones too (transformers' token_type_ids blocks; causal everywhere else, the sliding window still counted back from
each token's own position). The ImageInputs say so (`bidirectional`): the scheduler never ends a prefill chunk inside
an image, and the attention widens those rows' limit (core/images.py, core/layers/attention.py).

The processor (HF transformers' Gemma3Processor) resizes a picture to the tower's square (and, with pan and scan,
adds crops) and writes `<start_of_image>`, mm_tokens_per_image `<image_soft_token>`s and `<end_of_image>` per crop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.images import ImageInput, ImagePrompt
from kvforge.core.models.gemma import GemmaForCausalLM, GemmaRMSNorm
from kvforge.core.models.siglip import VisionTransformer, tower_parameter_count
from kvforge.core.models.vision import ImageRows, processed, split_images
from kvforge.core.quant_config import QuantConfig


class MultiModalProjector(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.hidden_size,
                                                                   dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.per_side = vision.image_size // vision.patch_size
        self.kernel = self.per_side // int(config.mm_tokens_per_image ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[crops, patches, width] -> [crops, mm_tokens_per_image, decoder width]."""
        crops, _, width = x.shape
        grid = x.transpose(1, 2).reshape(crops, width, self.per_side, self.per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(ImageRows, GemmaForCausalLM):
    """The decoder of GemmaForCausalLM with the tower and projector beside it (`config`: the decoder's config carrying
    the checkpoint's vision_config, mm_tokens_per_image and image_token_id: core/loader.py decoder_config)."""

    vision_modules = ("vision_tower", "multi_modal_projector")
    unfused_prefixes = ("vision_tower.",)  # the tower's q / k / v stay three layers (the loader fuses the decoder's)

    def __init__(self, config, quant: QuantConfig, dtype: torch.dtype, context_len: int | None = None) -> None:
        super().__init__(config, quant, dtype, context_len)
        self.vision_tower = VisionTransformer(config.vision_config, dtype)
        self.multi_modal_projector = MultiModalProjector(config, dtype)
        self.init_image_rows()
        # the checkpoint's names (transformers 4's as Google ships them, and 5's; the loader has put "model." before
        # the first kind): the decoder under language_model, the tower (under vision_model) and projector beside it
        self.checkpoint_renames = {
            "model.language_model.model.": "model.", "model.language_model.lm_head.": "lm_head.",
            "model.language_model.": "model.", "model.vision_tower.vision_model.": "vision_tower.",
            "model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."}

    def encode_images(self, images: list[ImageInput]) -> None:
        """Run the tower and projector over every crop of `images` at once and keep each image's rows on it."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([image.pixels["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        self.give_rows(images, self.multi_modal_projector(self.vision_tower(pixels)))

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)


def vision_parameter_count(config) -> int:
    """The tower's and projector's parameters (a decoder config carrying the checkpoint's vision_config)."""
    width = config.vision_config.hidden_size
    return tower_parameter_count(config.vision_config) + width + width * config.hidden_size


def image_prompt(processor, text: str, pictures: list, digests: list[bytes]) -> ImagePrompt:
    """`text` (a rendered prompt with one `<start_of_image>` per picture) and its pictures (PIL images) through the
    model's HF processor: the token ids with every picture expanded into its crops' soft tokens, and each picture's
    ImageInput (its crops' pixels, the positions of its soft tokens, attended both ways, `digests`' hash)."""
    out = processed(processor, text, pictures)
    tokenizer = processor.tokenizer
    tiles = {"pixel_values": out["pixel_values"]} if pictures else {}
    return split_images(out, tokenizer.image_token, tokenizer.image_token_id, processor.image_seq_length, tiles,
                        digests, bidirectional=True)
