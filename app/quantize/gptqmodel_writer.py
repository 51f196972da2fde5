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
    say(f"{options.method}: {options.bits}-bit, group size {options.group_size}, {len(data)} calibration "
        f"samples of {options.seq_len} tokens{clip}, GPTQModel {gptqmodel.__version__} (its progress bars follow)")
    model = GPTQModel.load(str(source), quantize_config=config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="kvforge-gptqmodel-logs-") as logs, _gptqmodel_logs_in(Path(logs)), \
            _awq_clip_search(options.clip is not False):
        model.quantize(data, backend=backend)
    model.save(str(staging))


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
