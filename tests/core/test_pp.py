"""Pipeline parallelism on real torch.distributed process groups (gloo, CPU): every stage (and every tensor-parallel
rank within one) is its own process.

PP = 2 and PP = 2 x TP = 2 must give one process's greedy tokens: on the embedded model (30 layers: 11 + 19, the LM
head counted on the first stage, where the logits are made) batched with the prefix cache hit on a second round, and
on tiny random models of the families (mixture-of-experts ones against HF transformers directly), chunked and
preempted with steps in flight.
Forked samples get their partial block copied on every stage; the persisted tier's whole blocks are gathered from
and handed to every stage. Failures: a split that cannot be made and speculative decoding are clear errors; a stage
that dies fails the engine (no hang); no process is left behind.
"""

from __future__ import annotations

import signal

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.distributed import stage_layers
from kvforge.core.estimate import estimate_memory
from kvforge.core.ranks import WorkerLost
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.processes import rank_processes
from tests.helpers.rank_runs import GREEDY, NEW_TOKENS, chat_prompts_of, greedy_rounds
from tests.helpers.tiny_models import random_prompts, save_tiny_model


@pytest.fixture(scope="module")
def chat_prompts(embedded_path):
    return chat_prompts_of(embedded_path)


@pytest.fixture(scope="module")
def one_process(embedded_llm):
    """One process, fp32: the reference (the session's embedded engine: the same model, dtype and kernels as a
    one-process engine built here; only its KV pool is larger)."""
    return embedded_llm


@pytest.fixture(scope="module")
def reference(one_process, chat_prompts):
    return [o.token_ids for o in one_process.generate(chat_prompts, GREEDY)]


def test_stages_split_the_work_not_only_the_layers(embedded_path):
    """The first stage's LM head (49k x 576) weighs 8 of the embedded model's 30 layers: 11 + 19 layers."""
    from kvforge.core.loader import load_config

    config = load_config(embedded_path)
    first, last = (stage_layers(config, 2, s) for s in range(2))
    assert (first.first, first.last, last.first, last.last) == (0, 11, 11, 30)
    assert first.is_first and not first.is_last and last.is_last
    thirds = [stage_layers(config, 3, s) for s in range(3)]
    assert [s.count for s in thirds] == [5, 12, 13] and thirds[-1].last == 30


def _assert_two_rounds_equal_one_process(rounds, stats, chat_prompts, reference) -> None:
    """Two rounds: the second hits the prefix cache (blocks computed by the first, on every stage)."""
    first, second = rounds
    assert first == reference and second == reference
    assert stats.cached_tokens_total >= sum(len(p) // 16 * 16 for p in chat_prompts)


def test_pipeline_x_tensor_parallel_equals_one_process_on_the_embedded_model(embedded_path, chat_prompts, reference):
    """PP = 2 x TP = 2 (PP = 2 alone: TestOnePP2EngineOfTheEmbeddedModel.test_pipeline_equals_one_process...)."""
    rounds, stats = greedy_rounds(embedded_path, chat_prompts, rounds=2, pp_size=2, tp_size=2)
    _assert_two_rounds_equal_one_process(rounds, stats, chat_prompts, reference)
    assert not rank_processes()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gemma2"])
def test_pp2_matches_hf_on_tiny_models(tmp_path_factory, embedded_path, arch):
    """One layer a stage, fp32, against HF transformers' greedy tokens: whole prompts, then 7-token chunks with a
    pool so small that sequences are preempted while other steps are in flight. The memory estimate's stages
    (core/estimate.py) are what each stage holds once loaded: its layers, its weights to 1%, its experts exactly."""
    path = tmp_path_factory.mktemp(arch)
    model = save_tiny_model(arch, path, embedded_path, seed=1234)
    prompts = random_prompts((1, 5, 17, 40, 63), seed=7)
    theirs = hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})
    for config in ({}, {"max_num_batched_tokens": 7, "num_kv_blocks": 24, "block_size": 4}):
        llm = LLM(str(path), progress=False, dtype="float32", pp_size=2, **{"kv_cache_bytes": 16 << 20, **config})
        try:
            outs = llm.generate(prompts, GREEDY)
            report = compare([o.token_ids for o in outs], *theirs)
            assert report.exact >= len(prompts) - 1, report
            assert llm.engine.stats().kv_blocks_used == 0
            if config:
                assert llm.engine.stats().preemptions_total > 0
            else:  # the memory estimate before loading splits the model as the stages hold it
                estimated = estimate_memory(model.config, "float32", 0, pp_size=2)["stages"]
                for guess, held in zip(estimated, llm.engine.runtime().stages, strict=True):
                    assert guess["layers"] == held["layers"]
                    assert abs(guess["weights_bytes"] - held["weights_bytes"]) <= 0.01 * held["weights_bytes"]
                    assert guess.get("experts_bytes", 0) == held["experts_bytes"]
        finally:
            llm.engine.close()
    assert not rank_processes()


