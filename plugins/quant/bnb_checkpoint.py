"""Loading bitsandbytes checkpoints written by HF transformers' `save_pretrained` for a
`BitsAndBytesConfig` model: each quantized linear is dequantized tensor by tensor in the stream and
quantized again at load by the method. Re-quantizing a dequantized row (int8) or block (4-bit) gives back
the stored codes and absmax (see tests/plugins/test_bnb.py), so nothing is lost twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from kvforge.core.plugins import QuantMethod
from kvforge.plugins.quant.bnb_common import bitsandbytes_module, dequantize_4bit, dequantize_int8
from kvforge.plugins.quant.dense import create_dense_weight

log = logging.getLogger(__name__)

_QUANT_STATE = "quant_state.bitsandbytes__"
_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


class BnbMethod(QuantMethod):
    """What both bitsandbytes methods share: a dense weight loaded as is (a pre-quantized checkpoint is
    dequantized in the tensor stream), quantized in process_after_loading."""

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, torch.Tensor]],
                           options: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        return dequantize_checkpoint(tensors, cls, options)

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        create_dense_weight(layer, in_features, out_features_per_shard, params_dtype)

    @classmethod
    def stored_differently(cls, stored: dict[str, Any], options: dict[str, Any]) -> bool:
        """Whether a checkpoint module stored as `stored` (format, blocksize, double_quant) is quantized
        again with other settings than its own (a second rounding)."""
        return False


def checkpoint_bits(quantization_config: dict[str, Any]) -> int | None:
    """8 or 4 for a transformers BitsAndBytesConfig checkpoint, else None."""
    if quantization_config.get("quant_method", "bitsandbytes") != "bitsandbytes":
        return None
    if quantization_config.get("load_in_8bit"):
        return 8
    if quantization_config.get("load_in_4bit"):
        return 4
    return None


def _bnb_part(name: str, tensor: torch.Tensor, pending: dict[str, dict[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(module prefix, part) when `name` is a piece of a bitsandbytes-quantized linear, else None."""
    for suffix in (".SCB", ".weight_format"):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[1:]
    head, sep, tail = name.rpartition(".weight.")
    if sep and (tail in _4BIT_PARTS or tail.startswith(_QUANT_STATE)):
        return head, tail
    if name.endswith(".weight"):
        prefix = name[: -len(".weight")]
        # int8 codes / uint8 4-bit storage; [n, 1]: 4-bit packed in another quant_storage dtype
        if (tensor.dtype in (torch.int8, torch.uint8) or prefix in pending
                or (tensor.dim() == 2 and tensor.shape[1] == 1)):
            return prefix, "weight"
    return None


def _int8_format_is_row_major(prefix: str, weight_format: torch.Tensor) -> None:
    value = int(weight_format.item())
    if value != 0:
        raise ValueError(f"{prefix}: bitsandbytes int8 weight_format {value} is a tiled GPU layout; only row-major "
                         "(0, what bitsandbytes >= 0.45 writes) can be loaded")


def _dequantize_group(prefix: str, group: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict] | None:
    """The dense fp32 weight of one module once all its pieces are in `group`, with what it was stored as."""
    if "weight" not in group:
        return None
    if "SCB" in group:
        if "weight_format" in group:
            _int8_format_is_row_major(prefix, group["weight_format"])
        return dequantize_int8(group["weight"], group["SCB"]).float(), {"format": "int8"}
    state_key = next((k for k in group if k.startswith(_QUANT_STATE)), None)
    if state_key is None or "absmax" not in group or "quant_map" not in group:
        return None
    bnb = bitsandbytes_module()
    packed_state = bnb.utils.unpack_tensor_to_dict(group[state_key])
    nested = "nested_blocksize" in packed_state
    if nested and not ("nested_absmax" in group and "nested_quant_map" in group):
        return None
    parts = {k: v for k, v in group.items() if k != "weight"}
    state = bnb.functional.QuantState.from_dict(parts, device=group["weight"].device)
    dense = dequantize_4bit(group["weight"], state, torch.float32)
    return dense, {"format": state.quant_type, "blocksize": state.blocksize, "double_quant": nested}


def dequantize_checkpoint(tensors: Iterator[tuple[str, torch.Tensor]], method: type[BnbMethod] | None = None,
                          options: dict[str, Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a checkpoint, replacing each bitsandbytes-quantized linear (int8: `<p>.weight` int8 +
    `<p>.SCB` [+ `<p>.weight_format`]; 4-bit: `<p>.weight` uint8 + `<p>.weight.absmax`, `.quant_map`,
    `.quant_state.bitsandbytes__nf4|fp4` [+ `.nested_absmax`, `.nested_quant_map`]) by its dequantized
    fp32 `<p>.weight`. Every other tensor passes through unchanged, in order. A module's pieces are held
    only until the last one arrives (safetensors files list them together), never the whole checkpoint."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    emitted_int8: set[str] = set()
    warned = False
    for name, tensor in tensors:
        split = _bnb_part(name, tensor, pending)
        if split is None:
            yield name, tensor
            continue
        prefix, part = split
        if part == "weight_format" and prefix in emitted_int8:  # listed after the weight it describes
            _int8_format_is_row_major(prefix, tensor)
            continue
        group = pending.setdefault(prefix, {})
        group[part] = tensor
        done = _dequantize_group(prefix, group)
        if done is None:
            continue
        dense, stored = done
        del pending[prefix]
        if stored["format"] == "int8":
            emitted_int8.add(prefix)
        if not warned and method is not None and options is not None and method.stored_differently(stored, options):
            warned = True
            log.warning("%s: the checkpoint's bitsandbytes weights (%s) are dequantized and quantized again "
                        "as %s %s: a second rounding", prefix, _describe(stored), method.name, options)
        yield f"{prefix}.weight", dense
    for prefix, group in pending.items():
        if set(group) == {"weight"} and group["weight"].is_floating_point():  # an ordinary [n, 1] weight
            yield f"{prefix}.weight", group["weight"]
            continue
        raise ValueError(f"incomplete bitsandbytes checkpoint: module {prefix} has only {', '.join(sorted(group))}")


def _describe(stored: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in stored.items())
