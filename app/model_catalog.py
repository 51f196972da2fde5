"""What the models directory holds: the list the UI's model picker and the admin API offer, and `kvforge models`
prints with each entry's format, architecture, quantization, size on disk and the memory it would take.

An entry is the embedded default, a `.gguf` file, or a checkpoint directory (config.json + safetensors) directly
inside the models directory. Memory is an estimate before loading: for a checkpoint directory the engine's own
estimator (core/estimate.py); for a GGUF file, its tensors as the gguf plugin will hold them (4-bit types packed
for torch's int4 kernel, the others dequantized into the dtype, a tied LM head's own copy) plus the KV cache of
`context` tokens. An entry that cannot be read is listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from kvforge.core.config import DTYPES, kv_bytes_per_token, resolve_dtype
from kvforge.core.loader import EMBEDDED_MODEL, ModelNotFoundError, embedded_gguf_path


@dataclass
class ModelEntry:
    name: str  # what the admin API's load and the UI's picker take
    path: str | None
    format: str | None = None  # gguf | safetensors
    architecture: str | None = None
    quantization: str | None = None  # a GGUF's file type (Q4_K_M), a checkpoint's method, or "none"
    size_bytes: int | None = None
    parameters: int | None = None
    weights_bytes: int | None = None  # the weights as kvforge holds them
    memory_bytes: int | None = None  # those + the KV cache of `context` tokens
    error: str | None = None


def model_names(models_dir: Path | None) -> list[str]:
    """The embedded default, then the models directory's GGUF files and checkpoint directories, by name."""
    names = [EMBEDDED_MODEL]
    if models_dir is not None and models_dir.is_dir():
        names += sorted(p.name for p in models_dir.iterdir()
                        if (p.is_dir() and (p / "config.json").exists()) or p.suffix == ".gguf")
    return names


def catalog(models_dir: Path | None, context: int, dtype: str = "auto") -> list[ModelEntry]:
    entries = []
    for name in model_names(models_dir):
        try:
            path = embedded_gguf_path() if name == EMBEDDED_MODEL else models_dir / name
        except ModelNotFoundError as exc:
            entries.append(ModelEntry(name, None, error=str(exc)))
            continue
        entries.append(describe(name, path, context, dtype))
    return entries


def describe(name: str, path: Path, context: int, dtype: str = "auto") -> ModelEntry:
    entry = ModelEntry(name, str(path))
    try:
        if path.suffix == ".gguf":
            _describe_gguf(entry, path, context, resolve_dtype(dtype))
        else:
            _describe_checkpoint(entry, path, context, resolve_dtype(dtype))
    except Exception as exc:  # a broken entry is listed with why, the others still are
        entry.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    return entry


def _describe_checkpoint(entry: ModelEntry, path: Path, context: int, dtype: str) -> None:
    from kvforge.core.estimate import estimate_memory
    from kvforge.core.loader import load_config
    from kvforge.core.plugins import QUANT_GROUP, checkpoint_quantization, discover, resolve_quant
    from kvforge.core.quant_config import QuantConfig

    entry.format = "safetensors"
    entry.size_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    config = load_config(path)
    entry.architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
    quantization = checkpoint_quantization(config, path)
    quant, options = resolve_quant("none", {}, config, path)
    entry.quantization = "none" if quantization is None else (
        f"{quant} {options['bits']}-bit" if "bits" in options else quant)
    quant_config = QuantConfig.for_checkpoint(discover(QUANT_GROUP).get(quant), options, quantization)
    estimate = estimate_memory(config, dtype, context, quant_config)
    entry.parameters, entry.weights_bytes = estimate["parameters"], estimate["weights_bytes"]
    entry.memory_bytes = estimate["total_bytes"]


@dataclass(frozen=True)
class GGUFFacts:
    """What an estimate reads from a GGUF file's header."""
    architecture: str | None
    quantization: str | None
    fields: dict[str, int]  # the attention shape: block_count, head_count(_kv), key_length, embedding_length
    tensors: tuple[tuple[str, int, int, int], ...]  # (name, GGML type, elements, dimensions)


_GGUF_FACTS: dict[tuple[str, int, int], GGUFFacts] = {}
_GGUF_FACTS_LOCK = threading.Lock()


