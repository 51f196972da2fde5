"""Gemma 3 270M (PyPI's Q4_K_M GGUF, a second real model): greedy token ids equal HF transformers (fp32, both
on the dense conversion of the file) on prompts in one batch, one longer than the 512-token sliding window; served
from the file's own blocks (the gguf plugin: Q5_0, Q8_0, Q4_K, Q6_K mixed) with the dense kernel the same tokens in
fp32, and by the blocks kernels (the default) close to fp32 by the top-5 rule with the perplexity within +3%."""

from __future__ import annotations

from importlib.resources import files

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.perplexity import perplexity
from tests.helpers.parity import compare, hf_greedy, logprobs_close

LONG = " ".join(f"Item {i}: the committee reviewed the budget and asked for a revised estimate." for i in range(50))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "A haiku about the sea:\n",
           f"{LONG}\nIn one sentence, the committee"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def gemma_dense(gemma_gguf_path):
    from kvforge.core.loader import convert_gguf

    return convert_gguf(gemma_gguf_path)


@pytest.fixture(scope="module")
def gemma_fp32(gemma_dense):
    return LLM(str(gemma_dense), progress=False, dtype="float32", kv_cache_bytes=128 << 20)


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def test_greedy_batch_matches_hf(gemma_dense, gemma_fp32):
    from transformers import AutoModelForCausalLM

    assert gemma_fp32.engine.config.quant == "none"
    prompts = _prompts(gemma_fp32)
    assert max(map(len, prompts)) > 512  # past the sliding window of the local layers
    hf = AutoModelForCausalLM.from_pretrained(gemma_dense, dtype=torch.float32).eval()
    tok = gemma_fp32.tokenizer
    theirs, logits = hf_greedy(hf, prompts, MAX_TOKENS, pad_id=tok.hf.pad_token_id or 0, eos_ids=tok.eos_token_ids)
    outs = gemma_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    report = compare([o.token_ids for o in outs], theirs, logits)
    print(report)
    assert report.exact >= len(PROMPTS) - 1, report


def _eval_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(files("kvforge.app.bench").joinpath("eval_text.txt").read_text())[:768]


def test_served_from_its_own_blocks(gemma_gguf_path, gemma_fp32):
    """With the dense kernel, fp32 gives the dense conversion's tokens; the default (the file's blocks read in place
    by the blocks kernels) is close to fp32 by the top-5 rule with the perplexity within +3%, in fp32 and in the
    default dtype."""
    from kvforge.core.config import resolve_dtype

    # the dense conversion's greedy tokens (logprobs change no token: they are read off the same logits)
    top = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    ref = gemma_fp32.generate(_prompts(gemma_fp32), top)
    reference = [o.token_ids for o in ref]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    dense32 = LLM(str(gemma_gguf_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20,
                  quant_options={"kernel": "dense"})
    assert dense32.engine.config.quant == "gguf"
    assert [o.token_ids for o in dense32.generate(_prompts(dense32), greedy)] == reference
    del dense32

    ref_ppl = perplexity(gemma_fp32.engine, _eval_ids(gemma_fp32))
    for dtype in dict.fromkeys(["float32", resolve_dtype("auto")]):
        native = LLM(str(gemma_gguf_path), progress=False, kv_cache_bytes=128 << 20, dtype=dtype)
        outs = native.generate(_prompts(native), top)
        diverged = [why for i, (a, b) in enumerate(zip(outs, ref))
                    if (why := logprobs_close(a.token_ids, [{t for t, _ in lp.top} for lp in a.logprobs], b.token_ids,
                                              [{t for t, _ in lp.top} for lp in b.logprobs], f"prompt {i}"))]
        ppl = perplexity(native.engine, _eval_ids(native))
        mib = [llm.engine.runtime().weight_bytes / 2**20 for llm in (native, gemma_fp32)]
        print(f"\ngemma blocks ({dtype}): perplexity {ppl:.3f} vs dense fp32 {ref_ppl:.3f}; weights "
              f"{mib[0]:.0f} MiB vs {mib[1]:.0f} MiB")
        assert not diverged, diverged
        assert ppl / ref_ppl <= 1.03
        del native
