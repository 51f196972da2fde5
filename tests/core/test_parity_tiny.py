"""Greedy parity with HF transformers on tiny random-weight models of each architecture, built
from a config inside the test: block sizes 16 and 1, prompts whole or fed as several chunks."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from parity import compare, hf_greedy

NEW_TOKENS = 24
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3": LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False),
        "mistral": MistralConfig(**COMMON, sliding_window=16, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, embedded_path):
    """(model dir, HF model, prompts) for one architecture, with the embedded model's tokenizer."""
    from transformers import AutoModelForCausalLM

    config = _configs()[request.param]
    config.vocab_size = 49152
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / name, path / name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 63)]
    return request.param, path, model, prompts


@pytest.fixture(scope="module")
def hf_reference(tiny):
    name, _, model, prompts = tiny
    return hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_tiny_greedy_matches_hf(tiny, hf_reference, block_size, chunk):
    name, path, _, prompts = tiny
    llm = LLM(str(path), progress=False, block_size=block_size, num_kv_blocks=2048 // block_size,
              max_num_batched_tokens=chunk or 2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    report = compare([o.token_ids for o in outs], *hf_reference)
    print(name, block_size, chunk, report)
    assert report.exact >= len(prompts) - 1, report
    assert llm.engine.block_pool.num_used == 0
