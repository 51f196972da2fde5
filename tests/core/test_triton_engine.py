"""The whole engine on the Triton kernels (paged decode / prefill attention, fused norm, SiLU-mul, rotary,
KV store), run on CPU under TRITON_INTERPRET=1: greedy tokens equal the torch kernels' and HF transformers'
(fp32), with chunked prefill, mixed decode + prefill steps, prefix-cache hits, odd block sizes, sliding
windows and q/k norms, mixture-of-experts blocks through the fused MoE kernel; and the CUDA-graph decode path's
padded static buffers (run eagerly here) give the
same tokens as unpadded steps."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.layers.moe import SparseMoeBlock
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import random_prompts, save_tiny_model

# Each interpreted step is costly: 4 tokens still give decode steps beside chunked prefill (the 1- and 6-token prompts
# decode while the longer ones prefill in 7-token chunks) and decode-only steps after it; the speculative test drafts
# 3 tokens a step and needs more steps than that to see drafts both accepted and rejected.
NEW_TOKENS = 4
SPEC_TOKENS = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton engines: compiled on a GPU, else interpreted


pytestmark = pytest.mark.usefixtures("triton_kernels")  # compiled on a GPU, else interpreted


# what the Triton kernels meet, model by model: plain Llama attention and the rotary tables (llama3: its rope scaling
# is in the tables, made by torch), a head_dim of its own and q/k norms (qwen3), soft-capped scores in a window
# (gemma2), a window without caps and partial rotary dimensions (phi3), experts with and without a shared one. Mistral
# (a window without caps, as phi3's) and Qwen2 (biases and tied embeddings: torch's linears and embedding, not a
# Triton kernel) give the kernels nothing those do not: test_parity_tiny compares both with HF on the torch path.
MODELS = ["llama3", "qwen3", "gemma2", "phi3", "qwen2_moe", "mixtral"]
# prompts in one chunk on 16-token blocks: the same kernels as chunks on 5-token blocks (each model's own parts, its
# window, biases, norms, caps, rotary and experts, are run by the chunked case): a dense and a MoE model suffice
WHOLE_PROMPTS = ["llama3", "mixtral"]
# decode steps through the graphs' padded buckets: a plain model, one with a window and capped scores, a MoE one
GRAPH_MODELS = ["llama3", "gemma2", "qwen2_moe"]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request, tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, path, embedded_path, seed=4321)
    return path, model, random_prompts((1, 6, 17, 33), seed=11)


def _generate(path, prompts, rounds: int = 2, new_tokens: int = NEW_TOKENS,
              **config) -> tuple[LLM, list[list[list[int]]]]:
    """Greedy tokens of every round (later rounds hit the prefix cache); fp32 unless `config` says otherwise (the
    kernels must give the torch path's tokens and HF's exactly)."""
    llm = LLM(str(path), progress=False, **{"dtype": "float32", **config})
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    results = [[o.token_ids for o in llm.generate(prompts, params)] for _ in range(rounds)]
    assert llm.engine.block_pool.num_used == 0
    return llm, results


@pytest.mark.parametrize("tiny, block_size, chunk",
                         [pytest.param(m, 5, 7, id=f"{m}-chunked-bs5") for m in MODELS]
                         + [pytest.param(m, 16, 2048, id=f"{m}-whole") for m in WHOLE_PROMPTS], indirect=["tiny"])
def test_triton_kernels_give_the_torch_tokens(tiny, block_size, chunk):
    path, model, prompts = tiny
    common = dict(block_size=block_size, num_kv_blocks=400 // block_size, max_num_batched_tokens=chunk)
    llm, triton_runs = _generate(path, prompts, kernels="triton", device=DEVICE, **common)
    assert llm.engine.runner.kernels == "triton"
    assert all(block.w_gate_up is not None for block in llm.engine.runner.model.modules()
               if isinstance(block, SparseMoeBlock))  # the MoE models' experts run as the fused kernel's GEMMs
    assert llm.engine.runner.cuda_graph_safe  # (no host sync in them)
    assert llm.engine.stats().cached_tokens_total > 0  # the second round read cached prefix blocks
    _, torch_runs = _generate(path, prompts, kernels="torch", device=DEVICE, **common)
    assert triton_runs == torch_runs
    report = compare(triton_runs[0], *hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids=set()))
    assert report.exact >= len(prompts) - 1, report


@pytest.mark.parametrize("tiny", GRAPH_MODELS, indirect=True)
def test_decode_graph_buffers_give_the_eager_tokens(tiny):
    """Decode-only steps through DecodeGraphs' padded buckets (3 sequences run in the 4-bucket: one padded
    row with slot -1 and context length 0) equal the unpadded eager steps. One engine: eager first, then with the
    buckets enabled (its prompts' whole blocks then come from the prefix cache; the decode steps are all new)."""
    path, _, prompts = tiny
    llm = LLM(str(path), progress=False, dtype="float32", kernels="triton", device=DEVICE, num_kv_blocks=40,
              max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    eager = [o.token_ids for o in llm.generate(prompts[1:], params)]
    assert engine.runner.graphs is None
    engine.runner.enable_decode_graphs(engine.max_model_len, max_batch=8, capture=False)
    graphs = engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8]
    replays = []
    run = graphs.run
    graphs.run = lambda *args: replays.append(len(args[0])) or run(*args)
    padded = [o.token_ids for o in llm.generate(prompts[1:], params)]
    assert padded == eager
    assert 3 in replays  # decode steps of all three sequences went through the 4-row bucket
    assert engine.block_pool.num_used == 0


def test_embedded_model_on_triton_kernels_matches_hf(embedded_path):
    """The real model (30 layers, 9 query / 3 KV heads) on the Triton kernels: the HF greedy answer. An empty system
    prompt in place of the template's default one: 24 prompt tokens (two blocks) instead of 40, each interpreted."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(embedded_path), progress=False, kernels="triton", device=DEVICE, kv_cache_bytes=32 << 20,
              dtype="float32")
    messages = [{"role": "system", "content": ""},
                {"role": "user", "content": "What is the capital of France? Answer briefly."}]
    prompt = llm.tokenizer.apply_chat_template(messages)  # token ids
    new_tokens = 6  # "The capital of France is Paris"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens))[0]
    hf = AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()
    ids, _ = hf_greedy(hf, [prompt], new_tokens, pad_id=0, eos_ids={2})
    assert out.token_ids == ids[0]
    assert out.text.startswith("The capital of France is Paris")


def test_speculative_verification_on_triton_kernels(tmp_path, embedded_path):
    """A drafter made of the target's own first layer (built on the Triton kernels, with a KV pool of its own)
    proposes 3 tokens per step; they are verified as short chunks after a cached context (the prefill kernel)
    and the rejected ones rolled back: the tokens equal plain decoding on the same kernels (Mistral: sliding
    window 16)."""
    save_tiny_model("mistral", tmp_path, embedded_path, seed=99)
    prompts = random_prompts((5, 23), seed=5)
    common = dict(kernels="triton", device=DEVICE, num_kv_blocks=60)
    _, plain = _generate(tmp_path, prompts, rounds=1, new_tokens=SPEC_TOKENS, **common)
    llm, spec = _generate(tmp_path, prompts, rounds=1, new_tokens=SPEC_TOKENS, decoding="draft",
                          decoding_options={"layers": 1, "k": 3}, **common)
    assert spec == plain
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_drafted_tokens_total, stats  # some rejected


@pytest.mark.skipif(torch.cuda.is_available(), reason="tensor parallelism on the Triton kernels is checked on CPU")
def test_tensor_parallel_ranks_on_triton_kernels(tmp_path, embedded_path):
    """Two gloo ranks (each a process on the Triton kernels, interpreted) give the one-rank tokens: each rank's
    kernels see only its own heads (1 KV head of the tiny model's 2 on each rank)."""
    save_tiny_model("qwen2", tmp_path, embedded_path, seed=7)
    prompts = random_prompts((3, 18), seed=8)
    common = dict(kernels="triton", num_kv_blocks=40, max_num_batched_tokens=8)
    _, one_rank = _generate(tmp_path, prompts, rounds=1, **common)
    llm, two_ranks = _generate(tmp_path, prompts, rounds=1, tp_size=2, **common)
    try:
        assert two_ranks == one_rank
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "q4"])
def test_a_quantized_kv_pool_on_triton_kernels_gives_the_torch_kernels_tokens(tmp_path, embedded_path, kv_cache_dtype):
    """The Triton store quantizes as the C store does (the same bytes) and the Triton attention reads them as the
    paged C kernel does, so the two kernel sets give the same tokens over a quantized pool, chunked and from the
    prefix cache (q4's rows rotated in both: the layer rotates before either)."""
    save_tiny_model("qwen3", tmp_path, embedded_path, seed=4321)  # head_dim 32: one q4 group per row
    prompts = random_prompts((1, 6, 17, 33), seed=11)
    common = dict(block_size=5, num_kv_blocks=80, max_num_batched_tokens=7, kv_cache_dtype=kv_cache_dtype)
    llm, triton_runs = _generate(tmp_path, prompts, kernels="triton", device=DEVICE, **common)
    assert llm.engine.runner.kv_cache.dtype == torch.uint8
    assert llm.engine.stats().cached_tokens_total > 0
    _, torch_runs = _generate(tmp_path, prompts, kernels="torch", device=DEVICE, **common)
    assert triton_runs == torch_runs  # (HF's are full precision's: a random tiny model's 4-bit KV parts from them)


