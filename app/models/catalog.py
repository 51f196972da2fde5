"""What the models directory holds: the list the UI's model picker and the admin API offer, and `kvforge models`
prints with each entry's format, architecture, quantization, size on disk and the memory it would take.

An entry is the embedded default, a `.gguf` file (a vision model's projector, `mmproj-*.gguf`, is counted with the
model it pairs with: core/gguf_mmproj.py), or a checkpoint directory (config.json + safetensors) directly inside the
models directory. Memory is an estimate before loading: for a checkpoint directory the engine's own
estimator (core/estimate.py); for a GGUF file, its tensors as the gguf plugin will hold them (block types at their
size in the file, read in place, a tied LM head sharing the embedding's blocks; float tensors in the dtype) plus the KV
cache of `context` tokens. An entry that cannot be read is listed with the reason.

The directory is untrusted input (anything can be dropped or pulled into it): an entry is listed only if it is
really inside the directory once symlinks are resolved (a link to /etc/passwd is not), is a regular `.gguf` file or
a directory with a regular config.json (no FIFO, device or socket: their open would block), and its name does not
start with a dot (a pull's staging directory). Files are read through core/model_files.py's bounded readers (a
hand-written GGUF header pass; its docstring says why), cached per file version, errors included. The server's
routes list with a deadline (`LISTING_DEADLINE_S`): an entry still being read by then is answered as an error
("not read within ...") and listed normally once its read ends, so a route never waits on a file.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import stat
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from kvforge.core.config import DTYPES, KV_CACHE_DTYPES, kv_bytes_per_token, resolve_dtype
from kvforge.core.gguf_mmproj import projector_for
from kvforge.core.gguf_moe import STACKED as STACKED_EXPERTS
from kvforge.core.loader import EMBEDDED_MODEL, ModelNotFoundError, embedded_gguf_path
from kvforge.core.model_files import GGUFHeader, check_checkpoint_dir, read_gguf_header

LISTING_DEADLINE_S = 5.0  # the longest a route waits for the models directory's entries to be read
READER_THREADS = 2  # entries read at once for the routes


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
    experts_bytes: int | None = None  # a mixture-of-experts model's routed experts, part of the weights (--cpu-experts)
    # under pipeline parallelism (pp > 1): each stage's layers [first, last) and bytes (weights, kv, total, experts)
    stages: list[dict] | None = None
    modified_ns: int | None = None  # the file's (a checkpoint's config.json's) modification time
    error: str | None = None


def listed(models_dir: Path, path: Path) -> bool:
    """Whether `path` (a child of the resolved `models_dir`) is an entry: see the module's docstring. Decided from
    stats alone: nothing is opened."""
    if path.name.startswith("."):
        return False
    real = Path(os.path.realpath(path))
    if real == models_dir or not real.is_relative_to(models_dir):
        return False
    try:
        mode = os.stat(real).st_mode
        if stat.S_ISREG(mode):  # a model's vision projector (mmproj-*.gguf) is served with it, not listed
            return path.suffix == ".gguf" and not path.name.startswith("mmproj")
        config = Path(os.path.realpath(real / "config.json"))
        return stat.S_ISDIR(mode) and config.is_relative_to(models_dir) and stat.S_ISREG(os.stat(config).st_mode)
    except OSError:  # gone meanwhile, a dangling link, no permission
        return False


def model_names(models_dir: Path | None) -> list[str]:
    """The embedded default, then the models directory's GGUF files and checkpoint directories, by name."""
    names = [EMBEDDED_MODEL]
    if models_dir is not None and models_dir.is_dir():
        root = models_dir.resolve()
        names += sorted(p.name for p in root.iterdir() if listed(root, p))
    return names


