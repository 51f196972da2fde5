"""The plugin API: the seams (quantization methods, speculative proposers), what a plugin is handed and builds
with, and their entry-point discovery. Plugins import from here only.

A plugin is a class named by an entry point in the group `kvforge.quant` or `kvforge.decoding`.
Discovery imports each entry point lazily and on its own, so one broken plugin is reported and
the others still load. The built-in dense method `none` comes through the same group.

This module is a leaf of the core: it imports only modules that never import it back (the sequence and step
types, the sampler), so the engine's modules import it, not the other way round; what a drafter gets from the
engine (DraftTarget) is implemented by core/draft_target.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# what a drafter reads and builds with: the engine's sequences, a step's items, its sampling, KV block tables
from kvforge.core.kv.manager import KVCacheManager as KVCacheManager
from kvforge.core.request import Sequence as Sequence
from kvforge.core.sampler import draw as draw
from kvforge.core.sampler import sampling_probs as sampling_probs
from kvforge.core.step import ScheduledSeq as ScheduledSeq

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

    from kvforge.core.config import EngineConfig
    from kvforge.core.runner import ModelRunner
    from kvforge.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

QUANT_GROUP = "kvforge.quant"
DECODING_GROUP = "kvforge.decoding"
BUILTIN_DISTRIBUTION = "kvforge"
# A quant option of every method, read by the core (core/quant_config.py): modules that stay dense
DENSE_MODULES_OPTION = "modules_to_not_convert"


@dataclass(frozen=True)
class LinearKernel:
    """One implementation of a layer's matmul: `prepare(weight)` once, then `run(x, prepared, bias)` per call."""

    prepare: Callable[[torch.Tensor], Any]
    run: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


class QuantMethod(ABC):
    """How one linear layer stores its weights and computes `x @ W.T + b`.

    The linear layer owns weight loading (fusion, tensor-parallel slicing); a method only creates
    the parameters, post-processes them once they are loaded, and applies them.
    """

    name: str = ""
    description: str = ""
    settings: dict[str, Any] = {}  # JSON-schema-like description of the options the UI renders
    devices: tuple[str, ...] = ("cpu", "cuda")
    # apply() never syncs with the host or allocates by data, so CUDA graphs may capture decode steps
    cuda_graph_safe: bool = False

    def __init__(self, **options: Any) -> None:
        self.options = self.validate_options(options)

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Check `options` against the declared `settings` (unknown names, types, enums, bounds) and fill
        in defaults. Errors name the option, so the CLI, the admin API and the UI can show them as is.
        `modules_to_not_convert` (module names kept dense) is the core's, not the method's."""
        options = dict(options)
        dense_modules = options.pop(DENSE_MODULES_OPTION, None)
        resolved = validate_settings(cls.name, cls.settings, options)
        if dense_modules is not None:
            if not (isinstance(dense_modules, list) and all(isinstance(n, str) and n for n in dense_modules)):
                raise ValueError(f"option {DENSE_MODULES_OPTION!r} of plugin {cls.name!r} must be a list of module "
                                 f"names, got {dense_modules!r}")
            resolved[DENSE_MODULES_OPTION] = dense_modules
        return resolved

    @classmethod
    def bits_per_weight(cls, options: dict[str, Any]) -> float | None:
        """Storage bits per weight of a quantized linear (scales and zeros included), for memory estimates
        before loading; None: dense in the model dtype."""
        return None

    @classmethod
    def exact_fp32(cls, options: dict[str, Any]) -> bool:
        """Whether its linears compute in fp32 what the dense model's compute, bit for bit; where they do not, the
        model's fp32 SiLU and RMSNorm may take the fused C kernels, which differ in the last bits
        (core/layers/backend.py). True unless a method says otherwise."""
        return True

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        """The layout options a checkpoint whose config.json carries this `quantization_config` fixes;
        None when the checkpoint is not in this method's format (raise for a format it refuses)."""
        return None

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, torch.Tensor]],
                           options: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rewrite the checkpoint's (name, tensor) stream before the layers' weight loaders see it, e.g.
        to dequantize a pre-quantized checkpoint whose tensors the method's parameters do not mirror."""
        return tensors

    @abstractmethod
    def create_weights(
        self, layer: torch.nn.Module, in_features: int, out_features_per_shard: list[int],
        params_dtype: torch.dtype,
    ) -> None: ...

    def process_after_loading(self, layer: torch.nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack / transpose / quantize once every shard is loaded."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ...

    def kernels(self, layer: torch.nn.Module) -> dict[str, LinearKernel]:
        """The implementations of this layer's matmul the runner may choose between by timing them on this
        machine (core/kernel_choice.py), the stock one first; {} or one: nothing to choose. Each `prepare`s
        the layer's `weight` and runs on what it prepared."""
        return {}

    def use_kernel(self, layer: torch.nn.Module, name: str) -> None:  # noqa: B027 - only with kernels()
        """Switch the layer to kernels(layer)[name] (called once, after loading)."""

    def weight_bytes(self, layer: torch.nn.Module) -> int:
        """Bytes the layer's weights take after processing (for memory reports)."""
        return sum(t.numel() * t.element_size() for t in layer.parameters(recurse=False)) + sum(
            t.numel() * t.element_size() for t in layer.buffers(recurse=False))


@dataclass
class DraftModel:
    """A draft model loaded beside the target: its runner (no KV pool yet), config and tokenizer."""

    runner: ModelRunner
    hf_config: PretrainedConfig
    tokenizer: Tokenizer


class DraftTarget(ABC):
    """What a speculative-decoding proposer gets from the engine it drafts for: the target's settings, tokenizer
    and model, and builders for a runner and a KV pool of the drafter's own (a plugin never assembles core parts
    itself)."""

    config: EngineConfig | None
    hf_config: PretrainedConfig | None
    model_path: Path | None
    tokenizer: Tokenizer | None
    model: nn.Module | None  # the target's model (a drafter may run its first layers)
    kernels: str  # the attention / norm kernels the target's layers were built with

    @abstractmethod
    def runner_for(self, model: nn.Module, hf_config: PretrainedConfig) -> ModelRunner:
        """A runner of the drafter's own for `model`, built on the target's layers (their kernels)."""

    @abstractmethod
    def load_draft_model(self, model: str) -> DraftModel:
        """Load a draft model (a directory, .gguf file or embedded alias) on the target's device and dtype."""

    @abstractmethod
    def kv_pool(self, num_blocks: int, block_size: int) -> KVCacheManager:
        """Block tables over a pool of `num_blocks` of the drafter's own (no prefix caching)."""


@dataclass
class Proposal:
    """Draft tokens for one sequence; `probs` [tokens, vocab] when the drafter sampled them from a
    distribution (rejection sampling needs it), None when they are deterministic (n-gram, greedy)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """A speculative-decoding drafter: proposes up to k tokens per sequence; the core verifies them
    (`sampler.sample_tokens`), so every proposer is lossless by construction.

    `settings` always holds the core's speculation knobs below; a plugin adds its own with
    `settings = Proposer.settings | {...}`.
    """

    name: str = ""
    description: str = ""
    settings: dict[str, Any] = {
        "k": {"type": "integer", "minimum": 1, "default": 4,
              "description": "draft tokens per step at most (the adaptive k stays at or below it)"},
        "adaptive": {"type": "boolean", "default": True,
                     "description": "per request: k follows the moving acceptance rate (all k from 25%, "
                                    "proportionally fewer below; a model drafter pauses below 10%)"},
        "max_batch_size": {"type": "integer", "minimum": 1, "default": 8,
                           "description": "no speculation in a step with more decoding sequences than this "
                                          "(a large batch is already compute-bound)"},
    }

    drafting_runs_a_model: bool = True  # False: drafts cost nothing to make (no pause at low acceptance)

    def __init__(self, target: DraftTarget, **options: Any) -> None:
        self.target = target
        self.options = self.validate_options(options)

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return validate_settings(cls.name, cls.settings, options)

    @abstractmethod
    def propose(self, seqs: list[Any], num_tokens: list[int]) -> list[list[int] | Proposal]:
        """Up to `num_tokens[i]` draft tokens to follow `seqs[i].token_ids` (core.request.Sequence)."""

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes the drafter needs per block of the target's pool (the engine splits its KV budget so
        that both pools hold the same number of tokens); 0: the drafter keeps no KV."""
        return 0

    def allocate_kv(self, num_blocks: int) -> None:  # noqa: B027 - optional hook
        """Create the drafter's own paged KV pool of `num_blocks` blocks."""

    def release(self, seq: Any) -> None:  # noqa: B027 - optional hook
        """The sequence finished (or was aborted): drop whatever the drafter keeps for it."""

    def kv_blocks_used(self) -> int:
        """Blocks of the drafter's own KV pool in use (0 when it has none)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """The engine is shutting down."""


_SETTING_TYPES = {"number": (int, float), "integer": (int,), "boolean": (bool,), "string": (str,)}


def validate_settings(plugin: str, settings: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(settings))
    if unknown:
        known = ", ".join(sorted(settings)) or "none"
        raise ValueError(f"plugin {plugin!r} has no option {unknown[0]!r} (options: {known})")
    resolved = {name: spec["default"] for name, spec in settings.items() if "default" in spec}
    for name, value in options.items():
        spec = settings[name]
        kind = spec.get("type")
        types = _SETTING_TYPES.get(kind, (object,))
        if isinstance(value, bool) and kind in ("number", "integer"):
            types = ()
        if not isinstance(value, types):
            raise ValueError(f"option {name!r} of plugin {plugin!r} must be a {kind}, got {value!r}")
        if "enum" in spec and value not in spec["enum"]:
            choices = ", ".join(map(repr, spec["enum"]))
            raise ValueError(f"option {name!r} of plugin {plugin!r} must be one of {choices}, got {value!r}")
        if "minimum" in spec and value < spec["minimum"]:
            raise ValueError(f"option {name!r} of plugin {plugin!r} must be >= {spec['minimum']}, got {value!r}")
        resolved[name] = value
    return resolved


@dataclass
class PluginRegistry:
    """What discovery found in one entry-point group."""

    group: str
    plugins: dict[str, type] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # name -> "distribution version"
    errors: dict[str, str] = field(default_factory=dict)  # name -> why it did not load

    def get(self, name: str) -> type:
        if name in self.plugins:
            return self.plugins[name]
        if name in self.errors:
            raise ValueError(f"{self.group} plugin {name!r} is installed but failed to load: {self.errors[name]}")
        known = ", ".join(sorted(self.plugins)) or "none"
        raise ValueError(f"unknown {self.group} plugin {name!r}; installed: {known}")


def discover(group: str, override: set[str] | None = None) -> PluginRegistry:
    """Load every entry point of `group`, once per process (the UI asks on each field change):
    `refresh_plugins()` rescans, e.g. after a plugin package was installed into a running process.

    A name claimed by two distributions is refused for the non-built-in one (built-ins win) unless
    that name is listed in `override`, in which case the third-party plugin replaces the built-in.
    """
    return _scan(group, frozenset(override or ()))


def refresh_plugins() -> None:
    """Forget what discovery found: the next `discover` scans the entry points again."""
    _scan.cache_clear()


@functools.cache
def _scan(group: str, override: frozenset[str]) -> PluginRegistry:
    registry = PluginRegistry(group)
    entries = sorted(importlib.metadata.entry_points(group=group),
                     key=lambda ep: _distribution_name(ep) != BUILTIN_DISTRIBUTION)
    for ep in entries:
        dist = _distribution_name(ep)
        if ep.name in registry.sources:
            builtin_first = registry.sources[ep.name].split()[0] == BUILTIN_DISTRIBUTION
            if not (builtin_first and ep.name in override):
                registry.errors.setdefault(
                    f"{ep.name} ({dist})", f"duplicate plugin name {ep.name!r}; already provided by "
                    f"{registry.sources[ep.name]}")
                continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            log.warning("plugin %s from %s failed to load: %s", ep.name, dist, exc)
            registry.errors[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        registry.plugins[ep.name] = plugin
        registry.sources[ep.name] = f"{dist} {_distribution_version(ep)}"
    return registry


def _distribution_name(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "unknown"


def _distribution_version(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.version if ep.dist is not None else ""


def checkpoint_quantization(hf_config: Any, model_path: Any) -> dict[str, Any] | None:
    """A checkpoint's quantization config: config.json's `quantization_config` (transformers) or an
    auto-gptq `quantize_config.json` beside it; None for a dense checkpoint."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()
    if config is None:
        legacy = Path(model_path) / "quantize_config.json"
        if legacy.exists():
            config = {"quant_method": "gptq", **json.loads(legacy.read_text())}
    return config


def resolve_quant(quant: str, options: dict[str, Any], hf_config: Any, model_path: Any) -> tuple[str, dict[str, Any]]:
    """The quant method and options that load this checkpoint. A quantized checkpoint picks its method
    (when `quant` is "none") or must match the one asked for; the checkpoint decides its layout options,
    the user may add the others (e.g. the kernel)."""
    config = checkpoint_quantization(hf_config, model_path)
    registry = discover(QUANT_GROUP)
    if config is None:  # a dense checkpoint: any plugin, its options with their defaults filled in
        return quant, registry.get(quant).validate_options(options)
    claims = {}
    for name, cls in sorted(registry.plugins.items()):
        found = cls.options_for_checkpoint(config)
        if found is not None:
            claims[name] = found
    method = config.get("quant_method", "unknown")
    if not claims:
        raise ValueError(f"the checkpoint is quantized with {method!r} and no installed quant plugin loads it "
                         f"(installed: {', '.join(sorted(registry.plugins))})")
    if quant == "none":
        quant = next(iter(claims))
    elif quant not in claims:
        raise ValueError(f"the checkpoint is {method}-quantized: load it with quant {' or '.join(claims)} "
                         f"(or leave quant unset), not {quant!r}")
    layout = claims[quant]  # what the checkpoint fixes; the user may set the other options
    for name, value in options.items():
        if name in layout and value != layout[name]:
            raise ValueError(f"option {name!r} = {value!r} contradicts the checkpoint, which has {layout[name]!r}")
    return quant, registry.get(quant).validate_options({**options, **layout})


def get_quant_method(name: str = "none", **options: Any) -> QuantMethod:
    cls = discover(QUANT_GROUP).get(name)
    return cls(**options)
