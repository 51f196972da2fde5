"""Greedy token ids equal HF transformers on the embedded model, 8 varied prompts in one batch."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import SamplingParams
from tests.helpers.parity import compare, hf_greedy

LONG = " ".join(
    f"Section {i}: the committee reviewed the budget, the schedule and the staffing plan, and asked for "
    "a revised estimate before the next meeting." for i in range(14))
PROMPTS = [
    "Hi!",
    "What is the capital of France? Answer briefly.",
    f"Summarise the following notes in one sentence.\n{LONG}",
    "把下面的句子翻译成英文：今天天气很好，我们去公园散步吧。",
    "Explain what this emoji sequence means: 🎉🚀🔥 and reply with emojis too 😀",
    "Write a Python function that returns the n-th Fibonacci number.\n```python\ndef fib(n):",
    "List three colours of the rainbow.",
    "Complete the JSON: {\"name\": \"Ada\", \"born\": 1815, \"known_for\": ",
]


@pytest.fixture(scope="module")
def hf_model(embedded_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()


def test_greedy_batch_matches_hf(embedded_llm, hf_model):
    tok = embedded_llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert max(map(len, prompts)) > 300
    outs = embedded_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    theirs, logits = hf_greedy(hf_model, prompts, 32, pad_id=tok.hf.pad_token_id or 0,
                               eos_ids=tok.eos_token_ids)
    report = compare([o.token_ids for o in outs], theirs, logits)
    print(report)
    assert report.exact >= len(PROMPTS) - 1, report
    assert embedded_llm.engine.block_pool.num_used == 0


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:]).view(-1, 1)).view(-1)


def test_prompt_logprobs_equal_hf_across_chunks_samples_and_cache_hits(embedded_path, hf_model):
    """Each prompt token's logprob given the ones before it (what lm-eval's loglikelihood reads through echo +
    logprobs), computed in the prompt's own chunked prefill: HF's fp32 values within 1e-4, for every sample of
    an n > 1 request, and again when the prefix cache holds the prompt (such a request computes it anew)."""
    from kvforge.core import LLM

    llm = LLM(str(embedded_path), progress=False, kv_cache_bytes=64 << 20, dtype="float32",
              max_num_batched_tokens=96)  # a 300-token prompt runs in 4 chunks, batched with the others
    tok = llm.tokenizer
    prompts = [tok.encode(text) for text in (f"Notes:\n{LONG}", PROMPTS[1], PROMPTS[3])]
    expected = [hf_prompt_logprobs(hf_model, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, n=2)
    for _ in range(2):  # the second time, every full block of each prompt is in the prefix cache
        for prompt, samples, want in zip(prompts, llm.generate(prompts, params), expected, strict=True):
            for sample in samples:
                got = sample.prompt_logprobs
                assert [t.token_id for t in got] == prompt[1:]
                assert torch.allclose(torch.tensor([t.logprob for t in got]), want, atol=1e-4)
                assert all(len(t.top) == 3 and t.top[0][1] >= t.logprob - 1e-5 for t in got)
                assert sample.num_cached_tokens == 0
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # the blocks were cached for others
    assert llm.engine.block_pool.num_used == 0
