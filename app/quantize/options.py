"""What `kvforge quantize` does: the options of each method, their defaults and the values they take."""

from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("gptq", "awq", "bnb-nf4", "bnb-int8")
GPTQMODEL_METHODS = ("gptq", "awq")
EXTRA_HINT = "pip install 'kvforge[quantize]'"


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
    clip: bool | None = None  # awq: search a clipping range per weight group (AutoAWQ's apply_clip; default on)
    calibration_samples: int | None = None  # sequences (default 64)
    seq_len: int | None = None  # tokens per sequence (default 256)
    calibration_file: str | None = None  # default: the built-in calibration.txt
    # bnb-nf4 / bnb-int8
    double_quant: bool | None = None  # bnb-nf4: quantize the absmax constants too (default off)
    quant_type: str | None = None  # bnb-nf4: "nf4" (default) or "fp4"


DEFAULTS = {
    "gptq": dict(bits=4, group_size=64, desc_act=False, sym=True, checkpoint_format="gptq", calibration_samples=64,
                 seq_len=256),
    "awq": dict(bits=4, group_size=64, sym=False, clip=True, calibration_samples=64, seq_len=256),
    "bnb-nf4": dict(double_quant=False, quant_type="nf4"),
    "bnb-int8": dict(),
}
CHOICES = {
    "gptq": dict(bits=(4, 8), sym=(True, False), desc_act=(True, False), checkpoint_format=("gptq", "gptq_v2")),
    "awq": dict(bits=(4,), sym=(False,), clip=(True, False)),
    "bnb-nf4": dict(quant_type=("nf4", "fp4"), double_quant=(True, False)),
    "bnb-int8": dict(),
}
FLAGS = {"bits": "--bits", "group_size": "--group-size", "desc_act": "--desc-act", "sym": "--sym/--no-sym",
         "checkpoint_format": "--checkpoint-format", "clip": "--clip/--no-clip",
         "calibration_samples": "--calibration-samples", "seq_len": "--seq-len",
         "calibration_file": "--calibration-file", "double_quant": "--double-quant", "quant_type": "--quant-type"}


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
