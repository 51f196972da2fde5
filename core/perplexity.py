"""Perplexity of a text under an engine's model, from the engine's teacher-forced log-probabilities
(`LLMEngine.prompt_logprobs`: chunked prefill on the engine's own KV pool, so it measures exactly what
serving runs: quantized layers, kernels, dtype). Used by the quantization accuracy tests and
`kvforge bench quant`."""

from __future__ import annotations

import math


def perplexity(engine, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given their prefixes. Call it while the
    engine is idle."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    log_probs = engine.prompt_logprobs(token_ids, chunk)
    return math.exp(-log_probs.double().sum().item() / (len(token_ids) - 1))
