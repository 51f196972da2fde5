"""SiLU-and-multiply over the fused gate_up projection: one Triton kernel with the Triton kernels; on CPU in bf16
one pass of the C kernel (core/cpu_kernels/elementwise.c, the same roundings as torch's two ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.cpu_kernels import fused_elementwise_for, silu_and_mul
from kvforge.core.layers.backend import use_triton


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = None  # the Triton kernel, when the model is built with them
        if use_triton():
            from kvforge.core.kernels.fused import silu_and_mul

            self.fused = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        if x.dim() == 2 and x.stride(-1) == 1 and fused_elementwise_for(x):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
