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
all-reduced once per block, not once per expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.core.quant_config import dense_method


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
        self.experts = nn.ModuleList(make_mlp(size, f"{prefix}.experts.{e}") for e in range(self.num_experts))
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = make_mlp(shared, f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, quant_method=dense_method(),
                                                   params_dtype=dtype, prefix=f"{prefix}.shared_expert_gate") \
            if shared else None

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
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        sorted_weights = weights.flatten()[order].unsqueeze(1)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, self.experts[expert](x[rows]) * sorted_weights[start:start + count])
                start += count
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.experts[0].down_proj.tp_size > 1:
            dist.all_reduce(out)
        return out