def gguf_facts(path: Path) -> GGUFFacts:
    """A GGUF's header facts, parsed once per file version: GGUFReader builds a view of every vocabulary string
    (~3.5 s for SmolLM2's 49k tokens on 2 cores, holding the GIL), and the UI's settings panel asks for an
    estimate on each change, five times as a page loads. One parse at a time: concurrent askers wait for it."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _GGUF_FACTS_LOCK:
        if key not in _GGUF_FACTS:
            _GGUF_FACTS[key] = _read_gguf_facts(path)
        return _GGUF_FACTS[key]


def _read_gguf_facts(path: Path) -> GGUFFacts:
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(path))

    def field(key: str):
        return next(iter(read_field(reader, key)), None)

    arch = field("general.architecture")
    names = ("block_count", "attention.head_count_kv", "attention.head_count", "attention.key_length",
             "embedding_length")
    fields = {name: value for name in names if (value := field(f"{arch}.{name}")) is not None}
    tensors = tuple((t.name, t.tensor_type, int(t.n_elements), len(t.shape)) for t in reader.tensors)
    return GGUFFacts(arch, gguf_quantization(reader), fields, tensors)


def _describe_gguf(entry: ModelEntry, path: Path, context: int, dtype: str) -> None:
    from kvforge.plugins.quant.gguf import held_bytes_per_weight

    entry.format = "gguf"
    entry.size_bytes = path.stat().st_size
    facts = gguf_facts(path)
    entry.architecture, entry.quantization = facts.architecture, facts.quantization
    element = DTYPES[dtype].itemsize
    weights, parameters, names = 0.0, 0, set()
    for name, tensor_type, count, dims in facts.tensors:  # projections (and a separate head) as the gguf plugin
        parameters += count                                 # holds them; the rest dense
        names.add(name)
        held = None if dims != 2 or name.startswith("token_embd") else \
            held_bytes_per_weight(tensor_type, DTYPES[dtype])
        weights += count * (held[0] if held else element)
    embed = next((t for t in facts.tensors if t[0] == "token_embd.weight"), None)
    if "output.weight" not in names and embed is not None:  # a tied head, from the embedding's blocks
        held = held_bytes_per_weight(embed[1], DTYPES[dtype])
        weights += embed[2] * (held[0] if held else element)
        if held and held[1] == "int8":  # the embedding reads its rows from the head's codes: no dense copy
            weights -= embed[2] * element
    f = facts.fields
    head_dim = f.get("attention.key_length") or f["embedding_length"] // f["attention.head_count"]
    kv = context * kv_bytes_per_token(f["block_count"], f["attention.head_count_kv"], head_dim, DTYPES[dtype])
    entry.parameters, entry.weights_bytes, entry.memory_bytes = parameters, int(weights), int(weights) + int(kv)


def gguf_quantization(reader) -> str | None:
    """A GGUF's file type as llama.cpp names it (Q4_1, Q4_K_M), from an open GGUFReader; None where the file does
    not say."""
    from gguf import LlamaFileType
    from transformers.modeling_gguf_pytorch_utils import read_field

    file_type = next(iter(read_field(reader, "general.file_type")), None)
    return LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def cmd_models(args: argparse.Namespace) -> int:
    directory = args.models_dir or os.environ.get("KVFORGE_MODELS_DIR")
    models_dir = Path(directory).expanduser().resolve() if directory else None
    if models_dir is not None and not models_dir.is_dir():
        raise ValueError(f"--models-dir {models_dir} is not a directory")
    entries = catalog(models_dir, args.context, args.dtype)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
        return 0
    dtype = resolve_dtype(args.dtype)
    print(f"models directory: {models_dir or '(none: --models-dir or KVFORGE_MODELS_DIR)'}; memory: weights in "
          f"{dtype} + KV for {args.context} tokens")
    header = f"{'name':<40} {'format':<11} {'architecture':<20} {'quantization':<13} {'on disk':>10} {'params':>8} " \
             f"{'memory':>10}"
    print(header)
    print("-" * len(header))
    for e in entries:
        if e.error:
            print(f"{e.name:<40} error: {e.error}")
            continue
        params = f"{e.parameters / 1e6:.0f}M" if e.parameters else "-"
        print(f"{e.name:<40} {e.format or '-':<11} {e.architecture or '-':<20} {e.quantization or '-':<13} "
              f"{_size(e.size_bytes):>10} {params:>8} {_size(e.memory_bytes):>10}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("models", help="what the models directory holds: format, architecture, quantization, "
                            "size, estimated memory", description="The models `kvforge serve --models-dir` offers "
                            "(the UI's model picker lists the same), with the memory each would take.")
    parser.add_argument("--models-dir", default=None, help="the directory (default: $KVFORGE_MODELS_DIR)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of KV cache in the estimate (4096)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES) + ["auto"],
                        help="the compute dtype of the estimate (auto: as the server picks it)")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    parser.set_defaults(func=cmd_models)