def catalog(models_dir: Path | None, context: int, dtype: str = "auto", names: Collection[str] | None = None,
            deadline_s: float | None = None, kv_cache_dtype: str = "auto", pp: int = 1) -> list[ModelEntry]:
    """Every entry described (or those of `names`; `pp` > 1: with each pipeline stage's share). With `deadline_s`,
    the entries are read on the catalog's reader threads and one not read by then is returned with an error saying
    so (its read goes on and is cached)."""
    paths: dict[str, Path | ModelEntry] = {}
    for name in model_names(models_dir):
        if names is not None and name not in names:
            continue
        try:
            paths[name] = embedded_gguf_path() if name == EMBEDDED_MODEL else models_dir.resolve() / name
        except ModelNotFoundError as exc:
            paths[name] = ModelEntry(name, None, error=str(exc))
    if deadline_s is None:
        return [p if isinstance(p, ModelEntry) else describe(n, p, context, dtype, kv_cache_dtype, pp)
                for n, p in paths.items()]
    reads = {n: _describing(n, p, context, dtype, kv_cache_dtype, pp) for n, p in paths.items()
             if not isinstance(p, ModelEntry)}
    wait(reads.values(), timeout=deadline_s)
    entries = []
    for name, path in paths.items():
        if isinstance(path, ModelEntry):
            entries.append(path)
        elif reads[name].done():
            entries.append(reads[name].result())
        else:
            entries.append(ModelEntry(name, str(path), error=f"not read within {deadline_s:g} s (still being read)"))
    return entries


_READS: dict[tuple, Future] = {}  # entries being read for a route: a second listing waits for the same read
_READS_LOCK = threading.Lock()
_WORK: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_WORKERS: list[threading.Thread] = []


def _describing(name: str, path: Path, context: int, dtype: str, kv_cache_dtype: str, pp: int = 1) -> Future:
    key = (name, str(path), context, dtype, kv_cache_dtype, pp)
    with _READS_LOCK:
        if key in _READS:
            return _READS[key]
        future = _READS[key] = Future()
        while len(_WORKERS) < READER_THREADS:  # daemon threads: a read stuck on slow storage never holds the exit
            worker = threading.Thread(target=_work, name="kvforge-model-files", daemon=True)
            worker.start()
            _WORKERS.append(worker)

    def run() -> None:
        try:
            future.set_result(describe(name, path, context, dtype, kv_cache_dtype, pp))
        finally:
            with _READS_LOCK:
                _READS.pop(key, None)

    _WORK.put(run)
    return future


def _work() -> None:
    while True:
        _WORK.get()()


def describe(name: str, path: Path, context: int, dtype: str = "auto", kv_cache_dtype: str = "auto",
             pp: int = 1) -> ModelEntry:
    entry = ModelEntry(name, str(path))
    try:
        if path.suffix == ".gguf":
            _describe_gguf(entry, path, context, resolve_dtype(dtype), kv_cache_dtype, pp)
        else:
            _describe_checkpoint(entry, path, context, resolve_dtype(dtype), kv_cache_dtype, pp)
    except Exception as exc:  # a broken entry is listed with why, the others still are
        entry.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    return entry


def _describe_checkpoint(entry: ModelEntry, path: Path, context: int, dtype: str, kv_cache_dtype: str,
                         pp: int = 1) -> None:
    from kvforge.core.estimate import estimate_memory
    from kvforge.core.loader import load_config
    from kvforge.core.plugins import QUANT_GROUP, checkpoint_quantization, discover, resolve_quant
    from kvforge.core.quant_config import QuantConfig

    entry.format = "safetensors"
    check_checkpoint_dir(path)  # regular files, config and safetensors headers within their limits
    entry.modified_ns = (path / "config.json").stat().st_mtime_ns
    entry.size_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    config = load_config(path)
    entry.architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
    quantization = checkpoint_quantization(config, path)
    quant, options = resolve_quant("none", {}, config, path)
    entry.quantization = "none" if quantization is None else (
        f"{quant} {options['bits']}-bit" if "bits" in options else quant)
    quant_config = QuantConfig.for_checkpoint(discover(QUANT_GROUP).get(quant), options, quantization)
    estimate = estimate_memory(config, dtype, context, quant_config, kv_cache_dtype=kv_cache_dtype, pp_size=pp)
    entry.parameters, entry.weights_bytes = estimate["parameters"], estimate["weights_bytes"]
    entry.memory_bytes, entry.experts_bytes = estimate["total_bytes"], estimate.get("experts_bytes")
    entry.stages = estimate.get("stages")


