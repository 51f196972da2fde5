"""Mixture-of-experts models (core/layers/moe.py) beyond the parity runs of tests/core/test_parity_tiny.py: batched
with preemption, each active expert computed once per step on all of its tokens and no other expert touched, and the
memory estimate counting every expert (tensor parallelism, OLMoE's included: tests/core/test_tp.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from kvforge.core import LLM, SamplingParams, cpu_kernels
from kvforge.core.layers.moe import SparseMoeBlock
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import random_prompts, save_tiny_model

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory, embedded_path):
    """A tiny Qwen2-MoE (8 experts, 2 a token, a shared expert, its second layer dense) and HF's greedy tokens."""
    path = tmp_path_factory.mktemp("qwen2_moe")
    model = save_tiny_model("qwen2_moe", path, embedded_path, seed=1234)
    prompts = random_prompts((3, 17, 40, 63, 9, 30), seed=11)
    return path, prompts, hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})


def test_a_batch_that_is_preempted_still_gives_hfs_tokens(qwen2_moe):
    path, prompts, reference = qwen2_moe
    llm = LLM(str(path), progress=False, dtype="float32", block_size=16, num_kv_blocks=12,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        assert llm.engine.stats().preemptions_total > 0
        report = compare([o.token_ids for o in outs], *reference)
        assert report.exact >= len(prompts) - 1, report
        assert llm.engine.block_pool.num_used == 0
    finally:
        llm.engine.close()


def test_each_routed_expert_runs_once_a_step_on_all_its_tokens_and_no_other_runs(qwen2_moe):
    """Forward hooks count the rows each expert computes per MoE block call: every expert that runs gets at least
    one row, the rows sum to tokens x 2 (each token's two experts), and an expert runs at most once per call; a
    one-token decode step runs 2 of the 8 experts."""
    path, prompts, _ = qwen2_moe
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=128)
    model = llm.engine.runner.model
    calls: list[tuple[int, Counter, Counter]] = []  # (tokens of the block call, rows per expert, runs per expert)

    def block_started(block, args):
        calls.append((args[0].shape[0], Counter(), Counter()))

    def expert_ran(index):
        def hook(expert, args, output):
            calls[-1][1][index] += args[0].shape[0]
            calls[-1][2][index] += 1
        return hook

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 1  # layer 1 is dense (mlp_only_layers)
    assert not llm.engine.runner.cuda_graph_safe  # the loop reads its expert counts on the host
    handles = [blocks[0].register_forward_pre_hook(block_started)]
    handles += [expert.register_forward_hook(expert_ran(i)) for i, expert in enumerate(blocks[0].experts)]
    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # alone: one-token decode steps
        llm.generate(prompts[1:3], SamplingParams(temperature=0, max_tokens=4))
    finally:
        for handle in handles:
            handle.remove()
        llm.engine.close()
    assert calls
    for tokens, rows, runs in calls:
        assert sum(rows.values()) == 2 * tokens and all(count >= 1 for count in rows.values())
        assert len(rows) <= min(8, 2 * tokens) and set(runs.values()) == {1}
    decode_steps = [rows for tokens, rows, _ in calls if tokens == 1]
    assert decode_steps and all(len(rows) == 2 for rows in decode_steps)


def test_the_router_reads_its_weight_in_place_on_cpu(qwen2_moe):
    """On CPU the router's logits come from the C kernel of float weights (its weight read in place), torch's
    logits to fp32 rounding; the engine's tokens are HF's (the preemption test above)."""
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the C kernels do not build here: {cpu_kernels.unavailable()}")
    path, _, _ = qwen2_moe
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=16)
    try:
        gate = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)).gate
        assert gate.float_segments is not None and gate.packed_weight is None
        x = torch.randn(5, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(gate(x), F.linear(x, gate.weight), rtol=1e-6, atol=1e-6)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
def test_the_memory_estimate_counts_every_expert(tmp_path, embedded_path, name):
    """core/estimate.py's parameter count (what `kvforge models`, the UI's estimate and the KV budget start from)
    equals the HF model's: every expert, the shared expert and its gate, the routers, OLMoE's whole-projection norms;
    the fp32 weights estimate is within 1% of what the loaded engine holds, its experts' share exactly the loaded
    placement's."""
    from kvforge.core.estimate import estimate_memory, parameter_count

    model = save_tiny_model(name, tmp_path, embedded_path, seed=1234)
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())
    llm = LLM(str(tmp_path), progress=False, dtype="float32", num_kv_blocks=16)
    try:
        held = llm.engine.runner.weight_bytes()
        (stage,) = llm.engine.runtime().stages
    finally:
        llm.engine.close()
    estimate = estimate_memory(model.config, "float32", 0)
    assert abs(estimate["weights_bytes"] - held) <= 0.01 * held, (estimate, held)
    assert estimate["experts_bytes"] == stage["experts_bytes"]  # what --cpu-experts moves, before loading


def test_experts_in_host_memory_give_the_same_tokens_and_are_placed_there(qwen2_moe, embedded_path):
    """cpu_experts (llama.cpp's --cpu-moe): every expert built on the CPU with the torch kernels and computed there,
    the rest on the device; with no GPU the device is the CPU too, so the same path runs and must give HF's tokens.
    The placement says where the experts live and what they weigh; a dense model has none to move."""
    from types import SimpleNamespace

    from kvforge.ui.dashboard import DashboardSampler, dashboard_markdown, human_bytes

    path, prompts, reference = qwen2_moe
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=64, cpu_experts=True)
    try:
        blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks and all(b.on_host and b.syncs_with_host for b in blocks)
        held = [t for b in blocks for t in b.experts.state_dict().values()]
        assert held and all(t.device.type == "cpu" for t in held)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        report = compare([o.token_ids for o in outs], *reference)
        assert report.exact >= len(prompts) - 1, report
        (stage,) = llm.engine.runtime().stages
        config = llm.engine.hf_config  # fp32 experts: gate, up and down of hidden x moe_intermediate_size each
        expert_bytes = len(blocks) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 4
        assert stage["experts_device"] == "cpu" and stage["experts_bytes"] == expert_bytes
        sampler = DashboardSampler(SimpleNamespace(engine=llm.engine, name="qwen2_moe"))
        text = dashboard_markdown(SimpleNamespace(latest_sample=sampler.sample, recent_ttfts=list))
        assert f"| Experts' weights | {human_bytes(expert_bytes)} on cpu |" in text
    finally:
        llm.engine.close()
    dense = LLM(str(embedded_path), progress=False, num_kv_blocks=8, cpu_experts=True)
    try:
        (stage,) = dense.engine.runtime().stages
        assert stage["experts_device"] is None and stage["experts_bytes"] == 0
    finally:
        dense.engine.close()
