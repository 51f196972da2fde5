"""Images in a prompt: what a vision-language model's processor made of each picture, where its rows go in the
prompt, and the keys the prefix cache and the persisted KV know its positions by.

A prompt with images is an `ImagePrompt`: its token ids (each image's placeholder tokens included, as the model's
processor expanded them) and one `ImageInput` per image, in order. The vision tower encodes an image once per request,
at the first prefill chunk that reaches one of its positions (core/runner.py), and its rows replace those positions'
token embeddings; a chunk that ends inside an image takes the rows it covers.

The KV of an image's positions depends on the picture, not on its placeholder ids, so the prefix cache must not key
them by the ids: `cache_keys` gives each image position a key made of the image's content digest and the position's
index in the image -- a negative int64, never a token id -- and the block hashes (core/kv/manager.py) and the persisted
tier's entries take those keys where the prompt has images. The same picture sent again (the next turn of a chat
about it) has the same keys, so its blocks hit; two pictures never share a block.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

_KEY_SPAN = 1 << 63  # keys are -1 .. -2**63: below every token id
ENCODED_IMAGES_BYTES = 256 << 20  # the tower's rows kept for pictures seen lately (a SmolVLM image's: 2.5 MiB)


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt. `positions`: the prompt positions its embedding rows replace, in row order; `pixels`:
    what the model's vision tower reads (its processor's tensors for this image, e.g. pixel_values [tiles, 3, H, W]);
    `digest`: the image's content hash. `embeddings` holds the tower's rows once encoded (kept for the request's
    life: a preempted sequence recomputes its KV from them, not from the pixels). `bidirectional`: each run of its
    consecutive positions attends to the whole run, later positions too (Gemma 3), so a prefill chunk never ends
    inside a run (`chunk_end`) and the runner widens those rows' causal limit (`key_limits`)."""

    positions: list[int]
    pixels: dict[str, torch.Tensor]
    digest: bytes
    embeddings: torch.Tensor | None = field(default=None, repr=False)
    bidirectional: bool = False

    @functools.cached_property
    def runs(self) -> list[tuple[int, int]]:
        """Its runs of consecutive positions, [first, last] each (one per tile or crop, or one for the image)."""
        runs: list[tuple[int, int]] = []
        for position in self.positions:
            if runs and runs[-1][1] == position - 1:
                runs[-1] = (runs[-1][0], position)
            else:
                runs.append((position, position))
        return runs

    @staticmethod
    def digest_of(data: bytes) -> bytes:
        """The content hash of an image's bytes (as the client sent them)."""
        return hashlib.sha256(data).digest()


@dataclass
class ImagePrompt:
    """A prompt's token ids (image placeholders expanded) and its images in order."""

    token_ids: list[int]
    images: list[ImageInput]


class EncodedImages:
    """The vision tower's rows of recent pictures by digest, least recently used dropped past a byte budget. The
    prefix cache keeps whole blocks, so the next turn of a chat about a picture recomputes the block where the first
    turn's prompt ended, which may hold the image's last rows; those, and the same picture in another request, come
    from here instead of the tower (a real image's tiles take seconds through it on a CPU)."""

    def __init__(self, budget_bytes: int = ENCODED_IMAGES_BYTES) -> None:
        self.budget_bytes, self.bytes = budget_bytes, 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.get(digest)
        if rows is not None:
            self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if digest in self._rows or size > self.budget_bytes:
            return
        self._rows[digest], self.bytes = rows, self.bytes + size
        while self.bytes > self.budget_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()


def chunk_end(images: list[ImageInput], start: int, end: int) -> int:
    """Where a prefill chunk [start, end) may end: `end`, unless it falls inside a bidirectional run (whose tokens
    need the whole run's keys, later ones too); then the run's first position, or past its last where the chunk starts
    inside the run (a chunk longer than the budget: the run must go in one piece)."""
    for image in images:
        if not image.bidirectional:
            continue
        for first, last in image.runs:
            if first < end <= last:
                return first if first > start else last + 1
    return end


def key_limits(images: list[ImageInput], start: int, end: int) -> list[tuple[int, int, int]]:
    """The positions in [start, end) that see keys past their own: (first, last + 1, the last key position they
    see) for each bidirectional run the chunk covers."""
    return [(max(first, start), min(last + 1, end), last) for image in images if image.bidirectional
            for first, last in image.runs if first < end and last >= start]


def cache_keys(token_ids: list[int], images: list[ImageInput]) -> list[int]:
    """`token_ids` with each image position's id replaced by its key (see the module's docstring)."""
    keys = list(token_ids)
    for image in images:
        base = int.from_bytes(image.digest[:8], "little")
        for index, position in enumerate(image.positions):
            keys[position] = -1 - (base + index) % _KEY_SPAN
    return keys


def check_images(token_ids: list[int], images: list[ImageInput], image_token_id: int | None) -> None:
    """ValueError unless every image's positions lie in the prompt, hold the model's image token, no two images claim
    one position and every image token of the prompt is claimed (a bare placeholder would be read as text); a model
    without a vision tower (`image_token_id` None) takes no images."""
    if not images:
        if image_token_id is not None and image_token_id in token_ids:
            raise ValueError("the prompt has image tokens but no images")
        return
    if image_token_id is None:
        raise ValueError("this model takes no images (it has no vision tower)")
    claimed: set[int] = set()
    for number, image in enumerate(images):
        if not image.positions:
            raise ValueError(f"image {number} has no positions in the prompt")
        for position in image.positions:
            if not 0 <= position < len(token_ids) or token_ids[position] != image_token_id:
                raise ValueError(f"image {number}: prompt position {position} is not an image token")
            if position in claimed:
                raise ValueError(f"image {number}: prompt position {position} belongs to another image")
            claimed.add(position)
    if token_ids.count(image_token_id) != len(claimed):
        raise ValueError(f"the prompt has {token_ids.count(image_token_id)} image tokens; its images fill "
                         f"{len(claimed)}")