@dataclass(frozen=True)
class GGUFFacts:
    """What an estimate reads from a GGUF file's header."""
    architecture: str | None
    quantization: str | None
    fields: dict[str, int]  # the shape: block_count, head_count(_kv), key_length, embedding_length, the MLP's
    tensors: tuple[tuple[str, int, int, int], ...]  # (name, GGML type, elements, dimensions)


def gguf_facts(path: Path) -> GGUFFacts:
    """A GGUF's header facts, read once per file version (core/model_files.py caches the header, errors included:
    the UI's settings panel asks for an estimate on each change, five times as a page loads)."""
    return _facts(read_gguf_header(path))


_SHAPE_FIELDS = ("block_count", "attention.head_count_kv", "attention.head_count", "attention.key_length",
                 "embedding_length", "feed_forward_length", "expert_feed_forward_length", "expert_used_count")


@lru_cache(maxsize=256)
def _facts(header: GGUFHeader) -> GGUFFacts:
    arch = header.metadata.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    fields = {}
    for name in _SHAPE_FIELDS:
        value = header.metadata.get(f"{arch}.{name}")
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32:  # a shape, not a claim
            fields[name] = value
    tensors = tuple((t.name, t.ggml_type, t.n_elements, len(t.shape)) for t in header.tensors)
    file_type = header.metadata.get("general.file_type")
    return GGUFFacts(arch, quantization_name(file_type if isinstance(file_type, int) else None), fields, tensors)


def _describe_gguf(entry: ModelEntry, path: Path, context: int, dtype: str, kv_cache_dtype: str, pp: int = 1) -> None:
    from kvforge.plugins.quant.gguf import held_bytes_per_weight

    entry.format = "gguf"
    facts = gguf_facts(path)
    info = path.stat()
    entry.size_bytes, entry.modified_ns = info.st_size, info.st_mtime_ns
    entry.architecture, entry.quantization = facts.architecture, facts.quantization
    element = DTYPES[dtype].itemsize
    weights, parameters, experts = 0.0, 0, 0.0
    by_tensor = {}
    for name, tensor_type, count, _ in facts.tensors:  # block types served from the file itself (a tied head shares
        parameters += count                             # the embedding's blocks), the rest dense in the dtype
        held = held_bytes_per_weight(tensor_type, DTYPES[dtype])
        by_tensor[name] = count * (held[0] if held else element)
        weights += by_tensor[name]
        if STACKED_EXPERTS.fullmatch(name):
            experts += by_tensor[name]
    f = facts.fields
    head_dim = f.get("attention.key_length") or f["embedding_length"] // f["attention.head_count"]
    kv = context * kv_bytes_per_token(f["block_count"], f["attention.head_count_kv"], head_dim, DTYPES[dtype],
                                      kv_cache_dtype)
    projector = projector_for(path)  # a vision model's tower and connector, served dense in the dtype
    if projector is not None:
        counts = [count for _, _, count, _ in gguf_facts(projector).tensors]
        parameters, weights = parameters + sum(counts), weights + sum(counts) * element
    entry.parameters, entry.weights_bytes, entry.memory_bytes = parameters, int(weights), int(weights) + int(kv)
    entry.experts_bytes = int(experts) if experts else None
    if pp > 1:
        entry.stages = _gguf_stages(facts, by_tensor, kv, pp)


