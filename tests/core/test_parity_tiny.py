"""Greedy parity with HF transformers on tiny random-weight models of each architecture (the mixture-of-experts
families included), built from a config inside the test: block sizes 16 and 1, prompts whole or fed as several
chunks."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import MOE_NAMES, phi3_config, random_prompts, save_tiny_model

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *MOE_NAMES])
def tiny(request, tmp_path_factory, embedded_path):
    """(model dir, HF model, prompts) for one architecture, with the embedded model's tokenizer."""
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, path, embedded_path, seed=1234)
    return request.param, path, model, random_prompts((1, 5, 17, 40, 63), seed=7)


@pytest.fixture(scope="module")
def hf_reference(tiny):
    name, _, model, prompts = tiny
    return hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_tiny_greedy_matches_hf(tiny, hf_reference, block_size, chunk):
    name, path, _, prompts = tiny
    llm = LLM(str(path), progress=False, block_size=block_size, num_kv_blocks=2048 // block_size,
              max_num_batched_tokens=chunk or 2048, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    report = compare([o.token_ids for o in outs], *hf_reference)
    print(name, block_size, chunk, report)
    assert report.exact >= len(prompts) - 1, report
    assert llm.engine.block_pool.num_used == 0


@pytest.mark.parametrize("attention", ["bmm", "paged"])
def test_soft_capped_attention_matches_hf_on_each_torch_path(tmp_path, embedded_path, attention):
    """Gemma 2's soft-capping through each decode variant that offers it: "bmm" (prefill chunks through the fp32
    math path) and "paged" (every row through the C kernel), chunked so later chunks attend to cached keys."""
    model = save_tiny_model("gemma2", tmp_path, embedded_path, seed=1234)
    prompts = random_prompts((1, 17, 40, 63), seed=7)
    llm = LLM(str(tmp_path), progress=False, num_kv_blocks=128, max_num_batched_tokens=23, dtype="float32",
              decode_attention=attention)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    report = compare([o.token_ids for o in outs], *hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2}))
    assert report.exact >= len(prompts) - 1, report


@pytest.mark.parametrize("factors", ["short", "long"])
def test_long_rope_factors_are_chosen_by_the_context_length(tmp_path, embedded_path, factors):
    """Long-rope with a 64-token original context: served with a context of 64 the short factors turn every token
    (as transformers does for sequences that stay within it); with the model's 512, the long ones do (as
    transformers does once a prompt passes 64 tokens): prompts of 65-100 tokens compare exactly."""
    model = save_tiny_model("phi3", tmp_path, embedded_path, seed=1234, config=phi3_config(original_context=64))
    new = 8 if factors == "short" else NEW_TOKENS
    lengths, context = ((1, 17, 40, 56), 64) if factors == "short" else ((65, 80, 100), None)
    prompts = random_prompts(lengths, seed=7)
    llm = LLM(str(tmp_path), progress=False, num_kv_blocks=128, max_num_batched_tokens=23, dtype="float32",
              max_model_len=context)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new))
    report = compare([o.token_ids for o in outs], *hf_greedy(model, prompts, new, pad_id=0, eos_ids={2}))
    assert report.exact >= len(prompts) - 1, report
