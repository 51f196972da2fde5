"""Which quant method each linear layer gets, chosen by the layer's dotted name (the seam of vLLM's
`QuantizationConfig.get_quant_method(layer, prefix)`).

Every linear layer asks `method_for(prefix)` with its name in the model ("model.layers.0.mlp.down_proj",
"lm_head"). The LM head (unless the checkpoint's quantization config says `"lm_head": true`, as GPTQModel's
and kvforge's GGUF checkpoints may) and the modules named in `modules_to_not_convert` stay dense; every other
linear gets the engine's quant method. `modules_to_not_convert` comes from the checkpoint's quantization_config
(what GPTQ, AWQ and transformers' bitsandbytes checkpoints carry; bitsandbytes calls it
`llm_int8_skip_modules`) and from the user's quant options, under the same name; names match as in
transformers (`should_convert_module`), so a checkpoint means here what it means there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvforge.core.plugins import DENSE_MODULES_OPTION, QuantMethod, get_quant_method

ALWAYS_DENSE = ("lm_head",)  # quantized checkpoints keep the head unquantized unless they say `"lm_head": true`
CHECKPOINT_DENSE_KEYS = ("modules_to_not_convert", "llm_int8_skip_modules")


def dense_method() -> QuantMethod:
    """The dense method, found like any other (the entry point `none` of kvforge.quant)."""
    return get_quant_method("none")


def module_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a module name is one of `patterns`: a name from the start up to a module boundary
    ("model.layers.1" is model.layers.1.*, not model.layers.11.*), a regex with the same boundary, or a
    suffix ("down_proj"). transformers' `should_convert_module`, negated."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:
        try:
            if re.match(rf"(?:{pattern}){boundary}", name) or name.endswith(pattern):
                return True
        except re.error as exc:
            raise ValueError(f"{DENSE_MODULES_OPTION}: {pattern!r} is not a valid module pattern ({exc})") from None
    return False


def checkpoint_dense_modules(quantization_config: dict[str, Any] | None) -> tuple[str, ...]:
    """The modules a quantized checkpoint stores unquantized."""
    names: list[str] = []
    for key in CHECKPOINT_DENSE_KEYS:
        names += (quantization_config or {}).get(key) or []
    return tuple(names)


@dataclass(frozen=True)
class QuantConfig:
    """The engine's quant method and options, the modules kept dense, and the fused layers of the model
    (a fused layer holds several checkpoint projections: it is dense only when all of them are)."""

    method: type[QuantMethod]
    options: dict[str, Any] = field(default_factory=dict)
    dense_modules: tuple[str, ...] = ALWAYS_DENSE
    fused_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)  # "qkv_proj" -> q/k/v_proj

    @classmethod
    def for_checkpoint(cls, method: type[QuantMethod], options: dict[str, Any],
                       quantization_config: dict[str, Any] | None) -> QuantConfig:
        """`options` as the method validated them (the user's `modules_to_not_convert` among them)."""
        plugin_options = {k: v for k, v in options.items() if k != DENSE_MODULES_OPTION}
        quantized_head = bool((quantization_config or {}).get("lm_head"))  # GPTQModel's flag; the gguf checkpoint's
        dense = (() if quantized_head else ALWAYS_DENSE) + tuple(options.get(DENSE_MODULES_OPTION, ())) + \
            checkpoint_dense_modules(quantization_config)
        return cls(method, plugin_options, dense)

    def with_packed_modules(self, packed_modules_mapping: dict[str, tuple[str, Any]]) -> QuantConfig:
        """The model's `packed_modules_mapping` (checkpoint projection -> (fused layer, shard id))."""
        fused: dict[str, tuple[str, ...]] = {}
        for projection, (layer, _) in packed_modules_mapping.items():
            fused[layer] = (*fused.get(layer, ()), projection)
        return QuantConfig(self.method, self.options, self.dense_modules, fused)

    def is_dense(self, prefix: str) -> bool:
        if module_matches(prefix, self.dense_modules):  # named as kvforge names it (e.g. a fused qkv_proj)
            return True
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}" if parent else p for p in self.fused_modules.get(leaf, (leaf,))]
        dense = [module_matches(part, self.dense_modules) for part in parts]
        if any(dense) and not all(dense):
            raise ValueError(f"{prefix} fuses {', '.join(parts)} into one layer, and {DENSE_MODULES_OPTION} names "
                             "only some of them: name all of them or none")
        return all(dense)

    def bits_per_weight(self, prefix: str) -> float | None:
        """Storage bits per weight of the linear layer named `prefix` (scales included), for memory estimates
        before loading; None: dense in the model dtype."""
        return None if self.is_dense(prefix) else self.method.bits_per_weight(self.options)

    def method_for(self, prefix: str) -> QuantMethod:
        """A new quant method for the linear layer named `prefix`."""
        if self.is_dense(prefix) and self.method.name != "none":  # a quantized model's dense layers: the defaults
            return dense_method()
        return self.method(**self.options)  # (the dense method's own options reach the head too)