def _gguf_stages(facts: GGUFFacts, by_tensor: dict[str, float], kv: float, pp: int) -> list[dict]:
    """Each pipeline stage's share of a GGUF's weights and KV: its layers' tensors (`blk.<i>.`), the first stage's
    embedding and LM head, the last one's final norm; split as the engine splits the file's config
    (core/distributed.py: the head counted in decoder layers' work, here from the same header fields)."""
    from types import SimpleNamespace

    from kvforge.core.distributed import head_weight_in_layers, stage_bounds

    f = facts.fields
    hidden, layers = f["embedding_length"], f["block_count"]
    embedding = next(count for name, _, count, _ in facts.tensors if name == "token_embd.weight")
    config = SimpleNamespace(
        hidden_size=hidden, num_attention_heads=f["attention.head_count"],
        num_key_value_heads=f.get("attention.head_count_kv"), head_dim=f.get("attention.key_length"),
        num_experts_per_tok=f.get("expert_used_count"), intermediate_size=f.get("feed_forward_length"),
        moe_intermediate_size=f.get("expert_feed_forward_length"), vocab_size=embedding // hidden)
    ends = stage_bounds(layers, head_weight_in_layers(config), pp)
    stages = [{"layers": [first, last], "weights_bytes": 0.0, "experts_bytes": 0.0} for first, last in
              zip(ends, ends[1:])]
    for name, size in by_tensor.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        stage = stages[-1] if name.startswith("output_norm") else stages[0] if layer is None else \
            next(s for s in stages if s["layers"][0] <= layer < s["layers"][1])
        stage["weights_bytes"] += size
        if STACKED_EXPERTS.fullmatch(name):
            stage["experts_bytes"] += size
    for stage in stages:
        first, last = stage["layers"]
        stage["weights_bytes"], stage["kv_bytes"] = int(stage["weights_bytes"]), int(kv * (last - first) / layers)
        stage["total_bytes"] = stage["weights_bytes"] + stage["kv_bytes"]
        stage["experts_bytes"] = int(stage["experts_bytes"]) if stage["experts_bytes"] else None
    return stages


def quantization_name(file_type: int | None) -> str | None:
    """llama.cpp's name of a GGUF's `general.file_type` (Q4_1, Q4_K_M); None where the file does not say."""
    from gguf import LlamaFileType

    if file_type is None:
        return None
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {file_type}"


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
    entries = catalog(models_dir, args.context, args.dtype, kv_cache_dtype=args.kv_cache_dtype, pp=args.pp)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
        return 0
    dtype = resolve_dtype(args.dtype)
    print(f"models directory: {models_dir or '(none: --models-dir or KVFORGE_MODELS_DIR)'}; memory: weights in "
          f"{dtype} + KV for {args.context} tokens ({args.kv_cache_dtype}); experts: of the weights, a "
          "mixture-of-experts model's routed experts (host memory under --cpu-experts)")
    header = f"{'name':<40} {'format':<11} {'architecture':<20} {'quantization':<13} {'on disk':>10} {'params':>8} " \
             f"{'memory':>10} {'experts':>10}"
    print(header)
    print("-" * len(header))
    for e in entries:
        if e.error:
            print(f"{e.name:<40} error: {e.error}")
            continue
        params = f"{e.parameters / 1e6:.0f}M" if e.parameters else "-"
        print(f"{e.name:<40} {e.format or '-':<11} {e.architecture or '-':<20} {e.quantization or '-':<13} "
              f"{_size(e.size_bytes):>10} {params:>8} {_size(e.memory_bytes):>10} {_size(e.experts_bytes):>10}")
        for number, stage in enumerate(e.stages or []):
            first, last = stage["layers"]
            label = f"  stage {number}: layers {first}-{last - 1}" + (", embed + head" if number == 0 else "")
            print(f"{label:<40} {'':<11} {'':<20} {'':<13} {'':>10} {'':>8} {_size(stage['total_bytes']):>10} "
                  f"{_size(stage.get('experts_bytes')):>10}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("models", help="what the models directory holds: format, architecture, quantization, "
                            "size, estimated memory", description="The models `kvforge serve --models-dir` offers "
                            "(the UI's model picker lists the same), with the memory each would take.")
    parser.add_argument("--models-dir", default=None, help="the directory (default: $KVFORGE_MODELS_DIR)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of KV cache in the estimate (4096)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES) + ["auto"],
                        help="the compute dtype of the estimate (auto: as the server picks it)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="how the KV cache is stored in the estimate (as serve's --kv-cache-dtype; default auto)")
    parser.add_argument("--pp", type=int, default=1, metavar="N",
                        help="pipeline stages: each stage's layers and memory under its model (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    parser.set_defaults(func=cmd_models)
