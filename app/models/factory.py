"""The one way the app builds an engine: `kvforge serve` (its first model and every swap through
ModelHost), the server's default factory, `kvforge generate` / `chat`.

A ModelSpec says which model and how it is loaded (dtype, quant and decoding plugins, tensor-parallel
ranks, KV budget); ServeSettings add the rest of the engine's knobs (block size, threads, device, GPU
switches). Without settings, what the spec leaves open is EngineConfig's default.
"""

from __future__ import annotations

import os
from typing import Any

from kvforge.app.models.spec import ModelSpec, check_decoding
from kvforge.app.settings import GIB, ServeSettings, check_tp, json_options, model_sampling_table
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.config import EngineConfig
from kvforge.core.kv.index import KVIndex


def torchrun_world_size() -> int:
    """How many ranks torchrun started (1 when it did not start this process)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def spec_from_settings(settings: ServeSettings, served_name: str | None = None) -> ModelSpec:
    """The model the settings name (--model, --dtype, --quant..., --tp); bad options JSON is a ValueError
    naming the flag."""
    return ModelSpec(model=settings.model, dtype=settings.dtype, quant=settings.quant,
                     quant_options=json_options(settings.quant_options, "--quant-options"), served_name=served_name,
                     kv_cache_dtype=settings.kv_cache_dtype,
                     decoding=settings.decoding,
                     decoding_options=json_options(settings.decoding_options, "--decoding-options"), tp=settings.tp,
                     pp=settings.pp, cpu_experts=settings.cpu_experts)


def engine_config(spec: ModelSpec, settings: ServeSettings | None = None, **overrides: Any) -> EngineConfig:
    """The spec's model over the settings' knobs, then `overrides` (EngineConfig fields). An unknown decoding
    plugin, a bad option or a bad tp fails here, before the model loads."""
    knobs, tp, quant, decoding, kv_gb = {}, spec.tp, spec.quant, spec.decoding, spec.kv_cache_gb
    if settings is not None:  # an empty plugin name or KV budget in the spec: the server's
        knobs = settings.engine_knobs()
        quant, decoding = quant or settings.quant or "none", decoding or settings.decoding or "none"
        kv_gb = kv_gb or settings.kv_cache_gb
        world = torchrun_world_size()
        if tp == 1 and world > 1:  # under torchrun every rank is a tensor-parallel rank of one of the stages
            if world % spec.pp:
                raise ValueError(f"torchrun started {world} ranks: not a multiple of --pp {spec.pp}")
            tp = world // spec.pp
    check_decoding(decoding, spec.decoding_options)
    check_tp(tp)
    check_tp(spec.pp, "pp")
    sized = {"kv_cache_bytes": int(kv_gb * GIB)} if kv_gb else {}
    sampling = model_sampling(spec, settings)
    return EngineConfig(**{**knobs, "model": spec.model, "dtype": spec.dtype, "kv_cache_dtype": spec.kv_cache_dtype,
                           "quant": quant,
                           "quant_options": spec.quant_options, "decoding": decoding,
                           "decoding_options": spec.decoding_options, "tp_size": tp, "pp_size": spec.pp,
                           "cpu_experts": spec.cpu_experts, **sized,
                           **({"sampling_defaults": sampling} if sampling else {}), **overrides})


def model_sampling(spec: ModelSpec, settings: ServeSettings | None) -> dict[str, Any]:
    """The settings' sampling defaults for the spec's model (--model-sampling), by the name it is served under or
    its models-directory entry (file or directory name; the embedded model's name)."""
    table = model_sampling_table(settings.model_sampling) if settings is not None else {}
    return dict(table.get(spec.name) or table.get(spec.entry) or {})


def build_engine(spec: ModelSpec, settings: ServeSettings | None = None, *, progress: bool = True,
                 kv_index: KVIndex | None = None, **overrides: Any):
    """An LLMEngine for the spec (see engine_config); `progress`: show the loading progress bars; `kv_index`:
    the persisted tier's index on a store the caller owns (None: the engine opens its db_url itself)."""
    from kvforge.core.engine import LLMEngine

    return LLMEngine(engine_config(spec, settings, **overrides), progress=progress, kv_index=kv_index)


def build_async_engine(spec: ModelSpec, settings: ServeSettings | None = None, *, progress: bool = True,
                       on_fatal=None, kv_index: KVIndex | None = None, **overrides: Any) -> AsyncEngine:
    """build_engine's engine, served (`on_fatal`: called when a tensor-parallel rank dies)."""
    return AsyncEngine(build_engine(spec, settings, progress=progress, kv_index=kv_index, **overrides),
                       on_fatal=on_fatal)


def default_engine_factory(spec: ModelSpec) -> AsyncEngine:
    """The swaps of a server made from a bare AsyncEngine: the spec over EngineConfig's defaults."""
    return build_async_engine(spec, progress=False)
