"""RMSNorm, with the residual add fused in (the decoder layer's add-then-normalise pattern); one Triton
kernel does both when the model is built with the Triton kernels, and on CPU one pass of the C kernel
(core/cpu_kernels/elementwise.c): in bf16 with the same roundings as the torch ops below, in fp32 where the
model's linears are not exact anyway (core/layers/backend.py). SplitRMSNorm: one over a vector the tensor-parallel
ranks each hold a slice of."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvforge.core.cpu_kernels import add_rms_norm, fused_elementwise_for
from kvforge.core.distributed import tp_group, tp_size
from kvforge.core.layers.backend import fused_fp32_elementwise, use_triton


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.fused = None  # the Triton kernel (norm and residual add in one), when the model is built with them
        self.fp32_kernel = fused_fp32_elementwise()  # the C kernel in fp32 too
        if use_triton():
            from kvforge.core.kernels.fused import rms_norm

            self.fused = rms_norm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; bit-identical to the reference in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The HF reference's order: normalise in fp32 (the fused kernel, bit-identical to its pow / mean / rsqrt),
        # cast, then scale.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.fused is not None:
            shape = x.shape  # the kernel takes rows; q/k norms get [tokens, heads, head_dim]
            if residual is None:
                return self.fused(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
            out, total = self.fused(x.reshape(-1, shape[-1]), self.weight, self.eps, residual.reshape(-1, shape[-1]))
            return out.view(shape), total.view(shape)
        if (x.dim() == 2 and x.is_contiguous() and (residual is None or residual.is_contiguous())
                and self.weight.dtype == x.dtype and fused_elementwise_for(x, self.fp32_kernel)):
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class SplitRMSNorm(RMSNorm):
    """RMSNorm over `size` values of which this rank holds [first, first + count) and that slice of the weight (OLMoE's
    q / k norm spans the whole projection, whose heads the ranks split): the sum of squares is all-reduced over the
    tensor-parallel ranks. `replicas`: how many ranks hold each value (a KV head replicated on several ranks), so that
    each counts once. On one rank it is RMSNorm."""

    def __init__(self, size: int, first: int, count: int, eps: float, dtype: torch.dtype, replicas: int = 1) -> None:
        super().__init__(count, eps, dtype)
        self.size, self.first, self.replicas = size, first, replicas
        self.tp_size, self.tp_group = tp_size(), tp_group()
        self.weight.weight_loader = self.weight_loader  # the checkpoint holds the whole weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.size,):
            raise ValueError(f"norm weight of shape {tuple(loaded.shape)} where ({self.size},) was expected")
        param.data.copy_(loaded.narrow(0, self.first, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        squares = x.float().square().sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.tp_group)
        # the reference's order: normalise in fp32, cast, then scale
        normed = x.float() * torch.rsqrt(squares / (self.size * self.replicas) + self.eps)
        return self.weight * normed.to(x.dtype)
