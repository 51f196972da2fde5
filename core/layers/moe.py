"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top-k experts, and
the block's output is the experts' outputs weighted by the router's probabilities (plus, for Qwen2-MoE, a shared
expert behind a sigmoid gate).

Routing as the reference implementations route: softmax over all experts' logits in fp32, top-k, the k weights
renormalised to sum 1 where the model says so (`norm_topk_prob`; Mixtral always), cast to the hidden dtype.

Compute scales with the active experts, not all of them: the step's (token, slot) pairs are sorted by expert and each
expert that received tokens runs once, on all of its tokens (one gate_up and one down matmul per active expert per
step), its outputs weighted and added into their tokens' rows in expert order, as transformers adds them. Each
expert is an ordinary MLP of the model's linear layers, so quant methods (chosen by the expert's dotted name) and
tensor parallelism (each expert split like a dense MLP) apply to it as to any projection; the router stays dense.
Under tensor parallelism the experts' (and the shared expert's) partial outputs are summed on each rank and
all-reduced once per block, not once per expert. With the Triton kernels and dense experts, the experts' weights are
stacked once loaded and the block runs as two grouped GEMMs (core/kernels/fused_moe.py) instead of the loop.

A quant method may compute all of a layer's experts together (`stack_experts`): GGUF blocks run a decode step's
routed experts as two kernel calls (gate / up, down) instead of two per expert, each expert's outputs the same bits.

