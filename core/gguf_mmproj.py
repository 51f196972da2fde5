"""A GGUF model's vision projector file (llama.cpp's `mmproj`): found beside the model, read into the same index
directory (core/gguf_source.py), served with the model.

llama.cpp keeps a vision-language model as two files: the decoder (an ordinary GGUF: SmolVLM's is architecture
llama) and its vision tower and projector (architecture clip). LM Studio and llama.cpp's own downloads put the
projector beside the model as `mmproj-*.gguf`; so does kvforge look for it: a model file paired with the projector in
its directory whose projection width is the decoder's embedding width and whose image token the decoder's vocabulary
has (a directory of several models and one projector pairs only the model it fits). Several projectors that fit (an
F16 and a Q8_0 one): the first by name, logged.

The index then holds the checkpoint's config as transformers writes a vision model's (the decoder's config as its
text_config, the tower's from the projector's metadata), and the processor's config (HF transformers' processor, its
PIL image processing, with the sizes the metadata gives); at every load the projector's tensors follow the model's,
under the checkpoint's names (gguf's own name map, the one llama.cpp's converter writes them with), dense: the tower
is a small part of the weights and runs once per picture.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# clip.projector_type -> the checkpoint's architecture
PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}
# the placeholder each projector's processor expands
IMAGE_TOKENS = {"idefics3": "<image>", "gemma3": "<start_of_image>"}
# Gemma 3's image tokens, as its HF tokenizer names them (a GGUF's vocabulary may lack the soft token: added then)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def projector_for(gguf: Path) -> Path | None:
    """The projector file paired with the model file `gguf` (see the module's docstring), or None."""
    from kvforge.core.model_files import read_gguf_header

    candidates = sorted(gguf.parent.glob("mmproj*.gguf"))
    if not candidates:
        return None
    model = read_gguf_header(gguf).metadata
    width = model.get(f"{model.get('general.architecture')}.embedding_length")
    fits = []
    for candidate in candidates:
        try:
            meta = read_gguf_header(candidate).metadata
        except ValueError:
            continue
        kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
        if meta.get("general.architecture") == "clip" and kind in PROJECTORS and \
                meta.get("clip.vision.projection_dim") == width and \
                has_token(gguf, IMAGE_TOKENS[kind]):
            fits.append(candidate)
    if len(fits) > 1:
        log.warning("several vision projectors fit %s: %s; serving %s", gguf.name, ", ".join(f.name for f in fits),
                    fits[0].name)
    return fits[0] if fits else None


def has_token(gguf: Path, token: str) -> bool:
    """Whether the GGUF's vocabulary has `token`: its length-prefixed bytes in the metadata (GGUF strings are stored
    so; an array element is one), searched directly -- GGUFReader takes seconds over Gemma's 262k tokens."""
    from kvforge.core.model_files import read_gguf_header

    end = read_gguf_header(gguf).data_offset
    encoded = token.encode()
    needle = len(encoded).to_bytes(8, "little") + encoded
    with open(gguf, "rb") as f:
        return needle in f.read(end)


def array_field(path: Path, key: str) -> tuple | None:
    """An array in a GGUF file's metadata (the bounded header pass checks arrays but keeps none: read here with the
    `gguf` package, once per file version)."""
    info = path.stat()
    return _array_field(str(path.resolve()), info.st_size, info.st_mtime_ns, key)


@lru_cache(maxsize=64)
def _array_field(path: str, size: int, mtime_ns: int, key: str) -> tuple | None:
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get(key)
    return None if field is None else tuple(field.contents())


def vision_checkpoint_config(text_config, mmproj: Path, tokenizer):
    """The checkpoint config of the model `text_config` describes with the projector `mmproj` (transformers' own
    config class for it), and the processor that prepares its pictures."""
    from kvforge.core.model_files import read_gguf_header

    meta = read_gguf_header(mmproj).metadata
    image_size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    vision = dict(hidden_size=int(meta["clip.vision.embedding_length"]),
                  intermediate_size=int(meta["clip.vision.feed_forward_length"]),
                  num_hidden_layers=int(meta["clip.vision.block_count"]),
                  num_attention_heads=int(meta["clip.vision.attention.head_count"]),
                  layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                  image_size=image_size, patch_size=patch, hidden_act="gelu_pytorch_tanh")
    normalize = dict(image_mean=[float(v) for v in array_field(mmproj, "clip.vision.image_mean") or (0.5, 0.5, 0.5)],
                     image_std=[float(v) for v in array_field(mmproj, "clip.vision.image_std") or (0.5, 0.5, 0.5)])
    kind = meta.get("clip.projector_type")
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    if kind == "gemma3":
        config, processor = _gemma3(text_config, meta, vision, normalize, tokenizer, tied)
    else:
        config, processor = _idefics3(text_config, meta, vision, normalize, tokenizer, tied)
    config.architectures = [PROJECTORS[kind]]
    return config, processor


def _idefics3(text_config, meta: dict, vision: dict, normalize: dict, tokenizer, tied: bool):
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image_size, patch = vision["image_size"], vision["patch_size"]
    scale = int(meta.get("clip.vision.projector.scale_factor", 2))
    config = Idefics3Config(text_config=text_config.to_dict(), vision_config=vision, scale_factor=scale,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["idefics3"]),
                            tie_word_embeddings=tied)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": int(meta.get("clip.vision.preproc_image_size", image_size))},
        max_image_size={"longest_edge": image_size}, **normalize)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(image_size // patch) ** 2 // scale ** 2)
    return config, processor


def _gemma3(text_config, meta: dict, vision: dict, normalize: dict, tokenizer, tied: bool):
    """Gemma 3's: its patches pooled scale x scale (llama.cpp writes the scale only where it is not 4: 896-pixel
    squares of 14-pixel patches into 256 tokens); the tokenizer's image tokens named (see `gemma3_tokenizer`)."""
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_size, patch = vision["image_size"], vision["patch_size"]
    scale = int(meta.get("clip.vision.projector.scale_factor", 4))
    tokens = (image_size // patch // scale) ** 2
    config = Gemma3Config(text_config=text_config.to_dict(), vision_config=vision | {"vision_use_head": False},
                          mm_tokens_per_image=tokens, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id,
                          tie_word_embeddings=tied)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, **normalize)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=tokens)
    return config, processor


