"""Logits -> next tokens: greedy where temperature is 0, else seeded sampling per request."""

from __future__ import annotations

import torch

from kvforge.core.request import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [len(seqs), vocab] in fp32."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        if seq.params.greedy:
            continue
        probs = torch.softmax(logits[i] / seq.params.temperature, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens
