"""bf16 and fp16 run the embedded model. Stated tolerance: reduced precision changes rounding, so
tokens are not required to equal fp32 everywhere; on short factual prompts greedy answers must equal
the fp32 answers for at least 3 of 4 prompts, and the first token must always agree."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams

PROMPTS = ["What is the capital of France? Answer briefly.", "Name the largest planet in the solar system.",
           "What is 2 + 2? Answer with a number.", "Which language is spoken in Brazil?"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_matches_fp32_answers(embedded_llm, embedded_path, dtype):
    params = SamplingParams(temperature=0, max_tokens=12)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    reference = [o.token_ids for o in embedded_llm.chat(conversations, params)]
    llm = LLM(str(embedded_path), dtype=dtype, progress=False, kv_cache_bytes=64 << 20)
    assert llm.engine.runner.kv_cache.dtype == llm.engine.config.torch_dtype
    outs = llm.chat(conversations, params)
    assert "Paris" in outs[0].text
    assert all(o.token_ids[0] == r[0] for o, r in zip(outs, reference))
    assert sum(o.token_ids == r for o, r in zip(outs, reference)) >= 3
    assert llm.engine.block_pool.num_used == 0