def gemma3_tokenizer(index: Path):
    """The index's tokenizer with Gemma 3's image tokens named (boi / eoi / image token: its processor reads them), the
    soft token added where the GGUF's vocabulary lacks it (its rows are the tower's, never looked up)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(index, extra_special_tokens=GEMMA3_TOKENS)
    missing = [token for token in GEMMA3_TOKENS.values() if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    return tokenizer


def save_processor_config(processor, out: Path) -> None:
    """The processor's own config file in `out` (the tokenizer there is the index's)."""
    with tempfile.TemporaryDirectory() as scratch:
        processor.save_pretrained(scratch)
        (out / "processor_config.json").write_text((Path(scratch) / "processor_config.json").read_text())


def checkpoint_names(config) -> dict[str, str]:
    """The projector file's tensor names -> the checkpoint's (the tower's and projector's as transformers names them),
    by gguf's name map for clip files (what llama.cpp's converter names them with)."""
    import gguf

    layers = config.vision_config.num_hidden_layers
    if config.architectures[0] == PROJECTORS["gemma3"]:
        tower = "vision_tower.vision_model"
        # the projection is a bare parameter (its name ends in _weight); the map knows it as a module
        out = {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
               "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"}
        names = []
    else:
        tower, out = "model.vision_model", {}
        names = ["model.connector.modality_projection.proj"]
    names += [f"{tower}.embeddings.{part}" for part in ("patch_embedding", "position_embedding")]
    names.append(f"{tower}.post_layernorm")
    for i in range(layers):
        layer = f"{tower}.encoder.layers.{i}"
        names += [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
        names += [f"{layer}.{p}" for p in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")]
    mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    for name in names:
        theirs = mapping.get_name(name)
        if theirs is None:
            raise ValueError(f"gguf has no projector tensor name for {name}")
        for suffix in (".weight", ".bias"):
            out[theirs + suffix] = name + suffix
    return out


# tensors llama.cpp's converter changed: Gemma 3's projector norm stored as 1 + weight (transformers' stores weight)
OFFSET_TENSORS = {"mm.soft_emb_norm.weight": -1.0}


def tensors(mmproj: Path, names: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector's tensors under the checkpoint's names, each dense (a block type dequantized)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvforge.core.gguf_source import FLOAT_DTYPES
    from kvforge.core.model_files import read_gguf_header

    header = read_gguf_header(mmproj)
    data = np.memmap(mmproj, dtype=np.uint8, mode="r")
    for tensor in header.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        raw = data[header.data_offset + tensor.offset: header.data_offset + tensor.offset + tensor.n_bytes]
        shape = tuple(reversed(tensor.shape))
        if tensor.ggml_type in FLOAT_DTYPES:
            values = torch.from_numpy(np.array(raw)).view(FLOAT_DTYPES[tensor.ggml_type]).view(shape)
        else:
            values = torch.from_numpy(dequantize(np.array(raw), GGMLQuantizationType(tensor.ggml_type))).view(shape)
        if tensor.name in OFFSET_TENSORS:
            values = values.float() + OFFSET_TENSORS[tensor.name]
        yield name, values


def add_projector(index: Path, mmproj: Path) -> None:
    """Make the model's index directory (core/gguf_source.py write_index's) a vision model's: the checkpoint config
    and the processor's, and the projector's path and tensor names in the index file."""
    from transformers import AutoConfig, AutoTokenizer

    from kvforge.core.gguf_source import INDEX_FILE
    from kvforge.core.model_files import read_gguf_header

    gemma = read_gguf_header(mmproj).metadata.get("clip.projector_type") == "gemma3"
    tokenizer = gemma3_tokenizer(index) if gemma else AutoTokenizer.from_pretrained(index)
    config, processor = vision_checkpoint_config(AutoConfig.from_pretrained(index), mmproj, tokenizer)
    if gemma:
        tokenizer.save_pretrained(index)
    save_processor_config(processor, index)
    config.save_pretrained(index)
    entries = json.loads((index / INDEX_FILE).read_text())
    entries["mmproj"] = {"source": str(mmproj.resolve()), "tensors": checkpoint_names(config)}
    (index / INDEX_FILE).write_text(json.dumps(entries))


def projector_entry(index: Path) -> dict | None:
    from kvforge.core.gguf_source import INDEX_FILE

    return json.loads((index / INDEX_FILE).read_text()).get("mmproj")


def projector_tensors(index: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's and connector's tensors of an index directory with a projector (none without one)."""
    entry = projector_entry(index)
    if entry is not None:
        yield from tensors(Path(entry["source"]), entry["tensors"])


def projector_tensor_names(index: Path) -> list[str]:
    entry = projector_entry(index)
    return list(entry["tensors"].values()) if entry is not None else []

