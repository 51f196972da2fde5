"""The Triton fused MoE (core/kernels/fused_moe.py), compiled on a GPU or interpreted on CPU: its grouping of pairs
by expert, and its two grouped GEMMs against the per-expert loop of core/layers/moe.py's CPU path (the same
routing, weights and activation), in fp32, fp16 and bf16, with experts that get no token, one, or more than a block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("triton_kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference(x, w_gate_up, w_down, experts, weights) -> torch.Tensor:
    """Each expert on its tokens, in fp32, weighted and added per token (the CPU path's arithmetic)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel():
            h = silu_and_mul(x[token].float() @ w_gate_up[e].float().T) @ w_down[e].float().T
            out.index_add_(0, token, h * weights[token, slot].float()[:, None])
    return out


def test_pairs_are_grouped_by_expert_in_padded_blocks():
    from kvforge.core.kernels.fused_moe import align_by_expert

    experts = torch.tensor([[2, 0], [2, 5], [0, 2]])  # expert 2 three times, 0 twice, 5 once; 1, 3, 4 never
    sorted_ids, block_experts = align_by_expert(experts, num_experts=6, block_m=4)
    pairs = experts.numel()
    blocks = sorted_ids.view(-1, 4).tolist()
    assert block_experts.tolist()[:3] == [0, 2, 5] and set(block_experts.tolist()[3:]) == {-1}
    assert blocks[0] == [1, 4, pairs, pairs] and blocks[1] == [0, 2, 5, pairs] and blocks[2] == [3, pairs, pairs, pairs]
    assert all(i == pairs for block in blocks[3:] for i in block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 21])
def test_fused_moe_equals_the_per_expert_loop(dtype, tokens):
    from kvforge.core.kernels.fused_moe import fused_moe

    torch.manual_seed(0)
    num_experts, top_k, hidden, inter = 6, 2, 48, 40  # sizes off the blocks' multiples: masked tails
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, device=DEVICE) * 0.2).to(dtype)
    logits = torch.randn(tokens, num_experts, device=DEVICE)
    logits[:, 5] = -1e9  # expert 5 never chosen
    weights, experts = torch.topk(torch.softmax(logits, -1), top_k)
    if tokens > 16:
        experts[:17, 0] = 1  # expert 1 gets more pairs than one block holds
    weights = weights.to(dtype)
    got = fused_moe(x, w_gate_up, w_down, experts, weights, silu_and_mul)
    expected = reference(x, w_gate_up, w_down, experts, weights)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_mismatched_shapes_are_refused():
    from kvforge.core.kernels.fused_moe import fused_moe

    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="w_gate_up .E, 2I, 16. and w_down"):
        fused_moe(x, torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 16, 5, device=DEVICE),
                  torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE), silu_and_mul)
