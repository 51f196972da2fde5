"""The verifier (`sampler.sample_tokens`): whatever the drafts, the tokens it returns follow the target's
distribution. Small vocabulary, 25,000 verifications in one batch (50,000 for deterministic drafts, whose acceptance
rate is also compared), chi-square and total-variation bounds: a verifier that resamples from the target instead of
the residual is off by a total variation of 0.17-0.19 here, chi-square > 3,600 at 25,000 against a critical 24."""

from __future__ import annotations

import pytest
import torch

from kvforge.core.sampler import SamplingBatch, sample_tokens
from kvforge.core.sampling import SamplingParams

VOCAB = 8
TRIALS = 25_000
# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_CRITICAL = {2: 13.82, 7: 24.32}


def frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    counts, n = frequencies(tokens), len(tokens)
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was drawn"
    expected = probs.double()[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    critical = CHI2_CRITICAL[int(support.sum()) - 1]
    tv = 0.5 * float((counts / n - probs.double()).abs().sum())
    # sqrt(V / n) is 2.5x the largest expected TV of n exact samples (0.009 at n = 1e5, 0.018 at 25,000)
    assert chi2 < critical and tv < (VOCAB / n) ** 0.5, f"chi2 {chi2:.1f}, TV {tv:.4f} over {n} samples"


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target logits for 3 positions, and a draft distribution far from the target's for 2."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(3, VOCAB, generator=g) * 1.5
    draft = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, dim=-1)
    assert 0.5 * float((torch.softmax(target_logits[:2], -1) - draft).abs().sum(-1).min()) > 0.25
    return target_logits, torch.softmax(target_logits, dim=-1), draft


def run_verify(target_logits: torch.Tensor, drafts: list[list[int]], draft_probs: list | None, params=None):
    n = len(drafts)
    params = params or SamplingParams(temperature=1.0)
    logits = torch.cat([target_logits[:len(d) + 1] for d in drafts])
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    batch = SamplingBatch([params] * n, generators, [[0]] * n, [[]] * n, set(), drafts, draft_probs)
    return sample_tokens(logits, batch)


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_with_draft_probabilities_follows_the_target(seed):
    target_logits, target, draft = distributions(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    # drafts are drawn from the draft distribution, as a sampling drafter does
    d1 = torch.multinomial(draft[0], TRIALS, replacement=True, generator=g).tolist()
    d2 = torch.multinomial(draft[1], TRIALS, replacement=True, generator=g).tolist()
    out = run_verify(target_logits, [[a, b] for a, b in zip(d1, d2)], [draft] * TRIALS).token_ids
    assert_follows([t[0] for t in out], target[0])
    # the second token exists when the first draft was accepted; it follows the second position's target
    assert_follows([t[1] for t in out if len(t) > 1], target[1])
    accepted = sum(len(t) - 1 for t in out) / (2 * TRIALS)
    assert 0.2 < accepted < 0.9  # drafts are partly accepted: both branches were exercised
    assert all(len(t) <= 3 for t in out) and any(len(t) == 3 for t in out)  # bonus token when all accepted


def test_deterministic_drafts_follow_the_target():
    """A drafter without probabilities (n-gram, greedy draft): q is one-hot at the draft."""
    target_logits, target, _ = distributions(2)
    first = int(target[0].argmax())  # a likely draft, so that many second tokens are drawn
    trials = 2 * TRIALS  # the acceptance rate's standard error is then 0.0022: 0.01 is 4.5 of them
    out = run_verify(target_logits, [[first, 5]] * trials, None).token_ids
    assert_follows([t[0] for t in out], target[0])
    seconds = [t[1] for t in out if len(t) > 1]
    assert all(t[0] == first for t in out if len(t) > 1)
    assert_follows(seconds, target[1])
    assert len(seconds) / trials == pytest.approx(float(target[0, first]), abs=0.01)  # accepted with p(draft)


def test_processed_distribution_is_the_target():
    """Top-k and temperature apply to the target's distribution before verification."""
    target_logits, _, draft = distributions(3)
    params = SamplingParams(temperature=0.7, top_k=3)
    processed = torch.softmax(target_logits / 0.7, dim=-1)
    keep = processed.topk(3, dim=-1).indices
    masked = torch.zeros_like(processed).scatter_(1, keep, processed.gather(1, keep))
    masked /= masked.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(7)
    d1 = torch.multinomial(draft[0], TRIALS, replacement=True, generator=g).tolist()
    out = run_verify(target_logits, [[a] for a in d1], [draft[:1]] * TRIALS, params).token_ids
    assert_follows([t[0] for t in out], masked[0])
    assert all(t[0] in keep[0].tolist() for t in out)


def test_greedy_accepts_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    batch = SamplingBatch([greedy] * 2, [None, None], [[0], [0]], [[], []], set(), [[1, 0], []], None)
    rows = torch.cat([logits[:3], logits[3:]])
    out = sample_tokens(rows.clone(), batch)
    assert out.token_ids == [[1, 0, 2], [0]]  # both drafts accepted + bonus; a sequence without drafts
    batch.drafts = [[1, 2], []]
    assert sample_tokens(rows.clone(), batch).token_ids == [[1, 0], [0]]  # the second draft rejected: the argmax
