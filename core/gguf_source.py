"""A GGUF file served in place: its tensors memory-mapped under the names the model classes load, the quantized
ones as their blocks exactly as they lie in the file, nothing rewritten or copied.

Once per file (loader.cached_checkpoint) a small index directory is written into the cache: config.json, the
tokenizer, and `gguf_index.json` (the file's path, each tensor's HF name, the row order of Llama's Q / K
projections, which projections are served dense). What that needs -- the config, the tokenizer, the tensor names
and the per-architecture fix-ups -- comes from transformers' GGUF reader, as for a dense conversion (the config of a
MoE file it does not read, Mixtral's or OLMoE's, from core/gguf_moe.py); reading it takes seconds, and no weights are
written.

At every load (`tensors`) the file is mapped (a private mapping: pages come from the page cache, shared with any
other reader of the file, and are never written), or, when the engine copies it (`gguf_weights`, decided by
`copies_weights`), its tensor data read once into anonymous memory on huge pages; each tensor is yielded as a view of
that memory:
- a projection, the LM head or the embedding (in a block type, or F32 / F16 / BF16 but for a fused layer mixing
  float and block types, which is served dense): uint8 [rows, row bytes] with three attributes,
  `gguf_type` (ggml's type number), `gguf_in_features` and `gguf_rows` (None, or the HF row order as indices of the
  file's rows: Llama's Q / K rows are permuted in GGUF files; a layer reorders its outputs instead of its weight);
- another float tensor (norms, biases) as an array, with the architecture's fix-up (Gemma's norm offset) applied;
- a quantized tensor that is served dense (a fused layer whose parts mix float and block types) dequantized;
- a mixture-of-experts layer's stacked experts (llama.cpp's `ffn_*_exps`, core/gguf_moe.py) one expert at a time,
  each as its own projection: its slice along the expert axis (whole blocks, contiguous in the file).
A tensor in another type fails with its name and type (`--gguf-dense` dequantizes those files as transformers does).
"""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

INDEX_VERSION = "2"  # bump when the index written here changes
INDEX_FILE = "gguf_index.json"
FLOAT_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml type number -> torch dtype
IN_PLACE = ("lm_head.weight", "model.embed_tokens.weight")  # served from the file as the projections are


def is_index(path: Path) -> bool:
    """Whether `path` is an index directory written here (its weights are a GGUF file's)."""
    return (path / INDEX_FILE).is_file()


def source_of(path: Path) -> Path:
    """The GGUF file an index directory serves."""
    return Path(json.loads((path / INDEX_FILE).read_text())["source"])


def block_types() -> dict[int, tuple[int, int]]:
    from kvforge.core.cpu_kernels import GGUF_SUPER

    return GGUF_SUPER


def read_config(gguf: Path):
    """The config transformers' GGUF reader makes of `gguf`, completed for a mixture-of-experts file, or made from the
    metadata for one that reader does not read (Mixtral's, OLMoE's; core/gguf_moe.py); a mixture-of-experts file
    neither reads is refused first."""
    from transformers import AutoConfig

    from kvforge.core import gguf_moe
    from kvforge.core.model_files import read_gguf_header

    header = read_gguf_header(gguf)
    gguf_moe.check_readable(header.metadata)
    if gguf_moe.reads_config(header.metadata):
        return gguf_moe.own_config(header)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_moe.complete_config(config, header.metadata)
    return config


def read_tokenizer(gguf: Path):
    """transformers' tokenizer of `gguf`. For an architecture its reader refuses (OLMoE's) AutoTokenizer fails on the
    config; its GGUF tokenizer reading itself needs no architecture, and TokenizersBackend is the class AutoTokenizer
    picks for a llama file's GPT-2 or SentencePiece vocabulary."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from kvforge.core.model_files import read_gguf_header

    arch = read_gguf_header(gguf).metadata.get("general.architecture")
    reader = AutoTokenizer if arch in GGUF_SUPPORTED_ARCHITECTURES else TokenizersBackend
    return reader.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tensor_map(gguf: Path, config, reference) -> tuple[dict[str, str], Any, dict]:
    """transformers' GGUF name -> HF name map for `gguf` (`reference`: the HF model, on the meta device), and its
    tensor processor for the file's architecture (Llama's Q / K rows un-permuted) with the processor's config."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from kvforge.core.gguf_moe import reads_config
    from kvforge.core.model_files import read_gguf_header

    metadata = read_gguf_header(gguf).metadata
    arch = str(metadata.get("general.architecture"))
    if reads_config(metadata):  # a file transformers' reader does not read: the heads the row order needs
        processor_config = {"num_attention_heads": config.num_attention_heads,
                            "num_key_value_heads": config.num_key_value_heads}
        model_type = arch  # named as its architecture's (gguf-py has no mixtral: its files are llama's)
    else:
        processor_config, model_type = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"], None
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=processor_config)
    return get_gguf_hf_weights_map(reference, processor, model_type=model_type), processor, processor_config