@pytest.fixture(scope="class")
def pp2_llm(embedded_path):
    llm = LLM(str(embedded_path), progress=False, num_kv_blocks=64, pp_size=2, dtype="float32")
    yield llm
    llm.engine.close()
    assert not rank_processes()


class TestOnePP2EngineOfTheEmbeddedModel:
    """Checks that each need a two-stage engine of the embedded model and leave it as it was share one."""

    def test_pipeline_equals_one_process_on_the_embedded_model(self, pp2_llm, chat_prompts, reference):
        """First in the class: its first round is computed on the fresh engine, the second hits the prefix cache."""
        rounds = []
        for _ in range(2):
            rounds.append([o.token_ids for o in pp2_llm.generate(chat_prompts, GREEDY)])
            assert pp2_llm.engine.stats().kv_blocks_used == 0
        _assert_two_rounds_equal_one_process(rounds, pp2_llm.engine.stats(), chat_prompts, reference)

    def test_steps_stay_in_flight_on_different_sequences(self, pp2_llm, chat_prompts, reference):
        """While one step's last stage runs, the engine launches the next on the other sequences: two in flight,
        never a sequence in both. The prefix cache is emptied first: every prompt is computed again, as on a fresh
        engine."""
        engine = pp2_llm.engine
        engine.block_pool.reset_cache()
        depths, overlaps = [], []
        submit = engine.runner.submit

        def watched(batch):
            launched = {id(item.seq) for item in batch}
            overlaps.append(launched & engine._busy)
            depths.append(len(engine._in_flight) + 1)
            return submit(batch)

        engine.runner.submit = watched
        try:
            outs = pp2_llm.generate(chat_prompts, GREEDY)
        finally:
            engine.runner.submit = submit
        assert [o.token_ids for o in outs] == reference
        assert max(depths) == 2 and not any(overlaps)
        assert engine.stats().kv_blocks_used == 0

    def test_forked_samples_get_their_partial_block_copied_on_every_stage(self, one_process, pp2_llm,
                                                                          chat_prompts):
        params = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=11, max_tokens=16)
        samples = {}
        for name, llm in (("one", one_process), ("pp2", pp2_llm)):
            (outs,) = llm.generate([chat_prompts[1]], params)
            samples[name] = [o.token_ids for o in outs]
            assert llm.engine.stats().kv_blocks_used == 0
        assert len(chat_prompts[1]) % 16 and len({tuple(t) for t in samples["one"]}) > 1
        assert samples["pp2"] == samples["one"]

    def test_whole_blocks_are_gathered_from_and_handed_to_the_stages(self, pp2_llm):
        """The persisted tier's unit: a block of every layer (11 on stage 0, 19 on stage 1) and KV head."""
        runner = pp2_llm.engine.runner
        before = runner.read_block(5)
        assert before.shape == runner.kv_block_shape
        data = torch.randn(runner.kv_block_shape).to(runner.kv_dtype)
        runner.write_block(5, data)
        try:
            assert torch.equal(runner.read_block(5), data)
            assert not torch.equal(runner.read_block(4), data)
        finally:
            runner.write_block(5, before)

    def test_embeddings_are_pooled_by_the_last_stage(self, one_process, pp2_llm, chat_prompts):
        ours, theirs = pp2_llm.embed(chat_prompts[:2]), one_process.embed(chat_prompts[:2])
        assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-5)

    def test_weights_are_counted_over_every_stage(self, one_process, pp2_llm):
        assert pp2_llm.engine.runner.weight_bytes() == one_process.engine.runner.weight_bytes()

    def test_where_each_part_lives_is_told_stage_by_stage(self, one_process, pp2_llm):
        """The model card's and the dashboard's `stages`: each stage's layers, its parts, its weights and KV pool."""
        from types import SimpleNamespace

        from kvforge.ui.dashboard import DashboardSampler, dashboard_markdown

        first, last = pp2_llm.engine.runtime().stages
        assert (first["layers"], last["layers"]) == ([0, 11], [11, 30])
        assert first["embedding_and_lm_head"] and not first["final_norm"] and last["final_norm"]
        (whole,) = one_process.engine.runtime().stages
        assert first["weights_bytes"] + last["weights_bytes"] == whole["weights_bytes"]
        assert first["weights_bytes"] > last["weights_bytes"]  # the embedding and the LM head (tied, two copies)
        per_layer = whole["kv_cache_bytes"] / one_process.engine.block_pool.num_blocks / 30
        assert last["kv_cache_bytes"] == 19 * 64 * per_layer  # 64 blocks of 19 layers
        sampler = DashboardSampler(SimpleNamespace(engine=pp2_llm.engine, name="embedded"))
        text = dashboard_markdown(SimpleNamespace(latest_sample=sampler.sample, recent_ttfts=list))
        assert "| Stage 0: layers 0-10, embedding + LM head | cpu x 1" in text
        assert "| Stage 1: layers 11-29 | cpu x 1" in text


