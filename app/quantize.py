"""`kvforge quantize`: write a quantized checkpoint (GPTQ, AWQ, bitsandbytes NF4 / int8) of a model that
both kvforge and HF transformers load.

- gptq / awq go through GPTQModel (the maintained successor of auto-gptq and autoawq; the optional extra
  `kvforge[quantize]`), calibrated on a small built-in text set (`calibration.txt`: prose, code, chats)
  or on --calibration-file, packed into --calibration-samples sequences of --seq-len tokens.
- bnb-nf4 / bnb-int8 go through transformers' BitsAndBytesConfig on CPU; the model is saved right after
  loading, before any forward (on AVX512-BF16 CPUs a 4-bit model without double quant that has run a
  forward writes a wrong `absmax`).

Every output directory holds config.json with `quantization_config` as the library writes it, safetensors
weights only, the source's tokenizer and chat template, and its generation_config.json when it has one.
It is written into a temporary sibling directory and renamed into place at the end, so a failed or
interrupted run never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path

METHODS = ("gptq", "awq", "bnb-nf4", "bnb-int8")
GPTQMODEL_METHODS = ("gptq", "awq")
EXTRA_HINT = "pip install 'kvforge[quantize]'"
CALIBRATION_MARK = "%%%"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


class QuantizeError(ValueError):
    """A user error (bad option, occupied --out, missing library); its message is one line."""


@dataclass(frozen=True)
class QuantizeOptions:
    """What `kvforge quantize` does. None means "the method's default" (see `resolved`); an option that
    does not apply to the method is an error when set."""

    method: str
    out: str
    model: str | None = None  # anything kvforge accepts; None: the embedded model
    force: bool = False  # replace a non-empty --out
    # gptq / awq
    bits: int | None = None  # gptq: 4 (default) or 8; awq: 4
    group_size: int | None = None  # default 64 (divides SmolLM2's hidden size 576; 128 does not)
    desc_act: bool | None = None  # gptq: quantize columns in order of decreasing activation (default off)
    sym: bool | None = None  # gptq: symmetric (default); awq: asymmetric with zero points only
    checkpoint_format: str | None = None  # gptq: "gptq" (v1, stored zero = z - 1; default) or "gptq_v2"
    calibration_samples: int | None = None  # sequences (default 64)
    seq_len: int | None = None  # tokens per sequence (default 256)
    calibration_file: str | None = None  # default: the built-in calibration.txt
    # bnb-nf4 / bnb-int8
    double_quant: bool | None = None  # bnb-nf4: quantize the absmax constants too (default off)
    quant_type: str | None = None  # bnb-nf4: "nf4" (default) or "fp4"


DEFAULTS = {
    "gptq": dict(bits=4, group_size=64, desc_act=False, sym=True, checkpoint_format="gptq", calibration_samples=64,
                 seq_len=256),
    "awq": dict(bits=4, group_size=64, sym=False, calibration_samples=64, seq_len=256),
    "bnb-nf4": dict(double_quant=False, quant_type="nf4"),
    "bnb-int8": dict(),
}
CHOICES = {
    "gptq": dict(bits=(4, 8), sym=(True, False), desc_act=(True, False), checkpoint_format=("gptq", "gptq_v2")),
    "awq": dict(bits=(4,), sym=(False,)),
    "bnb-nf4": dict(quant_type=("nf4", "fp4"), double_quant=(True, False)),
    "bnb-int8": dict(),
}
FLAGS = {"bits": "--bits", "group_size": "--group-size", "desc_act": "--desc-act", "sym": "--sym/--no-sym",
         "checkpoint_format": "--checkpoint-format", "calibration_samples": "--calibration-samples",
         "seq_len": "--seq-len", "calibration_file": "--calibration-file", "double_quant": "--double-quant",
         "quant_type": "--quant-type"}


def resolved(options: QuantizeOptions) -> QuantizeOptions:
    """Fill in the method's defaults; refuse options that do not apply to it or values it does not take."""
    method = options.method
    if method not in METHODS:
        raise QuantizeError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    defaults, choices = DEFAULTS[method], CHOICES[method]
    applicable = set(defaults) | ({"calibration_file"} if method in GPTQMODEL_METHODS else set())
    values = {}
    for name, flag in FLAGS.items():
        value = getattr(options, name)
        if value is None:
            values[name] = defaults.get(name)
            continue
        if name not in applicable:
            raise QuantizeError(f"{flag} does not apply to --method {method}")
        if name in choices and value not in choices[name]:
            allowed = ", ".join(_show(c) for c in choices[name])
            raise QuantizeError(f"--method {method} takes {flag} {allowed}, not {_show(value)}")
        values[name] = value
    out = replace(options, **values)
    if out.group_size is not None and out.group_size != -1 and out.group_size <= 0:
        raise QuantizeError(f"--group-size must be positive (or -1: one group per row), not {out.group_size}")
    if method == "awq" and out.group_size == -1:
        raise QuantizeError("--method awq needs a group size (e.g. 64), not -1")
    if out.calibration_samples is not None and out.calibration_samples < 1:
        raise QuantizeError(f"--calibration-samples must be at least 1, not {out.calibration_samples}")
    if out.seq_len is not None and out.seq_len < 16:
        raise QuantizeError(f"--seq-len must be at least 16 tokens, not {out.seq_len}")
    return out


