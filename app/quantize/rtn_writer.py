"""Round-to-nearest GPTQ / AWQ checkpoints of a dense model: no calibration, seconds to write.

The layouts are exactly what GPTQ / AWQ tools write (packing.py), so kvforge and HF transformers load
them like any GPTQ / AWQ checkpoint; the values are plain per-group rounding (what GPTQ starts from,
without its error compensation). Used by the accuracy tests and `kvforge bench quant`; `kvforge quantize`
makes calibrated checkpoints with GPTQModel. Reads the whole dense state dict (small models). Modules named
in `modules_to_not_convert` stay dense, recorded in the quantization_config as GPTQ / AWQ tools do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvforge.core.loader import iterate_tensors, safetensors_files
from kvforge.core.quant_config import module_matches
from kvforge.plugins.quant.packing import pack_awq, pack_gptq, quantize_rtn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projections that read the same input share one act-order (GPTQ's Hessian is the same for them)
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_rtn_checkpoint(source: Path, out: Path, method: str = "gptq", bits: int = 4, group_size: int = 64,
                         sym: bool = True, desc_act: bool = False, checkpoint_format: str = "gptq",
                         modules_to_not_convert: list[str] | None = None) -> Path:
    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    if method == "awq" and (bits != 4 or desc_act or sym):
        raise ValueError("AWQ gemm checkpoints are 4-bit, asymmetric, without act-order")
    tensors = dict(iterate_tensors(source))
    orders = _act_orders(tensors) if desc_act else {}
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        projection = module.rpartition(".")[2]
        if leaf != "weight" or projection not in PROJECTIONS or module_matches(module, modules_to_not_convert or ()):
            written[name] = tensor
            continue
        order = orders.get(_input_key(module))
        quant = quantize_rtn(tensor, bits, group_size, sym, desc_act, order)
        packed = pack_gptq(quant, checkpoint_format) if method == "gptq" else pack_awq(quant)
        written.update({f"{module}.{key}": value.contiguous() for key, value in packed.items()})
    out.mkdir(parents=True, exist_ok=True)
    weights = {f.name for f in safetensors_files(source)} | {"model.safetensors.index.json"}
    for file in source.iterdir():
        if file.is_file() and file.name not in weights:
            shutil.copy2(file, out / file.name)
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    if modules_to_not_convert:
        config["quantization_config"]["modules_to_not_convert"] = list(modules_to_not_convert)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _input_key(module: str) -> str:
    parent, _, projection = module.rpartition(".")
    return f"{parent}.{SAME_INPUT.get(projection, projection)}"


def _act_orders(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per input: input features by decreasing summed weight magnitude over the projections reading it."""
    magnitude: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            key = _input_key(module)
            magnitude[key] = magnitude.get(key, 0) + tensor.float().abs().sum(dim=0)
    return {key: torch.argsort(m, descending=True) for key, m in magnitude.items()}
