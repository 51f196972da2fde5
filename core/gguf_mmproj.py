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

PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration"}  # clip.projector_type -> the checkpoint's architecture
IMAGE_TOKENS = {"idefics3": "<image>"}  # the placeholder each projector's processor expands


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
                IMAGE_TOKENS[kind] in (array_field(gguf, "tokenizer.ggml.tokens") or ()):
            fits.append(candidate)
    if len(fits) > 1:
        log.warning("several vision projectors fit %s: %s; serving %s", gguf.name, ", ".join(f.name for f in fits),
                    fits[0].name)
    return fits[0] if fits else None


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
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from kvforge.core.model_files import read_gguf_header

    meta = read_gguf_header(mmproj).metadata
    image_size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    scale = int(meta.get("clip.vision.projector.scale_factor", 2))
    vision = dict(hidden_size=int(meta["clip.vision.embedding_length"]),
                  intermediate_size=int(meta["clip.vision.feed_forward_length"]),
                  num_hidden_layers=int(meta["clip.vision.block_count"]),
                  num_attention_heads=int(meta["clip.vision.attention.head_count"]),
                  layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                  image_size=image_size, patch_size=patch, hidden_act="gelu_pytorch_tanh")
    image_token = IMAGE_TOKENS[meta.get("clip.projector_type")]
    config = Idefics3Config(text_config=text_config.to_dict(), vision_config=vision, scale_factor=scale,
                            image_token_id=tokenizer.convert_tokens_to_ids(image_token),
                            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    config.architectures = [PROJECTORS[meta.get("clip.projector_type")]]
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": int(meta.get("clip.vision.preproc_image_size", image_size))},
        max_image_size={"longest_edge": image_size},
        image_mean=[float(v) for v in array_field(mmproj, "clip.vision.image_mean") or (0.5, 0.5, 0.5)],
        image_std=[float(v) for v in array_field(mmproj, "clip.vision.image_std") or (0.5, 0.5, 0.5)])
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(image_size // patch) ** 2 // scale ** 2)
    return config, processor


def save_processor_config(processor, out: Path) -> None:
    """The processor's own config file in `out` (the tokenizer there is the index's)."""
    with tempfile.TemporaryDirectory() as scratch:
        processor.save_pretrained(scratch)
        (out / "processor_config.json").write_text((Path(scratch) / "processor_config.json").read_text())


def checkpoint_names(config) -> dict[str, str]:
    """The projector file's tensor names -> the checkpoint's (model.vision_model.*, model.connector.*), by gguf's name
    map for clip files (what llama.cpp's converter names them with)."""
    import gguf

    layers = config.vision_config.num_hidden_layers
    names = ["model.vision_model.embeddings.patch_embedding", "model.vision_model.embeddings.position_embedding",
             "model.vision_model.post_layernorm", "model.connector.modality_projection.proj"]
    for i in range(layers):
        layer = f"model.vision_model.encoder.layers.{i}"
        names += [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
        names += [f"{layer}.{p}" for p in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")]
    mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    out = {}
    for name in names:
        theirs = mapping.get_name(name)
        if theirs is None:
            raise ValueError(f"gguf has no projector tensor name for {name}")
        for suffix in (".weight", ".bias"):
            out[theirs + suffix] = name + suffix
    return out


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
        yield name, values


def add_projector(index: Path, mmproj: Path) -> None:
    """Make the model's index directory (core/gguf_source.py write_index's) a vision model's: the checkpoint config
    and the processor's, and the projector's path and tensor names in the index file."""
    from transformers import AutoConfig, AutoTokenizer

    from kvforge.core.gguf_source import INDEX_FILE

    config, processor = vision_checkpoint_config(AutoConfig.from_pretrained(index), mmproj,
                                                 AutoTokenizer.from_pretrained(index))
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