def _show(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


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
    _check_out(out, options.force)
    _check_libraries(options.method)  # a missing extra fails before any model is converted or loaded

    from kvforge.core.loader import resolve_model

    source = resolve_model(options.model).resolve()
    if out.resolve() == source or out.resolve() in source.parents:
        raise QuantizeError(f"--out {out} would replace the source model {source}")
    config = _load_config(source)
    if options.method in GPTQMODEL_METHODS:
        _check_group_size(config, options.group_size, options.bits, options.method)
        if options.seq_len > getattr(config, "max_position_embeddings", options.seq_len):
            raise QuantizeError(f"--seq-len {options.seq_len} exceeds the model's context of "
                                f"{config.max_position_embeddings} tokens")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.quantizing-", dir=out.parent))
    try:
        if options.method in GPTQMODEL_METHODS:
            _quantize_gptqmodel(options, source, staging, say)
        else:
            _quantize_bnb(options, source, staging)
        _finish_checkpoint(source, staging)
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return QuantizeResult(out, size, time.perf_counter() - start, options.method)


# ---------------------------------------------------------------------------------------------- checks


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"--out {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise QuantizeError(f"--out {out} is not empty: pass --force to replace it")
    if any(p.is_dir() for p in out.iterdir()):  # a checkpoint is flat: never delete a tree by mistake
        raise QuantizeError(f"--out {out} holds subdirectories: it does not look like a checkpoint, and "
                            "--force only replaces checkpoint directories; remove it yourself")


def _check_libraries(method: str) -> None:
    """Whether the method's libraries are installed, without importing them (GPTQModel takes seconds and
    prints a banner): a broken install is reported when it is imported."""
    from importlib.util import find_spec

    needs = {"gptqmodel": "GPTQModel"} if method in GPTQMODEL_METHODS else \
        {"bitsandbytes": "bitsandbytes", "accelerate": "accelerate (for transformers' bitsandbytes loader)"}
    for module, name in needs.items():
        if find_spec(module) is None:
            raise QuantizeError(f"--method {method} needs {name}, which is not installed: {EXTRA_HINT}")


def _require(module: str, what: str):
    import importlib

    if module == "gptqmodel":
        _gptqmodel_env()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] == module:
            raise QuantizeError(f"{what}, which is not installed: {EXTRA_HINT}") from None
        raise QuantizeError(f"{what}, which failed to import ({type(exc).__name__}: {exc}); "
                            f"reinstall it: {EXTRA_HINT}") from None


