"""What a vision-language model class adds to its decoder, whatever its tower: the step's input embeddings with the
image rows in place (core/images.py; the runner hands them to the decoder as its first hidden states), each image
through the tower once per request and its rows kept by digest for the next turn (EncodedImages)."""

from __future__ import annotations

import torch

from kvforge.core.images import EncodedImages, ImageInput, ImagePrompt


class ImageRows:
    """A mixin for a model class with a vision tower: it defines `encode_images` (the tower's rows onto each
    ImageInput.embeddings) and `embed_text` (the decoder's input embeddings of token ids, as its forward makes them)."""

    vision_modules: tuple[str, ...]  # the attributes holding the tower and projector (counted apart in placement)
    images_encoded: int  # images through the tower since loading (a picture seen lately: none)
    encoded: EncodedImages

    def init_image_rows(self) -> None:
        self.images_encoded = 0
        self.encoded = EncodedImages()

    def encode_images(self, images: list[ImageInput]) -> None:
        raise NotImplementedError

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
        rows = torch.tensor([row for _, flat, _ in splices for row in flat], device=input_ids.device)
        # an image token's id may lie past the embedding table (Gemma 3's soft token): its row is replaced anyway
        hidden = self.embed_text(input_ids.index_fill(0, rows, 0))
        values = torch.cat([image.embeddings[taken] for image, _, taken in splices])
        hidden[rows] = values.to(hidden.dtype)
        self.images_encoded += len(pending)
        return hidden

    @staticmethod
    def give_rows(images: list[ImageInput], rows: torch.Tensor) -> None:
        """The tower's rows [tiles, rows per tile, width] of `images`' tiles laid end to end, onto each image."""
        first = 0
        for image in images:
            tiles = image.pixels["pixel_values"].shape[0]
            image.embeddings = rows[first:first + tiles].reshape(-1, rows.shape[-1])
            if image.embeddings.shape[0] != len(image.positions):
                raise ValueError(f"an image's {tiles} tiles give {image.embeddings.shape[0]} rows for "
                                 f"{len(image.positions)} image tokens")
            first += tiles


def processed(processor, text: str, pictures: list):
    """A rendered prompt and its pictures (PIL images) through the model's HF processor, with each placeholder's
    replacement text (what `split_images` counts the image tokens in)."""
    return processor(text=[text], images=[pictures] if pictures else None, return_tensors="pt",
                     return_text_replacement_offsets=True, add_special_tokens=False)


def split_images(processed, image_token: str, image_token_id: int, tokens_per_tile: int,
                 tiles: dict[str, torch.Tensor], digests: list[bytes], bidirectional: bool = False) -> ImagePrompt:
    """A processor's output for one prompt (`processed`: asked with return_text_replacement_offsets) as an ImagePrompt:
    each picture's positions (its `image_token_id` tokens, counted in its placeholder's replacement text), its tiles
    (`tiles`: each tensor [tiles of every picture, ...], tokens_per_tile tokens a tile) and its digest."""
    token_ids = processed["input_ids"][0].tolist()
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    images, first_position, first_tile = [], 0, 0
    for part, digest in zip(processed.get("text_replacement_offsets", [[]])[0], digests):
        count = part["replacement"].count(image_token)
        count_tiles = count // tokens_per_tile
        pixels = {name: tensor[first_tile:first_tile + count_tiles] for name, tensor in tiles.items()}
        images.append(ImageInput(positions[first_position:first_position + count], pixels, digest,
                                 bidirectional=bidirectional))
        first_position, first_tile = first_position + count, first_tile + count_tiles
    return ImagePrompt(token_ids, images)
