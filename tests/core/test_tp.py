"""Tensor parallelism on real torch.distributed process groups (gloo, CPU): every rank is its own process.

TP = 2 must give the tokens TP = 1 gives: the embedded model (9 query / 3 KV heads: split 6 + 3 / 2 + 1),
tiny models of each architecture (one with fewer KV heads than ranks: replicated; mixture-of-experts ones, every
expert split like a dense MLP; OLMoE's whole-projection q/k norms over heads split or replicated), with the prefix cache
hit on a second round, with speculative decoding, with the persisted KV tier (blocks written by TP = 2,
loaded by a restarted TP = 2 engine), and quantized (bitsandbytes, GPTQ with and without act-order, AWQ).
Failures: a split that cannot be made is a clear error; a rank that dies makes the engine fail (no hang);
no process is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.tp import WorkerLost
from tests.helpers.processes import rank_processes
from tests.helpers.rank_runs import CHATS, GREEDY, NEW_TOKENS, chat_prompts_of, greedy_rounds
from tests.helpers.tiny_models import COMMON, random_prompts, save_tiny_model, tiny_configs


def _children() -> list[psutil.Process]:
    return rank_processes()


@pytest.fixture(scope="module")
def chat_prompts(embedded_path):
    return chat_prompts_of(embedded_path)


@pytest.fixture(scope="module")
def tp1_llm(embedded_llm):
    """One rank, fp32: the reference and the one-rank side of the forked samples (the session's embedded engine:
    the same model, dtype and kernels as a one-rank engine built here; only its KV pool is larger)."""
    return embedded_llm


@pytest.fixture(scope="module")
def reference(tp1_llm, chat_prompts):
    tokens = [o.token_ids for o in tp1_llm.generate(chat_prompts, GREEDY)]
    assert tp1_llm.engine.stats().kv_blocks_used == 0
    return tokens


def _assert_two_rounds_equal_tp1(rounds, stats, chat_prompts, reference) -> None:
    """Two rounds: the second hits the prefix cache (its prompts' blocks were computed by the first)."""
    first, second = rounds
    assert first == reference
    assert second == reference
    assert stats.cached_tokens_total >= sum(len(p) // 16 * 16 for p in chat_prompts)


@pytest.mark.parametrize("config", [
    {"decoding": "ngram", "decoding_options": {"min_n": 1}},
    {"decoding": "draft", "decoding_options": {"model": "embedded"}},
], ids=["ngram", "draft-model"])
def test_tp2_equals_tp1_on_the_embedded_model_with_speculation(embedded_path, chat_prompts, reference, config):
    """Without speculation: TestOneTP2EngineOfTheEmbeddedModel.test_tp2_equals_tp1_on_the_embedded_model."""
    if config.get("decoding") == "draft":
        config = {**config, "decoding_options": {"model": str(embedded_path)}}
    rounds, stats = greedy_rounds(embedded_path, chat_prompts, rounds=2, tp_size=2, **config)
    _assert_two_rounds_equal_tp1(rounds, stats, chat_prompts, reference)
    assert stats.spec_drafted_tokens_total > 0 and stats.spec_accepted_tokens_total > 0
    assert not _children()


def _tiny(tmp_path_factory, embedded_path, name: str, config=None) -> tuple:
    """A tiny random model of tests/helpers/tiny_models.py, or `config`'s, or one with a single KV head (fewer than
    the ranks, so each rank holds it and half of the query heads; OLMoE's k norm then spans a head both ranks hold);
    and its prompts."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp(name)
    if name == "llama-1-kv-head":
        config = LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False)
    elif name == "olmoe-1-kv-head":
        config = tiny_configs()["olmoe"]
        config.num_key_value_heads = 1
    save_tiny_model(name, path, embedded_path, seed=1234, config=config)
    return path, random_prompts((1, 5, 17, 40, 63), seed=7)


# what a split of each family's weights meets: qkv bias and tied embeddings (qwen2), per-head q/k norms and a head_dim
# of its own (qwen3), Gemma's model class, soft-capping and windows (gemma2), fused checkpoint tensors and a window
# (phi3), a replicated KV head, shared and routed experts, whole-projection q/k norms. Llama 3 (rope scaling) and
# Mistral (a window) add nothing here: each rank turns and windows its own heads exactly as one rank does (both are
# the Llama class with 2 KV heads, split 1 + 1 like qwen3's); test_parity_tiny / test_triton_engine run them.
TP_ARCHS = ["qwen2", "qwen3", "gemma2", "phi3", "llama-1-kv-head", "qwen2_moe", "mixtral",
            "olmoe", "olmoe-1-kv-head"]  # OLMoE: q/k norms over the whole projection, all-reduced


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_equals_tp1_on_tiny_models(tmp_path_factory, embedded_path, arch):
    """Embeddings too: rank 0 pools the hidden states every rank holds whole (to fp32 rounding of the sums)."""
    path, prompts = _tiny(tmp_path_factory, embedded_path, arch)
    embeddings: list[list[list[float]]] = [[], []]
    (tp1,), _ = greedy_rounds(path, prompts, embeddings=embeddings[0])
    (tp2, cached), stats = greedy_rounds(path, prompts, rounds=2, tp_size=2, max_num_batched_tokens=32,  # chunked
                                   embeddings=embeddings[1])
    assert tp2 == tp1 and cached == tp1
    assert stats.cached_tokens_total > 0
    assert torch.allclose(torch.tensor(embeddings[1]), torch.tensor(embeddings[0]), atol=1e-5)


@pytest.fixture(scope="class")
def tp2_llm(embedded_path):
    """A two-rank engine of the embedded model (fp32, 64 KV blocks a rank) for one class of tests, closed after it."""
    llm = LLM(str(embedded_path), progress=False, num_kv_blocks=64, tp_size=2, dtype="float32")
    yield llm
    llm.engine.close()
    assert not _children()


class TestOneTP2EngineOfTheEmbeddedModel:
    """Checks that each need a two-rank engine of the embedded model and leave it as it was share one."""

    def test_tp2_equals_tp1_on_the_embedded_model(self, tp2_llm, chat_prompts, reference):
        """First in the class: its first round is computed on the fresh engine, the second hits the prefix cache."""
        rounds = []
        for _ in range(2):
            rounds.append([o.token_ids for o in tp2_llm.generate(chat_prompts, GREEDY)])
            assert tp2_llm.engine.stats().kv_blocks_used == 0
        _assert_two_rounds_equal_tp1(rounds, tp2_llm.engine.stats(), chat_prompts, reference)

    def test_forked_samples_get_their_partial_block_copied_on_every_rank(self, tp1_llm, tp2_llm, chat_prompts):
        """n = 3 seeded samples fork at the prompt's end: each gets a copy of its partial last block, on every
        rank (a rank that skipped the copy would attend to another sample's KV)."""
        params = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=11, max_tokens=16)
        samples = {}
        for tp, llm in ((1, tp1_llm), (2, tp2_llm)):
            (outs,) = llm.generate([chat_prompts[1]], params)
            samples[tp] = [o.token_ids for o in outs]
            assert llm.engine.stats().kv_blocks_used == 0
        assert len(chat_prompts[1]) % 16 and len({tuple(t) for t in samples[1]}) > 1
        assert samples[2] == samples[1]

    def test_estimate_of_the_largest_rank_share_matches_rank_0(self, tp2_llm):
        """The settings panel's estimate for TP = 2: rank 0 (2 of the 3 KV heads) holds what it says."""
        from kvforge.core.estimate import estimate_memory

        runner = tp2_llm.engine.runner
        estimate = estimate_memory(tp2_llm.engine.hf_config, "float32", 64 * 16, tp_size=2)
        assert estimate["rank_kv_bytes"] == runner.kv_cache_bytes
        assert abs(estimate["rank_weights_bytes"] / runner.local.weight_bytes() - 1) < 0.02
        assert estimate["rank_total_bytes"] < 0.7 * estimate["total_bytes"]

    def test_whole_blocks_are_gathered_from_and_handed_to_the_ranks(self, tp2_llm):
        """The persisted tier's view of the pool: a block of every KV head, split unevenly (2 + 1 heads); what is
        written is read back exactly (a free block, put back as it was)."""
        _assert_whole_blocks_round_trip(tp2_llm.engine.runner)


def _assert_whole_blocks_round_trip(runner) -> None:
    before = runner.read_block(5)
    data = torch.randn(runner.kv_block_shape).to(runner.kv_dtype)
    runner.write_block(5, data)
    try:
        assert torch.equal(runner.read_block(5), data)
        assert not torch.equal(runner.read_block(4), data)
    finally:
        runner.write_block(5, before)


def test_whole_blocks_of_a_replicated_kv_head_are_gathered_and_handed_to_the_ranks(tmp_path_factory, embedded_path):
    """The same with a single KV head, replicated on both ranks."""
    path, _ = _tiny(tmp_path_factory, embedded_path, "llama-1-kv-head")
    llm = LLM(str(path), progress=False, num_kv_blocks=8, tp_size=2)
    try:
        _assert_whole_blocks_round_trip(llm.engine.runner)
    finally:
        llm.engine.close()


def test_persisted_kv_written_by_tp2_is_loaded_by_a_restarted_tp2_engine(embedded_path, chat_prompts,
                                                                          reference, tmp_path):
    persist = dict(persist_kv=True, data_dir=str(tmp_path), tp_size=2)
    (first,), stats = greedy_rounds(embedded_path, chat_prompts, **persist)
    assert first == reference and stats.kv_disk_blocks > 0
    (second,), stats = greedy_rounds(embedded_path, chat_prompts, **persist)
    assert second == reference
    assert stats.kv_disk_loaded_blocks_total >= sum(len(p) // 16 for p in chat_prompts) - len(chat_prompts)


# The quantized tests run a 2-layer random model with the embedded model's layer shapes (9 query / 3 KV heads of 64,
# hidden 576, intermediate 1536): each layer has every projection the ranks split (q / k / v and gate / up by output,
# o_proj's 384 + 192 and down_proj's 768 + 768 inputs), every layer quantized. What is tested is how the quantized
# shards are cut, not the weights: the embedded model's 30 layers cost two full loads and its decode steps per case.
QUANT_CONFIG = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
                    tie_word_embeddings=True)


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory, embedded_path):
    """The dense 2-layer model (embedded shapes, random weights) and its prompts: one with a partial last block."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("quant-dense")
    save_tiny_model("embedded-shapes", path, embedded_path, seed=21, config=LlamaConfig(**QUANT_CONFIG))
    return path, random_prompts((17, 40), seed=3)


@pytest.fixture(scope="module")
def quantized(quant_model, tmp_path_factory):
    """Round-to-nearest GPTQ / AWQ checkpoints of quant_model (its o_proj splits 384 + 192 inputs)."""
    from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint

    made = {}

    def get(name: str, **options):
        if name not in made:
            made[name] = write_rtn_checkpoint(quant_model[0], tmp_path_factory.mktemp(name), **options)
        return made[name]

    return get


BNB_FP32 = {"quant_options": {"compute_dtype": "float32"}}  # see test_quantized_tp2_equals_tp1


@pytest.mark.parametrize("case", ["bnb-nf4", "gptq-act-order", "gptq", "awq"])
def test_quantized_tp2_equals_tp1(quant_model, quantized, case):
    """bitsandbytes quantizes each rank's shard (nf4's 64-value blocks stay aligned); GPTQ / AWQ shards stay
    group-aligned (act-order keeps every group's scales on each rank; plain GPTQ renumbers a row shard's
    groups). Every matmul in fp32, bitsandbytes' too (its default compute dtype is bf16, whose rounding of the
    row-parallel partial sums flips near-ties of a random model). bnb-int8: TestBnbInt8OneRankAndTwo."""
    dense, prompts = quant_model
    if case.startswith("bnb"):
        path, config = dense, {"quant": case, **BNB_FP32}
    else:
        options = {"gptq-act-order": dict(method="gptq", group_size=64, sym=False, desc_act=True),
                   "gptq": dict(method="gptq", group_size=64, sym=True),
                   "awq": dict(method="awq", group_size=64, sym=False)}[case]
        path, config = quantized(case, **options), {"quant_options": {"kernel": "dequant"}}
    (tp1,), _ = greedy_rounds(path, prompts, **config)
    (tp2,), _ = greedy_rounds(path, prompts, tp_size=2, **config)
    assert tp2 == tp1


@pytest.fixture(scope="class")
def bnb_int8_engines(quant_model):
    """The dense 2-layer model quantized by bitsandbytes int8 on one rank and on two (fp32, as greedy_rounds builds
    them), for one class of tests, closed after it."""
    dense, _ = quant_model
    config = dict(progress=False, kv_cache_bytes=64 << 20, dtype="float32", quant="bnb-int8", **BNB_FP32)
    one = LLM(str(dense), **config)
    try:
        two = LLM(str(dense), tp_size=2, **config)
    except BaseException:
        one.engine.close()
        raise
    yield one, two
    two.engine.close()
    one.engine.close()
    assert not _children()


class TestBnbInt8OneRankAndTwo:
    """bitsandbytes int8 on one rank and on two: the tokens, and how the shards were cut; one pair of engines."""

    def test_quantized_tp2_equals_tp1(self, quant_model, bnb_int8_engines):
        """bnb-int8's case of test_quantized_tp2_equals_tp1, on the class's engines."""
        _, prompts = quant_model
        tokens = []
        for llm in bnb_int8_engines:
            tokens.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            assert llm.engine.stats().kv_blocks_used == 0
        assert tokens[1] == tokens[0]

    def test_bnb_int8_row_shards_take_the_whole_rows_scale(self, bnb_int8_engines):
        """A row-parallel layer's int8 scale is per output row: rank 0's share of o_proj (its first 384 of 576
        inputs) holds exactly the codes and scales of those columns of the one-rank layer."""
        def o_proj(llm):
            layer = llm.engine.runner.model.model.layers[1].self_attn.o_proj
            return layer.bnb_codes.clone(), layer.bnb_scb.clone()

        one, two = bnb_int8_engines
        codes, scb = o_proj(one)
        shard_codes, shard_scb = o_proj(two)
        assert codes.shape == (576, 576)
        assert torch.equal(shard_scb, scb)
        assert torch.equal(shard_codes, codes[:, :384])


def test_a_split_that_cannot_be_made_is_refused_and_leaves_no_process(embedded_path):
    with pytest.raises(ValueError, match="3 KV heads cannot be split across 4"):
        LLM(str(embedded_path), progress=False, num_kv_blocks=8, tp_size=4)
    assert not _children()


def test_group_size_that_a_rank_split_cannot_align_with_is_refused(tmp_path_factory, embedded_path):
    """down_proj's 192 inputs quantized in groups of 64 split into 96 per rank: not whole groups."""
    from transformers import LlamaConfig

    from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint

    config = LlamaConfig(hidden_size=128, intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    path, _ = _tiny(tmp_path_factory, embedded_path, "g64", config)
    quantized = write_rtn_checkpoint(path, tmp_path_factory.mktemp("g64-gptq"), method="gptq", group_size=64)
    with pytest.raises(ValueError, match="group size 64 does not divide the layer's 96 input features"):
        LLM(str(quantized), progress=False, num_kv_blocks=8, tp_size=2)
    assert not _children()


def test_draft_with_the_targets_own_layers_is_refused_under_tp(embedded_path):
    with pytest.raises(ValueError, match="split across the tensor-parallel ranks"):
        LLM(str(embedded_path), progress=False, num_kv_blocks=8, tp_size=2, decoding="draft",
            decoding_options={"layers": 4})
    assert not _children()


def test_a_rank_that_cannot_start_is_an_error_not_a_hang(embedded_path, monkeypatch):
    """The spawned rank's interpreter exits at once (here: `false` in place of python)."""
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    with pytest.raises(RuntimeError, match="rank 1 exited while starting"):
        LLM(str(embedded_path), progress=False, num_kv_blocks=8, tp_size=2)
    assert not _children()


def test_a_rank_that_dies_fails_the_engine_instead_of_hanging(embedded_path, chat_prompts):
    llm = LLM(str(embedded_path), progress=False, num_kv_blocks=64, tp_size=2)
    try:
        (worker,) = _children()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        with pytest.raises(WorkerLost):
            llm.generate(chat_prompts[:1], GREEDY)
        assert "rank 1" in llm.engine.failure() or "closed by peer" in llm.engine.failure()
    finally:
        llm.engine.close()
    assert not _children()


def test_two_processes_started_by_torchrun_over_tcp_rendezvous(embedded_path, reference, chat_prompts):
    """Multi-machine tensor parallelism, two local processes standing in for two hosts: each torchrun is one
    node (static rendezvous at the master address); rank 0 runs the command, rank 1 serves its commands."""
    from kvforge.app.http.threaded_server import free_port
    from kvforge.core.tokenizer import Tokenizer

    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                # fp32 as the reference (dtype auto is bf16 on a CPU with AMX)
                "-m", "kvforge.app.cli", "generate", "--model", str(embedded_path), "--dtype", "float32",
                "--temperature", "0",
                "--max-tokens", str(NEW_TOKENS), "--kv-cache-gb", "0.0625", "--chat", CHATS[0]]
        nodes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    expected = Tokenizer(embedded_path).decode(reference[0])
    assert outputs[0][0].strip() == expected.strip()
    assert outputs[1][0].strip() == ""  # rank 1 prints nothing: it only runs rank 0's forwards


def test_a_quantized_kv_pool_split_by_heads_gives_one_ranks_tokens(embedded_path, chat_prompts):
    """int8 rows (codes and a scale) split by KV heads like a full-precision pool: two ranks give one rank's tokens over
    the same format, the second round from the prefix cache. (q4 is not compared so: the ranks' sums round apart by
    fp32's last bits, and a 4-bit code that moves with them moved one of these prompts' 10th token, 0.27 nats apart.)"""
    (one,), _ = greedy_rounds(embedded_path, chat_prompts, kv_cache_dtype="int8")
    (first, second), stats = greedy_rounds(embedded_path, chat_prompts, rounds=2, tp_size=2, kv_cache_dtype="int8")
    assert first == one and second == one
    assert stats.cached_tokens_total > 0
    assert not _children()
