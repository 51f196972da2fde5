"""Logits -> next tokens, vectorised over the batch with per-request parameters.

Order (as in vLLM): penalties (repetition on prompt + output, presence / frequency on output), logit_bias,
the constraint's token mask (core/constraint.py), min_tokens masking -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> sampling.
Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)) with one generator per
sequence, so a seeded request draws the same numbers whether it runs alone or in a batch.
One entry for a step, `sample_tokens`: a token per sequence, or a sequence's accepted draft tokens plus one
(speculative decoding's verification: greedy fast path, rejection sampling).
Logprobs are those of the raw model distribution (log_softmax of the logits), like OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.core.constraint import apply_token_masks
from kvforge.core.sampling import SamplingParams


@dataclass
class SamplingBatch:
    """Per sequence. A sequence with m draft tokens owns m + 1 consecutive logits rows: the logits after
    its last token and after each draft (its output history extended by the drafts before that row)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    eos_ids: set[int]
    drafts: list[list[int]] | None = None  # speculative draft tokens to verify; None: none anywhere
    draft_probs: list[torch.Tensor | None] | None = None  # [drafts, vocab] of a drafter that samples
    # constrained decoding: the allowed tokens of every logits row (one bit per token, see
    # core/constraint.py) and the rows that have a constraint; None: no constraint in the batch
    token_bitmask: torch.Tensor | None = None
    masked_rows: list[int] | None = None

    @property
    def size(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob, where the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass
class StepTokens:
    """Per sequence: its accepted drafts followed by one token of the target's (a correction or a bonus)."""

    token_ids: list[list[int]]
    logprobs: list[list[float] | None]
    top_logprobs: list[list[list[tuple[int, float]]] | None]


@torch.inference_mode()
def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [batch.size, vocab] fp32 (modified in place); one new token per sequence."""
    out = sample_tokens(logits, batch)
    return SamplerOutput([t[0] for t in out.token_ids], [lp and lp[0] for lp in out.logprobs],
                         [top and top[0] for top in out.top_logprobs])


ARGMAX_CHUNKS = (1024, 512, 256, 128)  # the first that divides the vocabulary splits each row


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of a [rows, vocab] tensor, the same index (first of equal maxima, first NaN). On CPU
    through vectorised maxima per chunk of the row, then argmax in the one chunk that holds the row's first
    maximum: torch's CPU argmax does not vectorise (64 x 49152 fp32: 2.1 ms against 0.25, AMD EPYC Zen 5)."""
    rows, vocab = logits.shape
    chunk = next((c for c in ARGMAX_CHUNKS if vocab % c == 0 and vocab > c), None)
    if logits.device.type != "cpu" or chunk is None or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // chunk, chunk)
    first = chunks.amax(dim=-1).argmax(dim=-1)  # amax propagates NaN, as argmax ranks it first
    return first * chunk + chunks[torch.arange(rows), first].argmax(dim=-1)


@torch.inference_mode()
def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> StepTokens:
    """The step's tokens: each sequence's draft tokens accepted or rejected against the target's logits
    (modified in place), then one token of the target's, so that the tokens follow the target's
    distribution exactly.

    Greedy: drafts are accepted while they equal the argmax. Sampling: see `_rejection_sample`.
    A sequence without drafts gets one token, drawn as without speculation.
    """
    if logits.device.type != "cpu" and not all(p.greedy and not p.uses_penalties for p in batch.params):
        # sampling draws from per-request CPU generators and penalties count tokens on the host: run them on
        # the CPU; greedy batches (the argmax, min_tokens masks, logprobs) stay on the device
        logits = logits.cpu()
    drafts = batch.drafts or [[] for _ in range(batch.size)]
    starts, row_seq, row_outputs = [], [], []
    for s, seq_drafts in enumerate(drafts):
        starts.append(len(row_seq))
        for j in range(len(seq_drafts) + 1):
            row_seq.append(s)
            row_outputs.append(batch.output_ids[s] + seq_drafts[:j] if j else batch.output_ids[s])
    rows = SamplingBatch([batch.params[s] for s in row_seq], [batch.generators[s] for s in row_seq],
                         [batch.prompt_ids[s] for s in row_seq], row_outputs, batch.eos_ids)
    params = rows.params
    want_logprobs = any(p.logprobs is not None for p in batch.params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    penalised = [i for i, p in enumerate(params) if p.uses_penalties]
    if penalised:
        _apply_penalties(logits, rows, penalised)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    masked = set(batch.masked_rows or ())
    if masked:
        apply_token_masks(logits, batch.masked_rows, batch.token_bitmask)
    for i, p in enumerate(params):
        if len(rows.output_ids[i]) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(batch.eos_ids))
            if banned:
                kept = logits[i].clone() if i in masked else None
                logits[i, banned] = float("-inf")
                if kept is not None and bool(torch.isneginf(logits[i]).all()):
                    logits[i] = kept  # the constraint allows only an end: it wins over min_tokens

    argmax = argmax_rows(logits).tolist()
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    probs = sampling_probs(logits[random_rows], [params[i] for i in random_rows]) if random_rows else None
    prob_row = {row: j for j, row in enumerate(random_rows)}
    # one draw per sequence without drafts, in one batched race (each from its own generator)
    single = [i for i in random_rows if not drafts[row_seq[i]]]
    raced = {}
    if single:
        picked = probs[[prob_row[i] for i in single]]
        race = torch.empty_like(picked)
        for j, i in enumerate(single):
            race[j].exponential_(generator=rows.generators[i])
        raced = dict(zip(single, _race_winner(picked, race).tolist()))

    tokens: list[list[int]] = []
    for s, (start, seq_drafts) in enumerate(zip(starts, drafts)):
        if batch.params[s].greedy:
            accepted = 0
            while accepted < len(seq_drafts) and argmax[start + accepted] == seq_drafts[accepted]:
                accepted += 1
            tokens.append(argmax[start:start + accepted + 1])
        elif not seq_drafts:
            tokens.append([raced[start]])
        else:
            target = probs[prob_row[start]:prob_row[start] + len(seq_drafts) + 1]
            draft_probs = batch.draft_probs[s] if batch.draft_probs else None
            tokens.append(_rejection_sample(target, seq_drafts, draft_probs, batch.generators[s]))

    logprobs: list[list[float] | None] = [None] * batch.size
    top: list[list[list[tuple[int, float]]] | None] = [None] * batch.size
    if raw_logprobs is not None:
        for s, p in enumerate(batch.params):
            if p.logprobs is None:
                continue
            seq_rows = raw_logprobs[starts[s]:starts[s] + len(tokens[s])]
            logprobs[s] = [float(seq_rows[j, t]) for j, t in enumerate(tokens[s])]
            if p.logprobs:
                values, ids = seq_rows.topk(p.logprobs)
                top[s] = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                top[s] = [[] for _ in tokens[s]]
    return StepTokens(tokens, logprobs, top)


def _rejection_sample(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                      generator: torch.Generator | None) -> list[int]:
    """target: [m + 1, vocab] processed probabilities; draft_probs: [m, vocab] or None.

    With draft probabilities q (a drafter that samples): accept draft d with probability
    min(1, p(d) / q(d)); on rejection draw from normalize(max(0, p - q)) and stop; if all m are accepted
    draw a bonus token from the last row. Without them the drafts are deterministic (q is one-hot), where
    that rule is the same as drawing from p and accepting the draft if the draw equals it -- done here with
    the very draws sampling without speculation makes, so a seeded request gives the same tokens.
    """
    out = []
    for j, draft in enumerate(drafts):
        p = target[j]
        if draft_probs is None:
            token = draw(p, generator)
            out.append(token)
            if token != draft:
                return out
            continue
        q = draft_probs[j]
        u = float(torch.rand((), generator=generator))
        if p[draft] > 0 and u * q[draft] <= p[draft]:
            out.append(draft)
            continue
        residual = (p - q).clamp_min_(0)
        out.append(draw(residual if residual.sum() > 0 else p, generator))
        return out
    out.append(draw(target[len(drafts)], generator))
    return out


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to `weights` (unnormalised is fine)."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return int(_race_winner(weights.unsqueeze(0), race.unsqueeze(0))[0])


def _race_winner(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """argmax of p / q with q ~ Exp(1): a draw from p per row, with no host sync."""
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # q = 0 would make a masked token's 0/0 a NaN winner
    return argmax_rows(probs / race)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> softmax -> min-p: the distribution sampling draws from."""
    scaled = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = torch.softmax(_apply_top_k_top_p(scaled, params), dim=-1)
    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


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
