"""The `awq` plugin: AWQ "gemm" checkpoints (AutoAWQ layout, as GPTQModel also writes it).

4-bit, interleaved packing along the output features, contiguous groups (no g_idx), real zeros.
AWQ rescales norms and other tensors when it quantizes: every tensor is loaded from the checkpoint.
Layout: packing.py; kernels: group_quant.py. Loading needs no AWQ package.
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.plugins.quant.group_quant import GROUP_SIZE_SETTING, KERNEL_SETTING, GroupQuantMethod
from kvforge.plugins.quant.packing import Quantized, unpack_awq


class AwqMethod(GroupQuantMethod):
    name = "awq"
    description = "AWQ gemm checkpoints (4-bit, interleaved packing, zero points)."
    settings = {
        "bits": {"type": "integer", "enum": [4], "default": 4, "description": "bits per weight"},
        "group_size": GROUP_SIZE_SETTING,
        "zero_point": {"type": "boolean", "default": True, "description": "asymmetric (zero points stored)"},
        "version": {"type": "string", "enum": ["gemm"], "default": "gemm", "description": "packing layout"},
        "kernel": KERNEL_SETTING,
    }

    @classmethod
    def options_for_checkpoint(cls, quantization_config: dict[str, Any]) -> dict[str, Any] | None:
        if quantization_config.get("quant_method") != "awq":
            return None
        version = str(quantization_config.get("version") or quantization_config.get("format") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (gemm only)")
        options = {"bits": int(quantization_config.get("bits", quantization_config.get("w_bit", 4))),
                   "group_size": int(quantization_config.get("group_size",
                                                             quantization_config.get("q_group_size", 128))),
                   "zero_point": bool(quantization_config.get("zero_point", True)), "version": "gemm"}
        return options

    def create_weights(self, layer, in_features, out_features_per_shard, params_dtype) -> None:
        n, groups, per = sum(out_features_per_shard), self.groups(in_features), self.pack_factor
        layer.params_dtype = params_dtype  # the blocks kernel times its activations' choice in it
        self.add_param(layer, "qweight", (in_features, n // per), torch.int32,
                       input_dim=0, output_dim=1, packed_dim=1, pack_factor=per)
        self.add_param(layer, "qzeros", (groups, n // per), torch.int32,
                       input_dim=0, output_dim=1, packed_dim=1, pack_factor=per)
        self.add_param(layer, "scales", (groups, n), torch.float32, input_dim=0, output_dim=1)

    def read_checkpoint_layout(self, layer) -> Quantized:
        tensors = {name: getattr(layer, name).data for name in ("qweight", "qzeros", "scales")}
        for name in tensors:
            delattr(layer, name)
        return unpack_awq(tensors)
