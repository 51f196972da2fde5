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
