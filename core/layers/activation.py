"""SiLU-and-multiply over the fused gate_up projection: one Triton kernel with the Triton kernels; on CPU one pass
of the C kernel (core/cpu_kernels/elementwise.c): in bf16 with the same roundings as torch's two ops, in fp32 where
the model's linears are not exact anyway (core/layers/backend.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.cpu_kernels import fused_elementwise_for, silu_and_mul
from kvforge.core.layers.backend import fused_fp32_elementwise, use_triton


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = None  # the Triton kernel, when the model is built with them
        self.fp32_kernel = fused_fp32_elementwise()  # the C kernel in fp32 too
        if use_triton():
            from kvforge.core.kernels.fused import silu_and_mul

            self.fused = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        if x.dim() == 2 and x.stride(-1) == 1 and fused_elementwise_for(x, self.fp32_kernel):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
