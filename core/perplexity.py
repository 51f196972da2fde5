"""Perplexity of a text under an engine's model: teacher-forced, chunked prefill on the engine's own
KV pool, so it measures exactly what serving runs (quantized layers, kernels, dtype). Used by the
quantization accuracy tests and `kvforge bench quant`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvforge.core.request import Sequence
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import ScheduledSeq


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given their prefixes. Call it while the
    engine is idle (it borrows KV blocks between steps and frees them)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens exceed the model's context of {engine.max_model_len}")
    runner = engine.runner
    seq = Sequence("perplexity", list(token_ids), SamplingParams(max_tokens=1))
    targets = torch.tensor(token_ids[1:], dtype=torch.long)
    total = 0.0
    try:
        for start in range(0, len(token_ids) - 1, chunk):
            n = min(chunk, len(token_ids) - 1 - start)
            if not engine.kv.allocate(seq, n):
                raise ValueError("the text does not fit in the free KV pool")
            inputs = runner.layout([ScheduledSeq(seq, n)], all_logits=True)
            logits = runner.forward(inputs)
            log_probs = F.log_softmax(logits, dim=-1)
            total -= log_probs.gather(1, targets[start:start + n].view(-1, 1).to(logits.device)).sum().item()
            seq.num_computed_tokens += n
    finally:
        engine.kv.free(seq)
    return math.exp(total / (len(token_ids) - 1))
