"""The `gptq` plugin: GPTQ checkpoints as written by auto-gptq, GPTQModel and transformers.

2, 4 or 8 bits, any group size, act-order (`desc_act`, a non-monotonic `g_idx`), symmetric or not,
`checkpoint_format` "gptq" (zero stored minus one) or "gptq_v2". Layout: packing.py; kernels:
group_quant.py. Loading needs no GPTQ package.
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.plugins.quant.group_quant import GROUP_SIZE_SETTING, KERNEL_SETTING, GroupQuantMethod
from kvforge.plugins.quant.packing import Quantized, unpack_gptq

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqMethod(GroupQuantMethod):
    name = "gptq"
    description = "GPTQ checkpoints (2/4/8-bit, any group size, act-order, sym/asym, v1/v2 zeros)."
    settings = {
        "bits": {"type": "integer", "enum": [2, 4, 8], "default": 4, "description": "bits per weight"},
        "group_size": GROUP_SIZE_SETTING,
        "desc_act": {"type": "boolean", "default": False, "description": "act-order (g_idx permutes groups)"},
        "sym": {"type": "boolean", "default": True, "description": "symmetric quantization"},
        "checkpoint_format": {"type": "string", "enum": list(CHECKPOINT_FORMATS), "default": "gptq",
                              "description": "gptq: zeros stored minus one; gptq_v2: zeros as is"},
        "kernel": KERNEL_SETTING,
    }

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        if quantization_config.get("quant_method") != "gptq":
            return None
        fmt = quantization_config.get("checkpoint_format") or quantization_config.get("format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint format {fmt!r} is not supported (supported: gptq, gptq_v2)")
        options = {"bits": int(quantization_config.get("bits", 4)),
                   "group_size": int(quantization_config.get("group_size", 128)),
                   "desc_act": bool(quantization_config.get("desc_act", False)),
                   "sym": bool(quantization_config.get("sym", True)), "checkpoint_format": fmt}
        return options

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        n, groups, per = sum(out_features_per_shard), self.groups(in_features), self.pack_factor
        layer.params_dtype = params_dtype  # the blocks kernel times its activations' choice in it
        if in_features % per:
            raise ValueError(f"gptq: {in_features} input features do not fill {self.bits}-bit words")
        self.add_param(layer, "qweight", (in_features // per, n), torch.int32,
                       input_dim=0, output_dim=1, packed_dim=0, pack_factor=per)
        group_axis = 0
        if getattr(layer, "input_split", False) and self.options["desc_act"]:
            # a row-parallel shard under act-order: its rows' g_idx point at groups anywhere in the
            # layer, so every rank keeps all the groups' zeros and scales (not split along the input)
            groups, group_axis = self.groups(layer.full_in_features), None
        self.add_param(layer, "qzeros", (groups, n // per), torch.int32,
                       input_dim=group_axis, output_dim=1, packed_dim=1, pack_factor=per)
        self.add_param(layer, "scales", (groups, n), torch.float32, input_dim=group_axis, output_dim=1)
        # optional: checkpoints without act-order may leave it out (-1 marks "not loaded")
        self.add_param(layer, "g_idx", (in_features,), torch.int32, input_dim=0, output_dim=None, optional=True)
        layer.g_idx.data.fill_(-1)

    def read_checkpoint_layout(self, layer) -> Quantized:
        tensors = {name: getattr(layer, name).data for name in ("qweight", "qzeros", "scales", "g_idx")}
        for name in tensors:
            delattr(layer, name)
        if bool((tensors["g_idx"] == -1).all()):
            del tensors["g_idx"]  # contiguous groups
        groups = tensors["scales"].shape[0]
        if "g_idx" in tensors and getattr(layer, "input_split", False) and not self.options["desc_act"] \
                and self.group_size != -1:
            # a row-parallel shard holds its own groups only: number them from 0 (act-order, or one group
            # for the whole layer, keeps them all)
            tensors["g_idx"] = tensors["g_idx"] - layer.input_first // self.group_size
        quant = unpack_gptq(tensors, self.bits, self.options["checkpoint_format"])
        if int(quant.g_idx.min()) < 0 or int(quant.g_idx.max()) >= groups:
            raise ValueError(f"gptq: g_idx refers to groups outside 0..{groups - 1}")
        return quant
