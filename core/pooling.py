"""Embedding requests: a prompt prefilled through the engine's batches without sampling; its embedding is the mean
of the model's last hidden states (after the final norm, what HF transformers calls `last_hidden_state`) over the
prompt's tokens, L2-normalised.

Every position's hidden state is needed, so such a request never starts from the prefix cache; its chunks' sums
are added up as its prefill goes (a preempted one starts its sum again with its recomputation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's settings. `n` and `max_tokens` keep the shape admission checks read."""

    normalize: bool = True  # L2-normalised (cosine similarity is then a dot product)
    n: ClassVar[int] = 1
    max_tokens: ClassVar[int] = 0  # nothing is generated: the prompt alone must fit the context
    logit_bias: ClassVar[None] = None
    constraint: ClassVar[None] = None


def pooled_embedding(hidden_sum: torch.Tensor, num_tokens: int, normalize: bool) -> list[float]:
    """The mean of `num_tokens` hidden states from their fp32 sum, optionally L2-normalised."""
    mean = hidden_sum / num_tokens
    if normalize:
        mean = torch.nn.functional.normalize(mean, dim=-1)
    return mean.tolist()