Experts in host memory (`cpu_experts`, llama.cpp's --cpu-moe): a model built inside `host_experts(True)` keeps every
expert's weights on the CPU, built with the torch (CPU) kernels, and computes them there: the routed rows go to the
host and their sum comes back, while the router, the shared expert, attention and the KV stay on the model's device.
The experts are most of a MoE model's bytes and few of its FLOPs per token (8 of 64 run), so the device holds the
rest; without a GPU the device is the CPU and the same path runs (the copies are no-ops).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from kvforge.core import cpu_kernels
from kvforge.core.layers.backend import fused_fp32_elementwise, kernel_backend, use_triton
from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.core.quant_config import dense_method

_building = threading.local()  # whether the MoE blocks being built keep their experts in host memory (per thread)
HOST = torch.device("cpu")


@contextmanager
def host_experts(enabled: bool) -> Iterator[None]:
    previous, _building.host = getattr(_building, "host", False), enabled
    try:
        yield
    finally:
        _building.host = previous


def moe_layout(config) -> tuple[int, int, int] | None:
    """(experts, experts per token, an expert's intermediate size) for a model with MoE layers; None for a dense one."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return None
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return experts, config.num_experts_per_tok, size


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has the MoE MLP (Qwen2 / Qwen3-MoE may keep some layers dense:
    `mlp_only_layers`, `decoder_sparse_step`), as transformers decides it."""
    if moe_layout(config) is None or layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer_idx + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def _c_bookkeeping(t: torch.Tensor) -> bool:
    """Whether the C kernels group and sum a step's pairs for tensors like `t` (CPU; else torch's ops)."""
    return t.device.type == "cpu" and t.dtype in cpu_kernels.DTYPE_CODES and cpu_kernels.unavailable() is None


def group_by_expert(experts: torch.Tensor, weights: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The step's (token, slot) pairs grouped by expert (a stable sort): each pair's token, its router weight, where
    each expert's pairs start [num_experts + 1], and the most pairs one expert has. On CPU one C pass (a decode step's
    ~10 torch ops took ~60 us a layer)."""
    if _c_bookkeeping(weights):
        return cpu_kernels.moe_group(experts, weights, num_experts)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return order // experts.shape[-1], weights.flatten()[order], starts, int(counts.max())


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """Each grouped pair's expert output times its weight, added into its token's row expert by expert as
    transformers adds them (one `index_add_` per expert: the product and each sum in y's dtype, where one call over
    every pair would sum in fp32 and round once)."""
    if _c_bookkeeping(y):
        return cpu_kernels.moe_combine(y, weights, tokens, num_tokens)
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    bounds = starts.tolist()
    for first, last in zip(bounds, bounds[1:]):
        if last > first:
            out.index_add_(0, tokens[first:last], y[first:last] * weights[first:last].unsqueeze(1))
    return out


class SparseMoeBlock(nn.Module):
    """`make_mlp(intermediate_size, prefix)` builds one expert (and the shared expert) as the model's dense MLP,
    its down projection not all-reduced (this block reduces their sum once)."""

    def __init__(self, config, dtype: torch.dtype, prefix: str, make_mlp: Callable[[int, str], nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k, size = moe_layout(config)
        # Mixtral's router always renormalises its top-k weights (its config has no such field)
        self.renormalize = bool(getattr(config, "norm_topk_prob", config.model_type == "mixtral"))
        self.gate = ReplicatedLinear(config.hidden_size, self.num_experts, quant_method=dense_method(),
                                     params_dtype=dtype, prefix=f"{prefix}.gate")
        self.on_host = getattr(_building, "host", False)  # the experts' weights and compute on the CPU
        if self.on_host:
            with torch.device(HOST), kernel_backend("torch", not fused_fp32_elementwise()):
                self.experts = nn.ModuleList(make_mlp(size, f"{prefix}.experts.{e}") for e in range(self.num_experts))
        else:
            self.experts = nn.ModuleList(make_mlp(size, f"{prefix}.experts.{e}") for e in range(self.num_experts))
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = make_mlp(shared, f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, quant_method=dense_method(),
                                                   params_dtype=dtype, prefix=f"{prefix}.shared_expert_gate") \
            if shared else None
        self.triton = use_triton() and not self.on_host
        self.w_gate_up = self.w_down = None  # the experts' weights stacked for the fused kernel (after_layers_loaded)
        self.stacked = None  # the quant method's kernel for all experts at once, where it has one (after_layers_loaded)

    def after_layers_loaded(self) -> None:
        """The quant method's kernel for all experts at once, where it has one (`stack_experts`). With the Triton
        kernels and dense experts (weights as loaded, [out, in] in the model dtype): stack them [E, 2I, H] and
        [E, H, I] for the fused grouped GEMMs, each expert's weights becoming views of them (one copy). Other
        quantized experts keep the loop (each through its own quant method)."""
        # the router: one small GEMV a layer a step, whose oneDNN call took ~50 us in a decode step of OLMoE-1B-7B
        # (Zen 5, 2 threads: the weight from memory, the call's own cost) where the C kernel reading it in place
        # takes ~25; the same fp32 sums rounded once to the dtype (a different order: equal bits in bf16 at one row)
        self.gate.quant_method.use_float_kernel(self.gate)
        gate_up, down = [e.gate_up_proj for e in self.experts], [e.down_proj for e in self.experts]
        method = gate_up[0].quant_method
        if hasattr(method, "stack_experts") and all(type(p.quant_method) is type(method) for p in gate_up + down):
            self.stacked = method.stack_experts(gate_up, down)
        if not self.triton or not all(p.quant_method.name == "none" and p.weight.dtype == p.compute_dtype
                                      and p.packed_weight is None and p.float_segments is None for p in gate_up + down):
            return
        self.w_gate_up = torch.stack([p.weight.data for p in gate_up])
        self.w_down = torch.stack([p.weight.data for p in down])
        for e, (first, second) in enumerate(zip(gate_up, down)):  # each expert's weights now views of the stacks
            first.weight.data = self.w_gate_up[e]
            second.weight.data = self.w_down[e]

    @property
    def syncs_with_host(self) -> bool:
        """The expert loop reads each expert's token count on the host: no CUDA graph can hold it."""
        return self.w_gate_up is None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [tokens, k] and their weights [tokens, k] (x's dtype)."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if self.w_gate_up is not None:
            from kvforge.core.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w_gate_up, self.w_down, experts, weights, self.experts[0].act)
            return self._with_shared_expert(x, out)
        device = x.device
        if self.on_host:  # the routed rows to the experts' memory; their weighted sum comes back
            x, experts, weights = x.to(HOST), experts.to(HOST), weights.to(HOST)
        # (token, slot) pairs grouped by expert, tokens in order within an expert
        tokens, sorted_weights, starts, widest = group_by_expert(experts, weights, self.num_experts)
        activations = self.stacked.takes(widest) if self.stacked is not None else None
        if activations is not None:  # every routed expert in one call per projection
            y = self.stacked(x, starts, tokens, self.experts[0].act, activations)
        else:  # each expert that received tokens once, on all of them
            y = x.new_empty(tokens.shape[0], x.shape[1])
            bounds = starts.tolist()
            for expert in range(self.num_experts):
                first, last = bounds[expert], bounds[expert + 1]
                if last > first:
                    y[first:last] = self.experts[expert](x[tokens[first:last]])
        out = weighted_sum(y, sorted_weights, tokens, starts, x.shape[0])
        return self._with_shared_expert(x.to(device), out.to(device))

    def _with_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum plus the shared expert's gated output, all-reduced once under TP."""
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        down = self.experts[0].down_proj
        if down.tp_size > 1:
            dist.all_reduce(out, group=down.tp_group)
        return out