def test_persisted_kv_written_by_pp2_is_loaded_by_a_restarted_pp2_engine(embedded_path, chat_prompts,
                                                                          reference, tmp_path):
    persist = dict(persist_kv=True, data_dir=str(tmp_path), pp_size=2)
    (first,), stats = greedy_rounds(embedded_path, chat_prompts, **persist)
    assert first == reference and stats.kv_disk_blocks > 0
    (second,), stats = greedy_rounds(embedded_path, chat_prompts, **persist)
    assert second == reference
    assert stats.kv_disk_loaded_blocks_total >= sum(len(p) // 16 for p in chat_prompts) - len(chat_prompts)


def test_more_stages_than_layers_is_refused_and_leaves_no_process(tmp_path, embedded_path):
    save_tiny_model("llama3", tmp_path, embedded_path, seed=1)  # 2 layers
    with pytest.raises(ValueError, match="2 layers cannot be split into 3 pipeline stages"):
        LLM(str(tmp_path), progress=False, num_kv_blocks=8, pp_size=3)
    assert not rank_processes()


def test_speculative_decoding_is_refused_under_pp(embedded_path):
    with pytest.raises(ValueError, match="speculative decoding is not supported with pipeline parallelism"):
        LLM(str(embedded_path), progress=False, num_kv_blocks=8, pp_size=2, decoding="ngram")
    assert not rank_processes()


def test_a_stage_that_dies_fails_the_engine_instead_of_hanging(embedded_path, chat_prompts):
    llm = LLM(str(embedded_path), progress=False, num_kv_blocks=64, pp_size=2)
    try:
        (stage,) = rank_processes()
        stage.send_signal(signal.SIGKILL)
        stage.wait(timeout=30)
        with pytest.raises(WorkerLost):
            llm.generate(chat_prompts[:1], GREEDY)
        assert "pipeline rank 1" in llm.engine.failure() or "closed by peer" in llm.engine.failure()
    finally:
        llm.engine.close()
    assert not rank_processes()
