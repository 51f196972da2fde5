"""gptq / awq checkpoints through GPTQModel (the maintained successor of auto-gptq and autoawq; the
optional extra `kvforge[quantize]`), calibrated on calibration.py's samples."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

from kvforge.app.quantize.calibration import calibration_passages, calibration_samples
from kvforge.app.quantize.checks import require_library
from kvforge.app.quantize.options import QuantizeOptions


def write_gptqmodel(options: QuantizeOptions, source: Path, staging: Path, say) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    data = calibration_samples(tokenizer, calibration_passages(options.calibration_file),
                               options.calibration_samples, options.seq_len)
    if len(data) < options.calibration_samples:
        say(f"the calibration text holds only {len(data)} samples of {options.seq_len} tokens: using "
            f"{len(data)} (not {options.calibration_samples})")

    gptqmodel = require_library("gptqmodel", f"--method {options.method} needs GPTQModel")
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    if options.method == "gptq":
        config = QuantizeConfig(bits=options.bits, group_size=options.group_size, sym=options.sym,
                                desc_act=options.desc_act, format=options.checkpoint_format)
        backend = BACKEND.AUTO
    else:
        config = QuantizeConfig(bits=options.bits, group_size=options.group_size, quant_method="awq",
                                format="gemm", sym=False)
        backend = BACKEND.AUTO if torch.cuda.is_available() else BACKEND.AWQ_TORCH
    clip = "" if options.clip in (None, True) else ", no clip search"
    compute = calibration_dtype(options.method)
    if options.method == "awq" and _device_dtype() == torch.float32:
        say("note: this CPU has no native bf16 (AVX2 only) and GPTQModel's AWQ calibrates in bf16 only: the build "
            "is slow here (over an hour for a 135M model); gptq calibrates in fp32 on such a CPU")
    say(f"{options.method}: {options.bits}-bit, group size {options.group_size}, {len(data)} calibration "
        f"samples of {options.seq_len} tokens{clip}, computed in {str(compute).removeprefix('torch.')}, "
        f"GPTQModel {gptqmodel.__version__} (its progress bars follow)")
    model = GPTQModel.load(str(source), quantize_config=config, dtype=compute)
    with tempfile.TemporaryDirectory(prefix="kvforge-gptqmodel-logs-") as logs, _gptqmodel_logs_in(Path(logs)), \
            _awq_clip_search(options.clip is not False):
        model.quantize(data, backend=backend)
    model.save(str(staging))
    if compute == torch.float32:
        _store_float32_as_bfloat16(staging)


def calibration_dtype(method: str):
    """What GPTQModel computes in: bfloat16 where the device computes it natively (core/config.py's "auto"). On
    other CPUs (AVX2 only) bf16 is emulated, ~8x slower than fp32 in a matmul, so gptq calibrates in float32
    there (docs/MEASUREMENTS.md). awq stays bf16: GPTQModel's CPU AWQ layer takes 16-bit weights only (forced to
    float32 it wrote a checkpoint that answers gibberish), so an AWQ build there is slow (over an hour for the
    embedded model): the CLI says so before it starts."""
    import torch

    return torch.float32 if _device_dtype() == torch.float32 and method == "gptq" else torch.bfloat16


def _device_dtype():
    """core/config.py's "auto" dtype on this machine: bf16 where computed natively, else fp32 (fp16 on old GPUs)."""
    import torch

    from kvforge.core.config import DTYPES, resolve_dtype

    return DTYPES[resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")]


def _store_float32_as_bfloat16(checkpoint: Path) -> None:
    """A checkpoint calibrated in float32 stored as a bf16 calibration stores it: its float32 tensors (the weights
    left unquantized: embeddings, norms) in bf16, the quantized layers' scales as they are (GPTQ's fp16),
    config.json's dtype bfloat16."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        tensors = {name: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for name, t in tensors.items()}
        save_file(tensors, str(path), metadata=metadata)
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


@contextmanager
def _awq_clip_search(enabled: bool):
    """AWQ's search of a clipping range per weight group (AutoAWQ's `apply_clip`), on unless `enabled` is False
    (on CPU it is most of the build: docs/MEASUREMENTS.md). GPTQModel keeps its switch on the AWQ processor it
    builds, not in QuantizeConfig, so it is turned off on each processor built meanwhile."""
    if enabled:
        yield
        return
    from gptqmodel.looper.awq_processor import AWQProcessor

    original = AWQProcessor.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not hasattr(self, "apply_clip"):  # another GPTQModel version: refuse rather than clip anyway
            raise RuntimeError("--no-clip: this GPTQModel version's AWQ processor has no apply_clip switch")
        self.apply_clip = False

    AWQProcessor.__init__ = init
    try:
        yield
    finally:
        AWQProcessor.__init__ = original


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