def test_a_gemma3_vision_model_on_triton_kernels_gives_hfs_tokens(tmp_path, embedded_path):
    """Gemma 3's image tokens attend to the whole image (the prefill kernel's key limits): pictures batched with a
    text prompt in 8-token chunks (an image's 16 tokens go in one), HF's greedy tokens."""
    from tests.helpers.tiny_models import save_tiny_gemma3_vision
    from tests.helpers.vision import TEXT_AFTER, hf_generate, hf_inputs, picture, prompt_of, user

    model, processor = save_tiny_gemma3_vision(tmp_path, embedded_path, seed=7)
    cases = [(user(processor, "<image>" + TEXT_AFTER), [picture(1, 60, 60)]),
             ("A text-only question about the weather in spring.", []),
             (user(processor, "<image> then <image>."), [picture(2, 33, 64), picture(3, 64, 64)])]
    llm = LLM(str(tmp_path), progress=False, dtype="float32", block_size=16, num_kv_blocks=32,
              max_num_batched_tokens=8, kernels="triton")
    try:
        outs = llm.generate([prompt_of(processor, text, pictures) for text, pictures in cases],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_generate(model, hf_inputs(processor, text, pictures), NEW_TOKENS)
                                               for text, pictures in cases]
    finally:
        llm.engine.close()
