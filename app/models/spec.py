"""A model to load and how (ModelSpec: the one declaration of a model's load settings; the admin API's request, the UI's
settings and `kvforge serve`'s flags build one), and the checks a spec passes before anything is built or drained:
its paths inside the models directory, tensor-parallel ranks this machine can run, a decoding plugin that exists with
valid options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvforge.core.config import engine_default
from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL
from kvforge.core.plugins import DECODING_GROUP, discover


class InvalidSpec(ValueError):
    """A load refused before anything is built or drained; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_decoding(decoding: str | None, options: dict[str, Any] | None) -> None:
    """Refuse an unknown decoding plugin, options its schema rejects (the message names the option), or
    options given with no plugin, before a model is loaded. The engine checks the rest (e.g. a draft
    model's tokenizer) as it builds the plugin."""
    if decoding in (None, "", "none"):
        if options:
            raise InvalidSpec(f"decoding options {', '.join(map(repr, sorted(options)))} given without a decoding "
                              "plugin (decoding is 'none')", "decoding_options")
        return
    registry = discover(DECODING_GROUP)
    try:
        cls = registry.get(decoding)
    except ValueError as exc:
        raise InvalidSpec(str(exc), "decoding") from None
    try:
        cls.validate_options(dict(options or {}))
    except ValueError as exc:
        raise InvalidSpec(str(exc), "decoding_options") from None


def max_tp_ranks() -> int:
    """One process per rank, each loading its share of the model: a request may start at most 8 of them, or one
    per CPU core or GPU where there are more."""
    import torch

    return max(8, os.cpu_count() or 1, torch.cuda.device_count())


@dataclass(frozen=True, kw_only=True)  # by name: nine settings in a row read badly and reorder silently
class ModelSpec:
    """Which model is served and how it is loaded; what it leaves open is EngineConfig's default (or, under
    `kvforge serve`, the server's setting). Built into an engine by app/models/factory.py."""

    model: str | None = engine_default("model")  # None: the embedded default
    dtype: str = engine_default("dtype")
    quant: str = engine_default("quant")
    quant_options: dict[str, Any] = field(default_factory=dict)
    served_name: str | None = None
    kv_cache_gb: float | None = None  # None: the server's --kv-cache-gb
    kv_cache_dtype: str = engine_default("kv_cache_dtype")  # how the KV pool stores K and V (core/kv/quant.py)
    decoding: str = engine_default("decoding")  # speculative decoding plugin; "none": off
    decoding_options: dict[str, Any] = field(default_factory=dict)
    tp: int = engine_default("tp_size")  # tensor-parallel ranks, one process each
    pp: int = engine_default("pp_size")  # pipeline stages, each of tp processes
    cpu_experts: bool = engine_default("cpu_experts")  # a MoE model's experts in host memory, computed on the CPU

    @property
    def entry(self) -> str:
        """The model's models-directory entry (file or directory name; the embedded model's name)."""
        return EMBEDDED_MODEL if self.model in EMBEDDED_ALIASES else Path(self.model).name

    @property
    def name(self) -> str:
        return self.served_name or self.entry

    @property
    def processes(self) -> int:
        """The processes the model runs in (each owns a rank of this process's one torch.distributed group)."""
        return self.tp * self.pp


def confine(models_dir: Path | None, model: str | None) -> str | None:
    """The embedded default (None), or the path of `model` inside the models directory; ValueError for anything
    else."""
    if model in EMBEDDED_ALIASES:
        return None
    if models_dir is None:
        raise ValueError("no models directory is configured (--models-dir); only the embedded model can be loaded")
    path = (models_dir / model).resolve()
    if not path.is_relative_to(models_dir):
        raise ValueError(f"model path {model!r} is outside the models directory")
    if not path.exists():
        raise ValueError(f"model {model!r} not found in the models directory")
    if not (path.is_file() or path.is_dir()):  # a FIFO, device or socket: its open would block or act
        raise ValueError(f"model {model!r} is not a regular file or a checkpoint directory")
    return str(path)


def checked(spec: ModelSpec, models_dir: Path | None) -> ModelSpec:
    """The spec with its paths confined to the models directory (the model, and a decoding plugin's draft model,
    option `model`), its tensor-parallel ranks and its decoding plugin checked; InvalidSpec when refused."""
    for name, what, value in (("tp", "tensor-parallel ranks", spec.tp), ("pp", "pipeline stages", spec.pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidSpec(f"{name} ({what}) must be an integer >= 1, got {value!r}", name)
    most = max_tp_ranks()
    if spec.processes > most:
        raise InvalidSpec(f"tp x pp (processes) must be at most {most} on this machine, got {spec.tp} x {spec.pp}",
                          "tp" if spec.pp == 1 else "pp")
    try:
        model = confine(models_dir, spec.model)
    except ValueError as exc:
        raise InvalidSpec(str(exc), "model") from None
    check_decoding(spec.decoding, spec.decoding_options)
    options = dict(spec.decoding_options or {})
    draft = options.get("model")
    if isinstance(draft, str) and draft:
        try:  # the embedded model keeps its alias (the option must stay a non-empty string)
            options["model"] = confine(models_dir, draft) or draft
        except ValueError as exc:
            raise InvalidSpec(f"decoding option 'model': {exc}", "decoding_options") from None
    return replace(spec, model=model, decoding_options=options)
