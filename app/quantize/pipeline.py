"""One `kvforge quantize` run: checks, the method's writer into a temporary sibling directory, the
source's tokenizer and generation config, a check of the result, and the rename into place (a failed or
interrupted run never leaves a half-written checkpoint behind)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvforge.app.quantize.bnb_writer import write_bnb
from kvforge.app.quantize.checks import check_group_size, check_libraries, check_out, load_hf_config
from kvforge.app.quantize.gptqmodel_writer import write_gptqmodel
from kvforge.app.quantize.options import GPTQMODEL_METHODS, QuantizeError, QuantizeOptions, resolved

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    bytes_on_disk: int
    seconds: float
    method: str


def quantize(options: QuantizeOptions, say=None) -> QuantizeResult:
    """Quantize `options.model` with `options.method` into `options.out` (see the module docstring)."""
    say = say or (lambda text: print(f"kvforge: {text}", file=sys.stderr, flush=True))
    start = time.perf_counter()
    options = resolved(options)
    out = Path(options.out).expanduser().absolute()
    check_out(out, options.force)
    check_libraries(options.method)  # a missing extra fails before any model is converted or loaded

    from kvforge.core.loader import resolve_model

    source = resolve_model(options.model).resolve()
    if out.resolve() == source or out.resolve() in source.parents:
        raise QuantizeError(f"--out {out} would replace the source model {source}")
    config = load_hf_config(source)
    if options.method in GPTQMODEL_METHODS:
        check_group_size(config, options.group_size, options.bits, options.method)
        if options.seq_len > getattr(config, "max_position_embeddings", options.seq_len):
            raise QuantizeError(f"--seq-len {options.seq_len} exceeds the model's context of "
                                f"{config.max_position_embeddings} tokens")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.quantizing-", dir=out.parent))
    try:
        if options.method in GPTQMODEL_METHODS:
            write_gptqmodel(options, source, staging, say)
        else:
            write_bnb(options, source, staging)
        _finish_checkpoint(source, staging)
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return QuantizeResult(out, size, time.perf_counter() - start, options.method)


def _finish_checkpoint(source: Path, staging: Path) -> None:
    """The source's tokenizer files and generation config (GPTQModel rewrites both: it sets do_sample),
    then a check of what a checkpoint must hold."""
    import json

    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:
        (staging / name).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(staging)
    (staging / "generation_config.json").unlink(missing_ok=True)
    if (source / "generation_config.json").exists():
        shutil.copy2(source / "generation_config.json", staging / "generation_config.json")

    pickled = [p.name for p in staging.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickled:
        raise RuntimeError(f"the quantizer wrote pickled files {pickled}; refusing to keep them")
    if not any(staging.glob("*.safetensors")):
        raise RuntimeError("the quantizer wrote no .safetensors weights")
    config = json.loads((staging / "config.json").read_text())
    if "quantization_config" not in config:
        raise RuntimeError("the quantizer wrote a config.json without quantization_config")


def _replace_dir(staging: Path, out: Path) -> None:
    old = None
    if out.exists():  # checked by check_out: empty, or --force on a flat directory
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