def _gptqmodel_env() -> None:
    """GPTQModel's CPU worker pool defaults to half the cores, which fails on 2 cores: use at least 2."""
    cores = os.cpu_count() or 1
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, min(12, (cores + 1) // 2))))


def _load_config(source: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source)


def quantized_linears(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every linear layer GPTQ / AWQ quantize (all but the LM head),
    read from the model built on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")}


def _check_group_size(config, group_size: int, bits: int, method: str = "gptq") -> None:
    linears = quantized_linears(config)
    pack = 32 // bits  # values per int32 in qweight / qzeros
    sizes = sorted({k for k, _ in linears.values()})
    if group_size == -1:
        bad = [(n, k) for n, (k, v) in linears.items() if k % pack or v % pack]
        if bad:
            raise QuantizeError(f"{bits}-bit packing needs layer sizes divisible by {pack}; {bad[0][0]} is not")
        return
    bad = [(name, k) for name, (k, _) in linears.items() if k % group_size]
    if bad:
        name, k = bad[0]
        fits = [g for g in (16, 32, 64, 128, 256) if all(s % g == 0 for s in sizes)]
        hint = f"group sizes that divide all of them: {', '.join(map(str, fits))}" if fits else \
            "no common group size"
        hidden = getattr(config, "hidden_size", None)
        raise QuantizeError(
            f"--group-size {group_size} does not divide the input size {k} of {name}"
            f"{f' (hidden size {hidden})' if hidden == k else ''} and {len(bad) - 1} other layers; the model's "
            f"layer input sizes are {', '.join(map(str, sizes))}: {hint}"
            f"{' (or -1: one group per row)' if method == 'gptq' else ''}")
    bad = [name for name, (_, n) in linears.items() if n % pack]
    if bad:
        raise QuantizeError(f"{bits}-bit packing needs output sizes divisible by {pack}; {bad[0]} is not")


# ----------------------------------------------------------------------------------------- calibration


def calibration_passages(path: str | Path | None = None) -> list[str | list[dict]]:
    """The calibration set: text passages, and chats as message lists. A file of plain text (no line
    "%%%") is one passage."""
    if path is None:
        from importlib.resources import files

        text = files("kvforge.app").joinpath("calibration.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QuantizeError(f"cannot read --calibration-file {path}: {exc}") from None
    lines = text.splitlines()
    marks = [i for i, line in enumerate(lines) if line.rstrip() in (CALIBRATION_MARK, f"{CALIBRATION_MARK} chat")]
    if not marks:
        return [text] if text.strip() else []
    passages: list[str | list[dict]] = []
    for start, end in zip(marks, marks[1:] + [len(lines)]):
        body = lines[start + 1:end]
        if lines[start].rstrip().endswith("chat"):
            passages.append(_parse_chat(body))
        elif "\n".join(body).strip():
            passages.append("\n".join(body).strip("\n"))
    return [p for p in passages if p]


def _parse_chat(lines: list[str]) -> list[dict]:
    messages: list[dict] = []
    for line in lines:
        role, sep, content = line.partition(":")
        if sep and role in ("system", "user", "assistant"):
            messages.append({"role": role, "content": content.strip()})
        elif messages:
            messages[-1]["content"] += "\n" + line
    for message in messages:
        message["content"] = message["content"].strip()
    return messages


def calibration_samples(tokenizer, passages, samples: int, seq_len: int) -> list[dict[str, list[int]]]:
    """Tokenize the passages (chats through the model's chat template), join them with EOS, cut the
    stream into sequences of `seq_len` tokens and take `samples` of them, evenly spread (all of them
    when there are fewer)."""
    stream: list[int] = []
    for passage in passages:
        if isinstance(passage, list):
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(passage, tokenize=False)
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in passage)
        else:
            text = passage
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    available = len(stream) // seq_len
    if available == 0:
        raise QuantizeError(f"the calibration text holds {len(stream)} tokens, fewer than one --seq-len "
                            f"({seq_len}): give a longer --calibration-file or a smaller --seq-len")
    picks = range(available) if samples >= available else [i * available // samples for i in range(samples)]
    return [{"input_ids": stream[i * seq_len:(i + 1) * seq_len], "attention_mask": [1] * seq_len} for i in picks]


# ------------------------------------------------------------------------------------------ the methods


def _quantize_gptqmodel(options: QuantizeOptions, source: Path, staging: Path, say) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    data = calibration_samples(tokenizer, calibration_passages(options.calibration_file),
                               options.calibration_samples, options.seq_len)
    if len(data) < options.calibration_samples:
        say(f"the calibration text holds only {len(data)} samples of {options.seq_len} tokens: using "
            f"{len(data)} (not {options.calibration_samples})")

    gptqmodel = _require("gptqmodel", f"--method {options.method} needs GPTQModel")
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    if options.method == "gptq":
        config = QuantizeConfig(bits=options.bits, group_size=options.group_size, sym=options.sym,
                                desc_act=options.desc_act, format=options.checkpoint_format)
        backend = BACKEND.AUTO
    else:
        config = QuantizeConfig(bits=options.bits, group_size=options.group_size, quant_method="awq",
                                format="gemm", sym=False)
        backend = BACKEND.AUTO if torch.cuda.is_available() else BACKEND.AWQ_TORCH
    say(f"{options.method}: {options.bits}-bit, group size {options.group_size}, {len(data)} calibration "
        f"samples of {options.seq_len} tokens, GPTQModel {gptqmodel.__version__} (its progress bars follow)")
    model = GPTQModel.load(str(source), quantize_config=config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="kvforge-gptqmodel-logs-") as logs, _gptqmodel_logs_in(Path(logs)):
        model.quantize(data, backend=backend)
    model.save(str(staging))


@contextmanager
def _gptqmodel_logs_in(path: Path):
    """GPTQModel writes a log file per run into ./logs of the working directory: send it elsewhere (the
    checkpoint keeps GPTQModel's per-layer quant_log.csv)."""
    from gptqmodel.looper import loop_processor

    previous = getattr(loop_processor, "_PROJECT_LOG_DIR", None)
    if previous is None:  # another GPTQModel version: leave it alone
        yield
        return
    loop_processor._PROJECT_LOG_DIR = path
    try:
        yield
    finally:
        loop_processor._PROJECT_LOG_DIR = previous


def _quantize_bnb(options: QuantizeOptions, source: Path, staging: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if options.method == "bnb-nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=options.quant_type,
                                    bnb_4bit_use_double_quant=options.double_quant,
                                    bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    # bf16: bitsandbytes' int8 matmul warns at every call on fp32 inputs
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16)
    model.save_pretrained(staging)  # before any forward: see the module docstring


# --------------------------------------------------------------------------------------------- output


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
    if out.exists():  # checked by _check_out: empty, or --force on a flat directory
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ CLI


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C does: the staging directory is removed


def cmd_quantize(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvforge.app.cache import human_bytes

    names = {f.name for f in fields(QuantizeOptions)}
    options = QuantizeOptions(**{k: v for k, v in vars(args).items() if k in names})
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        result = quantize(options)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"kvforge: wrote {result.method} checkpoint {result.out} ({human_bytes(result.bytes_on_disk)} on disk) "
          f"in {result.seconds:.0f} s", flush=True)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `quantize` on the top-level `kvforge` subcommands."""
    p = sub.add_parser(
        "quantize", help="write a GPTQ / AWQ / bitsandbytes checkpoint that kvforge and HF transformers load",
        description="Quantize a model into a checkpoint directory (config.json with quantization_config, "
        f"safetensors, tokenizer). gptq and awq need GPTQModel: {EXTRA_HINT}. Options that do not apply "
        "to the chosen method are refused.")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model", default=None,
                   help="HF model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    g = p.add_argument_group("gptq / awq")
    g.add_argument("--bits", type=int, default=None, help="gptq: 4 (default) or 8; awq: 4")
    g.add_argument("--group-size", type=int, default=None,
                   help="weights per scale; must divide every layer's input size (default: 64; -1: per row, gptq)")
    g.add_argument("--desc-act", action="store_true", default=None,
                   help="gptq: quantize columns by decreasing activation (act-order)")
    g.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: symmetric (default) or with zero points; awq is always --no-sym")
    g.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default=None,
                   help="gptq: 'gptq' (v1, what most loaders read; default) or 'gptq_v2'")
    g.add_argument("--calibration-samples", type=int, default=None, help="calibration sequences (default: 64)")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per calibration sequence (default: 256)")
    g.add_argument("--calibration-file", default=None,
                   help="UTF-8 text to calibrate on instead of the built-in set (passages after lines '%%%%%%')")
    b = p.add_argument_group("bnb-nf4 / bnb-int8")
    b.add_argument("--double-quant", action="store_true", default=None,
                   help="bnb-nf4: also quantize the per-block absmax constants")
    b.add_argument("--quant-type", choices=("nf4", "fp4"), default=None, help="bnb-nf4: 4-bit data type (nf4)")
    p.set_defaults(func=cmd_quantize)
    return p
