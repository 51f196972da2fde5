"""16 concurrent greedy requests of mixed lengths equal HF transformers token for token (near-tie
rule of tests/parity.py) under a tiny token budget (chunked prefill), a tiny KV pool (preemption),
prefix caching with a shared system prompt (hits happen and are reported), and prefix caching off."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from tests.helpers.parity import compare, hf_greedy

NEW_TOKENS = 24
SYSTEM = ("You are a meticulous assistant for a small engineering team. Answer in plain English, keep "
          "answers short, prefer concrete examples, and say so when you are not sure about a fact.")
QUESTIONS = [
    "Hi!", "What is 7 times 8?", "Name a fruit that is yellow.", "Why is the sky blue?",
    "Write a haiku about autumn leaves.", "Translate 'good morning' into French and Spanish.",
    "Explain recursion to a child in two sentences.", "List four planets of the solar system.",
    "What does HTTP stand for?", "Give me a tip for writing clean Python code.",
    "Summarise: " + "The meeting covered the budget, the hiring plan and the release schedule. " * 9,
    "Describe a cat in one sentence.", "Which is heavier, a kilogram of feathers or of iron?",
    "Write a SQL query that counts rows in a table named users.",
    "Continue the story: " + "The old lighthouse keeper climbed the stairs again that night. " * 4,
    "What is the boiling point of water at sea level in Celsius?",
]


@pytest.fixture(scope="module")
def prompts(embedded_llm):
    tok = embedded_llm.tokenizer
    ids = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
           for q in QUESTIONS]
    assert len(ids) == 16 and min(map(len, ids)) < 60 < 150 < max(map(len, ids))
    return ids


@pytest.fixture(scope="module")
def hf_reference(embedded_path, embedded_llm, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()
    tok = embedded_llm.tokenizer
    return hf_greedy(model, prompts, NEW_TOKENS, pad_id=tok.hf.pad_token_id or 0, eos_ids=tok.eos_token_ids)


CONFIGS = {
    "tiny-token-budget": dict(max_num_batched_tokens=24),
    "tiny-kv-pool": dict(num_kv_blocks=40),
    "prefix-caching": dict(max_num_batched_tokens=160),
    "no-prefix-caching": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_greedy_matches_hf(name, embedded_path, prompts, hf_reference):
    llm = LLM(str(embedded_path), progress=False, kv_cache_bytes=128 << 20, dtype="float32", **CONFIGS[name])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    report = compare([o.token_ids for o in outs], *hf_reference)
    stats = llm.engine.stats()
    print(name, report, f"preemptions={stats.preemptions_total} cached={stats.cached_tokens_total}")
    assert report.exact >= len(prompts) - 2, report  # the near-tie rule: at most one prompt in eight
    assert llm.engine.block_pool.num_used == 0 and not llm.engine.has_unfinished()
    cached = [o.num_cached_tokens for o in outs]
    if name == "tiny-kv-pool":
        assert stats.preemptions_total > 0
    if name == "prefix-caching":
        assert sum(cached) > 0 and stats.cached_tokens_total == sum(cached)
        assert all(c % 16 == 0 for c in cached)
    if name == "no-prefix-caching":
        assert sum(cached) == 0 and stats.kv_blocks_cached == 0
