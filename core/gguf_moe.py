"""Mixture-of-experts GGUF files (llama.cpp's layout), what transformers' GGUF reader leaves for kvforge to do.

llama.cpp stacks a MoE layer's experts, one tensor per projection: `blk.N.ffn_{gate,up,down}_exps.weight`, torch
shape [experts, rows, row length]; the router (`ffn_gate_inp`) and Qwen2-MoE's shared expert (`*_shexp`) are
ordinary tensors. kvforge's experts are ordinary MLPs (core/layers/moe.py), each loading its own
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, so a stacked tensor is split along its expert axis: read
in place (core/gguf_source.py), each expert's slice is a view of the file (one expert's rows lie together, whole
blocks); converted dense (core/loader.py), transformers' stacked `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I] are split per expert.

transformers 5 reads qwen2moe and qwen3moe files: config, tokenizer, tensor names, the stacked tensors. It maps
neither `expert_feed_forward_length` nor `expert_shared_feed_forward_length`, so its config keeps the class defaults
for the experts' sizes (right only for the checkpoints those defaults come from); `complete_config` reads them from
the file. Other files with experts (Mixtral's, architecture llama; OLMoE's) it does not read, or reads as a dense
model: `check_readable` refuses them with one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

STACKED = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
READ_BY_TRANSFORMERS = ("qwen2moe", "qwen3moe")
# metadata key (after "<arch>.") -> the config field transformers leaves at its default
EXPERT_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def check_readable(metadata: Mapping) -> None:
    """Refuse a file with experts that transformers' GGUF reader cannot read as such (before it reads it)."""
    arch = str(metadata.get("general.architecture"))
    if metadata.get(f"{arch}.expert_count") and arch not in READ_BY_TRANSFORMERS:
        family = {"llama": "Mixtral"}.get(arch, arch)
        raise ValueError(f"GGUF files of mixture-of-experts architecture {arch!r} ({family}) are not supported yet "
                         f"(supported: {', '.join(READ_BY_TRANSFORMERS)}); load the model's safetensors checkpoint "
                         "instead")


def complete_config(config, metadata: Mapping) -> None:
    """The experts' sizes transformers' reader does not map, from the file's metadata (only fields the config's class
    has: Qwen3-MoE has no shared expert)."""
    arch = str(metadata.get("general.architecture"))
    for key, field in EXPERT_SIZES.items():
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, int) and value > 0 and hasattr(config, field):
            setattr(config, field, value)


def expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The per-expert names kvforge loads a stacked tensor as, or None for a tensor that is not one."""
    match = STACKED.fullmatch(gguf_name)
    if match is None:
        return None
    return [f"model.layers.{match['layer']}.mlp.experts.{e}.{match['part']}_proj.weight" for e in range(experts)]


def split_stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert tensors (`...experts.gate_up_proj` [E, 2I, H], gate first; `...experts.down_proj`
    [E, H, I]) as each expert's own tensors (copies: safetensors stores no shared memory); the others unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if tensor.dim() != 3 or not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        parts = dict(zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1))) if leaf == "gate_up_proj" \
            else {"down_proj": tensor}
        for part, stacked in parts.items():
            for expert in range(stacked.shape[0]):
                out[f"{prefix}.{expert}.{part}.weight"] = stacked[expert].clone()
    return out
