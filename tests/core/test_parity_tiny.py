"""Greedy parity with HF transformers on tiny random-weight models of each architecture, built
from a config inside the test: block sizes 16 and 1, prompts whole or fed as several chunks."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import random_prompts, save_tiny_model

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen3"])
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
