"""Logits -> next tokens, vectorised over the batch with per-request parameters.

Order (as in vLLM): penalties (repetition on prompt + output, presence / frequency on output) and
min_tokens masking -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sampling.
Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)) with one generator per
sequence, so a seeded request draws the same numbers whether it runs alone or in a batch.
Logprobs are those of the raw model distribution (log_softmax of the logits), like OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.core.sampling import SamplingParams


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    eos_ids: set[int]

    @property
    def size(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob, where the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]] | None]


@torch.inference_mode()
def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [batch.size, vocab] fp32 (modified in place)."""
    params = batch.params
    want_logprobs = [p.logprobs is not None for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    penalised = [i for i, p in enumerate(params) if p.uses_penalties]
    if penalised:
        _apply_penalties(logits, batch, penalised)
    for i, p in enumerate(params):
        if len(batch.output_ids[i]) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(batch.eos_ids))
            if banned:
                logits[i, banned] = float("-inf")

    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        sub = logits[rows] / torch.tensor([params[i].temperature for i in random_rows]).unsqueeze(1)
        sub = _apply_top_k_top_p(sub, [params[i] for i in random_rows])
        probs = torch.softmax(sub, dim=-1)
        min_p = torch.tensor([params[i].min_p for i in random_rows])
        if (min_p > 0).any():
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        race = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            race[j].exponential_(generator=batch.generators[i])
        race.clamp_min_(torch.finfo(race.dtype).tiny)  # q = 0 would make a masked token's 0/0 a NaN winner
        tokens[rows] = (probs / race).argmax(dim=-1)

    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * batch.size
    top: list[list[tuple[int, float]] | None] = [None] * batch.size
    if raw_logprobs is not None:
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            logprobs[i] = float(raw_logprobs[i, token_list[i]])
            if p.logprobs:
                values, ids = raw_logprobs[i].topk(p.logprobs)
                top[i] = list(zip(ids.tolist(), values.tolist()))
            else:
                top[i] = []
    return SamplerOutput(token_list, logprobs, top)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    vocab = logits.shape[1]
    for i in rows:  # penalised rows are rare; per-row bincount keeps memory at O(vocab)
        p = batch.params[i]
        row = logits[i]
        output = torch.tensor(batch.output_ids[i], dtype=torch.long)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
        if p.repetition_penalty != 1:
            seen = counts > 0
            prompt = torch.tensor(batch.prompt_ids[i], dtype=torch.long)
            seen[prompt[prompt < vocab]] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty:
            row.sub_(counts * p.frequency_penalty)
        if p.presence_penalty:
            row.sub_((counts > 0).to(row.dtype) * p.presence_penalty)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp(max=vocab)
    top_p = torch.tensor([float(p.top_p) for p in params])
    if bool((top_k >= vocab).all()) and bool((top_p >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass above it is < top_p
    beyond = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0) & (top_p < 1).unsqueeze(1)  # top_p = 1: off
    sorted_logits = sorted_logits.masked_fill(beyond, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
