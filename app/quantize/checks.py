"""Checks that run before anything is converted or loaded: the output directory, the libraries a
method needs, and whether the model's layer sizes fit the group size and packing."""

from __future__ import annotations

import os
from pathlib import Path

from kvforge.app.quantize.options import EXTRA_HINT, GPTQMODEL_METHODS, QuantizeError


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"--out {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise QuantizeError(f"--out {out} is not empty: pass --force to replace it")
    if any(p.is_dir() for p in out.iterdir()):  # a checkpoint is flat: never delete a tree by mistake
        raise QuantizeError(f"--out {out} holds subdirectories: it does not look like a checkpoint, and "
                            "--force only replaces checkpoint directories; remove it yourself")


def check_libraries(method: str) -> None:
    """Whether the method's libraries are installed, without importing them (GPTQModel takes seconds and
    prints a banner): a broken install is reported when it is imported."""
    from importlib.util import find_spec

    needs = {"gptqmodel": "GPTQModel"} if method in GPTQMODEL_METHODS else \
        {"bitsandbytes": "bitsandbytes", "accelerate": "accelerate (for transformers' bitsandbytes loader)"}
    for module, name in needs.items():
        if find_spec(module) is None:
            raise QuantizeError(f"--method {method} needs {name}, which is not installed: {EXTRA_HINT}")


def require_library(module: str, what: str):
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


def load_hf_config(source: Path):
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


def check_group_size(config, group_size: int, bits: int, method: str = "gptq") -> None:
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