def write_index(gguf: Path, out: Path, model_class_for: Callable[[Any], type]) -> None:
    """The index directory of `gguf` (loader.cached_checkpoint calls it once per file version); `model_class_for`:
    kvforge's model class for a config (core/models/registry.py; handed in: the models import this module)."""
    from transformers import AutoModelForCausalLM

    from kvforge.core.chat_templates import save_tokenizer
    from kvforge.core.gguf_moe import expert_names
    from kvforge.core.model_files import read_gguf_header

    log.warning("indexing %s (once; its weights are served from the file itself)", gguf.name)
    config = read_config(gguf)
    with torch.device("meta"):  # only for the tensor-name mapping; no memory is allocated
        reference = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(reference).__name__]
    packed = getattr(model_class_for(config), "packed_modules_mapping", {})  # unsupported families fail here
    names, processor, processor_config = tensor_map(gguf, config, reference)
    header = read_gguf_header(gguf)
    arch = str(header.metadata.get("general.architecture"))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    blocks = block_types()
    entries: dict[str, dict] = {}
    for tensor in header.tensors:
        experts = expert_names(tensor.name, tensor.shape[-1]) if len(tensor.shape) == 3 else None
        if experts is not None:  # served as each expert's own projection (core/gguf_moe.py)
            if tensor.ggml_type not in blocks and tensor.ggml_type not in FLOAT_DTYPES:
                _unsupported(tensor)
            entries[tensor.name] = {"hf": experts, "in_place": True}
            continue
        name = names.get(tensor.name)
        if name is None:
            continue
        entry: dict = {"hf": name}
        if len(tensor.shape) == 2 and (tensor.ggml_type in blocks or tensor.ggml_type in FLOAT_DTYPES):
            rows = processor.process(weights=np.arange(tensor.shape[1], dtype=np.float64)[:, None],
                                     name=tensor.name).weights[:, 0].astype(np.int64)
            if not np.array_equal(rows, np.arange(tensor.shape[1])):
                entry["rows"] = rows.tolist()
        elif tensor.ggml_type not in FLOAT_DTYPES:
            _unsupported(tensor)
        if len(tensor.shape) == 2 and (name.endswith("_proj.weight") or name in IN_PLACE):
            entry["in_place"] = True
        entries[tensor.name] = entry
    hf_types = {name: t.ggml_type for t in header.tensors if t.name in entries for name in _names(entries[t.name])}
    head = "lm_head.weight" if "lm_head.weight" in hf_types else ("model.embed_tokens.weight" if tied else None)
    dense = _dense_projections(hf_types, packed, set(blocks), set(FLOAT_DTYPES))
    for entry in entries.values():
        if any(name.removesuffix(".weight") in dense for name in _names(entry)):
            entry["dense"] = True
    config.quantization_config = {"quant_method": "gguf", "layout": "blocks",
                                  "lm_head": head is not None and (hf_types[head] in blocks
                                                                   or hf_types[head] in FLOAT_DTYPES),
                                  "modules_to_not_convert": sorted(dense), "source": gguf.name}
    config.save_pretrained(out)
    save_tokenizer(read_tokenizer(gguf), config.model_type, out)
    index = {"version": INDEX_VERSION, "source": str(gguf.resolve()), "arch": arch,
             "processor_config": processor_config, "tensors": entries}
    (out / INDEX_FILE).write_text(json.dumps(index, default=_jsonable))


def _names(entry: dict) -> list[str]:
    """An index entry's HF names: one, or each expert's of a stacked tensor."""
    return entry["hf"] if isinstance(entry["hf"], list) else [entry["hf"]]


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _unsupported(tensor) -> None:
    from gguf import GGMLQuantizationType

    from kvforge.core.plugins import QUANT_GROUP, discover

    supported = discover(QUANT_GROUP).get("gguf").supported_types
    try:
        kind = GGMLQuantizationType(tensor.ggml_type).name
    except ValueError:
        kind = f"number {tensor.ggml_type}"
    raise ValueError(f"GGUF tensor {tensor.name} has type {kind}, which is not supported natively (supported: "
                     f"{', '.join(supported)}); load the file with --gguf-dense to dequantize it")


def _dense_projections(hf_types: dict[str, int], packed: dict, blocks: set[int], floats: set[int]) -> set[str]:
    """Projections served dense: every part of a fused layer (q/k/v, gate/up: one matmul) whose parts mix block and
    float types, or any type neither kernel reads."""
    groups: dict[str, list[str]] = {}
    for name in hf_types:
        if not name.endswith("_proj.weight"):
            continue
        module = name.removesuffix(".weight")
        parent, _, leaf = module.rpartition(".")
        groups.setdefault(f"{parent}.{packed.get(leaf, (leaf, None))[0]}", []).append(module)
    dense: set[str] = set()
    for parts in groups.values():
        kinds = {"block" if t in blocks else "float" if t in floats else "other"
                 for t in (hf_types[f"{p}.weight"] for p in parts)}
        if len(kinds) > 1 or "other" in kinds:
            dense.update(parts)
    return dense


def _mapped(gguf: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private read mapping (copy-on-write: writable as torch wants, never
    written, so its pages stay the page cache's)."""
    with open(gguf, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def tensor_names(path: Path) -> list[str]:
    index = json.loads((path / INDEX_FILE).read_text())
    return [name for entry in index["tensors"].values() for name in _names(entry)]


def copies_weights(setting: str, gguf: Path, device: str, processes: int) -> bool:
    """Whether a load copies the GGUF file's tensor data onto huge pages instead of mapping it (EngineConfig's
    `gguf_weights`). auto copies for one CPU process when the file takes at most COPY_SHARE of the available memory:
    the copy is resident for the engine's life, while a mapping's pages are shared and reclaimable (a model larger
    than memory still runs, slowly, from the page cache); every process of a parallel engine would copy the whole
    file for its share of it; a GPU engine moves the blocks it serves onto the GPU anyway."""
    if setting != "auto":
        return setting == "copied"
    if device != "cpu" or processes > 1:
        return False
    from kvforge.core.metrics import available_memory_bytes

    available = available_memory_bytes()
    return available is not None and gguf.stat().st_size <= COPY_SHARE * available


COPY_SHARE = 0.75  # the largest share of the available memory auto copies a GGUF file into


def tensors(path: Path, copied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The index directory `path`'s tensors under their HF names, read in place from its GGUF file (see above);
    `copied`: from a copy of its tensor data on huge pages (core/host_memory.py) instead of the file's mapping."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from kvforge.core.model_files import read_gguf_header

    index = json.loads((path / INDEX_FILE).read_text())
    gguf = Path(index["source"])
    header = read_gguf_header(gguf)
    if copied:
        from kvforge.core.host_memory import read_into_huge_pages

        base, flat = 0, read_into_huge_pages(gguf, header.data_offset, gguf.stat().st_size - header.data_offset)
    else:
        base, flat = header.data_offset, _mapped(gguf)
    processor = TENSOR_PROCESSORS.get(index["arch"], TensorProcessor)(config=index["processor_config"])
    blocks = block_types()
    for tensor in header.tensors:
        entry = index["tensors"].get(tensor.name)
        if entry is None:
            continue
        start = base + tensor.offset
        data = flat[start: start + tensor.n_bytes]
        shape = tuple(reversed(tensor.shape))
        if isinstance(entry["hf"], list):  # stacked experts [E, rows, row length]: each expert's rows, in place
            stacked = data.view(shape[0], shape[1], -1)
            for expert, name in enumerate(entry["hf"]):
                view = stacked[expert]
                view.gguf_type, view.gguf_in_features, view.gguf_rows = tensor.ggml_type, shape[2], None
                yield name, dequantized(view) if entry.get("dense") else view
        elif len(shape) == 2 and (tensor.ggml_type in blocks or (entry.get("in_place") and not entry.get("dense"))):
            view = data.view(shape[0], -1)
            view.gguf_type, view.gguf_in_features = tensor.ggml_type, shape[1]
            view.gguf_rows = torch.tensor(entry["rows"]) if "rows" in entry else None
            yield entry["hf"], dequantized(view) if entry.get("dense") else view
        elif tensor.ggml_type in FLOAT_DTYPES:
            values = data.view(FLOAT_DTYPES[tensor.ggml_type]).view(shape)
            array = values.float().numpy() if values.dtype == torch.bfloat16 else values.numpy()
            fixed = processor.process(weights=array, name=tensor.name).weights
            yield entry["hf"], values if fixed is array else torch.from_numpy(np.ascontiguousarray(fixed))
        else:
            _unsupported(tensor)


def is_blocks(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a GGUF tensor's blocks as `tensors` yields them."""
    return getattr(tensor, "gguf_type", None) is not None


def dequantized(blocks: torch.Tensor) -> torch.Tensor:
    """A blocks tensor as its fp32 weight in HF row order (bit for bit the `gguf` package's values)."""
    from kvforge.core.cpu_kernels import GGUF_FLOATS, gguf_dequant, unavailable

    if blocks.gguf_type in GGUF_FLOATS:
        weight = blocks.view(GGUF_FLOATS[blocks.gguf_type]).float()
    elif unavailable() is None:
        weight = gguf_dequant(blocks.gguf_type, blocks, blocks.gguf_in_features)
    else:  # no C compiler: the `gguf` package's numpy dequantizer
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        weight = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType(blocks.gguf_type)))
    return weight if blocks.gguf_rows is None else weight[blocks.gguf_rows]


def row_reader(blocks: torch.Tensor, first: int = 0, count: int | None = None):
    """A lookup of rows [first, first + count) of a blocks tensor by local index, dequantized in fp32 (the `gguf`
    package's values): an embedding table served from the file."""
    from kvforge.core.cpu_kernels import gguf_dequant, unavailable

    qtype, width = blocks.gguf_type, blocks.gguf_in_features
    rows = blocks.narrow(0, first, blocks.shape[0] - first if count is None else count)
    if qtype in FLOAT_DTYPES:
        values = rows.view(FLOAT_DTYPES[qtype])
        return lambda ids: values[ids.reshape(-1)].float()
    if unavailable() is None:
        return lambda ids: gguf_dequant(qtype, rows, width, ids)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(qtype)
    return lambda ids: torch.from_numpy(dequantize(rows[ids.reshape(-1)].numpy(), kind))
