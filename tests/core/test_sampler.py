"""The sampler on synthetic logits: filters never let a masked token through, sampling follows the
softmax (chi-square), greedy is argmax, seeds are batch-independent, penalties and min_tokens follow
their definitions exactly, and logprobs are those of the raw logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from kvforge.core.sampler import SamplingBatch, argmax_rows, sample
from kvforge.core.sampling import SamplingParams

EOS = 7


def make_batch(params, generators=None, prompt_ids=None, output_ids=None, eos_ids=None):
    n = len(params)
    return SamplingBatch(
        params=list(params),
        generators=list(generators) if generators is not None else [
            None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(params)],
        prompt_ids=list(prompt_ids) if prompt_ids is not None else [[] for _ in range(n)],
        output_ids=list(output_ids) if output_ids is not None else [[] for _ in range(n)],
        eos_ids=set(eos_ids) if eos_ids is not None else {EOS},
    )


def draw_many(logits_row, params: SamplingParams, rows: int, seed: int) -> list[int]:
    """`rows` independent draws for one distribution: one batch row per draw, each with its own generator."""
    logits = torch.as_tensor(logits_row, dtype=torch.float32).unsqueeze(0).repeat(rows, 1)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(rows)]
    return sample(logits, make_batch([params] * rows, gens, eos_ids=set())).token_ids


# --- independent reference for the filters ----------------------------------------------------

def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float,
                   eps: float = 1e-5) -> set[int]:
    """Tokens the filters may keep, from the definitions (float64; borderline cases within eps allowed).

    top-k: the k highest logits (any token tied with the k-th is allowed);
    top-p: after top-k, the smallest prefix by probability whose mass reaches top_p (the first always kept);
    min-p: probability >= min_p * the highest probability."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    vocab = len(x)
    order = np.argsort(-x, kind="stable")
    k = vocab if top_k <= 0 else min(top_k, vocab)
    kth = x[order[k - 1]]
    in_top_k = x >= kth
    # top-p over the top-k tokens (with ties at the k-th value, any of them may be the kept one: be lenient
    # by counting only the strictly-greater ones before a token plus the others at most)
    kept = np.zeros(vocab, dtype=bool)
    strict = order[:k]
    probs = np.exp(x[strict] - x[strict].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    for rank, token in enumerate(strict):
        if rank == 0 or mass_before[rank] < top_p + eps:
            kept[token] = True
    # tied tokens outside `strict` but at the same value as a kept one are allowed too
    for token in range(vocab):
        if in_top_k[token] and not kept[token]:
            if any(kept[t] and x[t] == x[token] for t in range(vocab)):
                kept[token] = True
    above_min_p = np.exp(x - x.max()) >= min_p * (1 - eps)
    return {t for t in range(vocab) if kept[t] and in_top_k[t] and above_min_p[t]}


# deterministic examples (no flaky CI), no example database written into the repository
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

distinct_logits = st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True).map(
    lambda xs: [v / 8 for v in xs])


@settings(max_examples=80, **SETTINGS)
@given(logits=distinct_logits,
       temperature=st.sampled_from([0.25, 0.7, 1.0, 2.0, 5.0]),
       top_k=st.integers(-1, 13),
       top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.3, 0.05]),
       min_p=st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9]),
       seed=st.integers(0, 2**31))
def test_sampled_token_is_never_filtered(logits, temperature, top_k, top_p, min_p, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = allowed_tokens(logits, temperature, top_k, top_p, min_p)
    assert allowed  # the most likely token always survives
    drawn = set(draw_many(logits, params, rows=200, seed=seed))
    assert drawn <= allowed, (drawn - allowed, allowed)


@settings(max_examples=40, **SETTINGS)
@given(logits=st.lists(st.integers(-4, 4), min_size=2, max_size=10).map(lambda xs: [v / 2 for v in xs]),
       top_k=st.integers(1, 10), seed=st.integers(0, 2**31))
def test_top_k_with_ties_keeps_only_the_k_highest_values(logits, top_k, seed):
    params = SamplingParams(temperature=3.0, top_k=top_k)
    allowed = allowed_tokens(logits, 3.0, top_k, 1.0, 0.0)
    drawn = draw_many(logits, params, rows=100, seed=seed)
    assert set(drawn) <= allowed
    kth = sorted(logits, reverse=True)[min(top_k, len(logits)) - 1]
    assert all(logits[t] >= kth for t in drawn)


@settings(max_examples=30, **SETTINGS)
@given(logits=distinct_logits, seed=st.integers(0, 2**31))
def test_filters_in_one_batch_do_not_leak_between_rows(logits, seed):
    """Rows with different filters in one batch: each row obeys its own filter only."""
    vocab = len(logits)
    params = [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0),
              SamplingParams(temperature=2.0, top_p=0.05), SamplingParams(temperature=2.0, min_p=0.9)]
    rows = 50
    batch_params = [p for p in params for _ in range(rows)]
    tensor = torch.tensor([logits] * len(batch_params), dtype=torch.float32)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(batch_params))]
    tokens = sample(tensor, make_batch(batch_params, gens, eos_ids=set())).token_ids
    best = max(range(vocab), key=logits.__getitem__)
    assert set(tokens[:rows]) == {best}
    assert set(tokens[2 * rows:3 * rows]) <= allowed_tokens(logits, 2.0, 0, 0.05, 0.0)
    assert set(tokens[3 * rows:]) <= allowed_tokens(logits, 2.0, 0, 1.0, 0.9)
    # the unfiltered row reaches beyond the top token when the distribution is flat enough
    probs = torch.softmax(torch.tensor(logits) / 2.0, dim=0)
    if float(probs.max()) < 0.5:
        assert len(set(tokens[rows:2 * rows])) > 1


# --- the sampled distribution ------------------------------------------------------------------

LOGITS8 = [1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.8, 1.0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_matches_softmax_chi_square(temperature):
    draws = 20000
    tokens = draw_many(LOGITS8, SamplingParams(temperature=temperature), rows=draws, seed=11)
    observed = np.bincount(tokens, minlength=len(LOGITS8))
    expected = torch.softmax(torch.tensor(LOGITS8, dtype=torch.float64) / temperature, dim=0).numpy() * draws
    result = chisquare(observed, expected)
    assert result.pvalue > 1e-3, (observed.tolist(), expected.round(1).tolist(), result)


def test_filtered_sampling_matches_the_renormalised_distribution():
    """top_k=4 then top_p=0.8 at temperature 1: the kept tokens are drawn in proportion to softmax."""
    draws = 20000
    tokens = draw_many(LOGITS8, SamplingParams(temperature=1.0, top_k=4, top_p=0.8), rows=draws, seed=5)
    probs = torch.softmax(torch.tensor(LOGITS8, dtype=torch.float64), dim=0).numpy()
    order = np.argsort(-probs)
    top4 = probs[order[:4]] / probs[order[:4]].sum()
    before = np.cumsum(top4) - top4
    kept = [int(t) for t, b in zip(order[:4], before) if b < 0.8]
    assert 1 < len(kept) < 4  # the filter really cuts here
    observed = np.bincount(tokens, minlength=len(LOGITS8))
    assert observed[[t for t in range(len(LOGITS8)) if t not in kept]].sum() == 0
    expected = probs[kept] / probs[kept].sum() * draws
    result = chisquare(observed[kept], expected)
    assert result.pvalue > 1e-3, (observed.tolist(), kept, expected, result)


# --- greedy and seeds --------------------------------------------------------------------------

def test_greedy_rows_are_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen) * 3
    params = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams(temperature=1.5, top_k=5)
              for i in range(16)]
    expected = logits.argmax(dim=-1).tolist()
    tokens = sample(logits.clone(), make_batch(params)).token_ids
    assert [tokens[i] for i in range(0, 16, 2)] == [expected[i] for i in range(0, 16, 2)]


def _seeded_run(logits_rows: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: int):
    """Several steps on the same rows, each row with its own generator kept across steps."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    out = [[] for _ in params]
    for _ in range(steps):
        tokens = sample(logits_rows.clone(), make_batch(params, gens, eos_ids=set())).token_ids
        for i, t in enumerate(tokens):
            out[i].append(t)
    return out


def test_same_seed_same_tokens_regardless_of_the_batch():
    torch.manual_seed(1)
    vocab = 40
    target = torch.randn(vocab) * 1.5
    params = SamplingParams(temperature=1.0)
    alone = _seeded_run(target.unsqueeze(0), [params], [1234], steps=12)[0]
    others = torch.randn(5, vocab) * 4
    batch_logits = torch.cat([others[:2], target.unsqueeze(0), others[2:]])
    batch_params = [SamplingParams(temperature=0), SamplingParams(temperature=0.3, top_k=3), params,
                    SamplingParams(temperature=2.0, top_p=0.5, min_p=0.1),
                    SamplingParams(temperature=1.0, repetition_penalty=1.3, logprobs=3),
                    SamplingParams(temperature=0.7)]
    in_batch = _seeded_run(batch_logits, batch_params, [None, 9, 1234, 10, 11, 1234], steps=12)
    assert in_batch[2] == alone
    assert in_batch[5] != alone  # same seed, other logits / temperature: a different stream of tokens
    assert len(set(alone)) > 1  # the draws really are random
    other_seed = _seeded_run(target.unsqueeze(0), [params], [4321], steps=12)[0]
    assert other_seed != alone


# --- penalties ---------------------------------------------------------------------------------

def greedy_pick(logits: list[float], prompt: list[int] = (), output: list[int] = (), eos_ids=(), **kwargs) -> int:
    params = SamplingParams(temperature=0, **kwargs)
    tensor = torch.tensor([logits], dtype=torch.float32)
    return sample(tensor, make_batch([params], [None], [list(prompt)], [list(output)], set(eos_ids))).token_ids[0]


@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_divides_positive_logits(where):
    seen = {"prompt": [0], "output": []} if where == "prompt" else {"prompt": [], "output": [0]}
    # token 0 at 3.0 seen, penalty 2 -> exactly 1.5: token 1 wins just above 1.5, loses just below
    assert greedy_pick([3.0, 1.5 + 1e-4, -9.0], *seen.values(), repetition_penalty=2.0) == 1
    assert greedy_pick([3.0, 1.5 - 1e-4, -9.0], *seen.values(), repetition_penalty=2.0) == 0
    # penalty 1.5 -> 2.0
    assert greedy_pick([3.0, 2.0 + 1e-4, -9.0], *seen.values(), repetition_penalty=1.5) == 1
    assert greedy_pick([3.0, 2.0 - 1e-4, -9.0], *seen.values(), repetition_penalty=1.5) == 0


@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_multiplies_negative_logits(where):
    seen = {"prompt": [0], "output": []} if where == "prompt" else {"prompt": [], "output": [0]}
    # token 0 at -1.0 seen, penalty 1.5 -> exactly -1.5; the rest are lower still, except token 1
    assert greedy_pick([-1.0, -1.5 + 1e-4, -9.0, -9.0], *seen.values(), repetition_penalty=1.5) == 1
    assert greedy_pick([-1.0, -1.5 - 1e-4, -9.0, -9.0], *seen.values(), repetition_penalty=1.5) == 0
    assert greedy_pick([-1.0, -1.0 - 1e-4, -9.0, -9.0], *seen.values()) == 0  # no penalty: 0 wins


def test_repetition_penalty_below_one_boosts_and_does_not_compound():
    # penalty 0.5 on a seen positive logit 1.0 -> 2.0 (once, however often it was seen)
    assert greedy_pick([1.0, 2.0 - 1e-4], [0, 0, 0], [0, 0], repetition_penalty=0.5) == 0
    assert greedy_pick([1.0, 2.0 + 1e-4], [0, 0, 0], [0, 0], repetition_penalty=0.5) == 1
    # only seen tokens are penalised: token 1 (unseen) keeps its 1.9 against token 0's 4.0 / 2 = 2.0
    assert greedy_pick([4.0, 1.9, 3.0], [0, 2], [], repetition_penalty=2.0) == 0
    assert greedy_pick([4.0, 1.9, 4.2], [0], [], repetition_penalty=2.0) == 2


def test_frequency_penalty_subtracts_count_times_penalty():
    output = [0, 0, 0, 2]  # token 0 three times: 1.0 - 3 f against token 1 at 0.7 -> flips at f = 0.1
    assert greedy_pick([1.0, 0.7, -9.0], [], output, frequency_penalty=0.099) == 0
    assert greedy_pick([1.0, 0.7, -9.0], [], output, frequency_penalty=0.101) == 1
    # negative: -(-0.2) * 3 = +0.6 for token 0 at 0.5 against token 1 at 1.1 -> flips at -0.2
    assert greedy_pick([0.5, 1.1, -9.0], [], output, frequency_penalty=-0.199) == 1
    assert greedy_pick([0.5, 1.1, -9.0], [], output, frequency_penalty=-0.201) == 0
    # prompt occurrences do not count
    assert greedy_pick([1.0, 0.7, -9.0], [0, 0, 0, 0], [], frequency_penalty=2.0) == 0


def test_presence_penalty_subtracts_once_per_seen_token():
    output = [0, 0, 0, 0, 0]  # the count does not matter: 1.0 - p against 0.7 flips at p = 0.3
    assert greedy_pick([1.0, 0.7], [], output, presence_penalty=0.29) == 0
    assert greedy_pick([1.0, 0.7], [], output, presence_penalty=0.31) == 1
    assert greedy_pick([1.0, 0.7], [], [0], presence_penalty=0.31) == 1
    assert greedy_pick([1.0, 0.7], [0, 0], [], presence_penalty=2.0) == 0  # prompt tokens do not count
    assert greedy_pick([0.5, 0.7], [], [0], presence_penalty=-0.19) == 1
    assert greedy_pick([0.5, 0.7], [], [0], presence_penalty=-0.21) == 0


def test_presence_and_frequency_penalties_add_up():
    # token 0 twice: 1.0 - 2 * 0.1 - 0.15 = 0.65 against 0.66 / 0.64
    assert greedy_pick([1.0, 0.66], [], [0, 0], frequency_penalty=0.1, presence_penalty=0.15) == 1
    assert greedy_pick([1.0, 0.64], [], [0, 0], frequency_penalty=0.1, presence_penalty=0.15) == 0


def test_penalties_only_touch_their_rows():
    logits = torch.tensor([[1.0, 0.7]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    tokens = sample(logits, make_batch(params, output_ids=[[0], [0]])).token_ids
    assert tokens == [1, 0]


# --- min_tokens --------------------------------------------------------------------------------

def test_min_tokens_masks_eos_until_enough_tokens():
    logits = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]  # EOS (7) is the best token
    for produced in range(4):
        expected = 1 if produced < 3 else EOS
        assert greedy_pick(logits, [], [3] * produced, eos_ids={EOS}, min_tokens=3, max_tokens=10) == expected
    # every id in eos_ids is masked
    assert greedy_pick([0.0, 1.0, 6.0, 0, 0, 0, 0, 5.0], [], [], eos_ids={2, EOS}, min_tokens=1) == 1


def test_min_tokens_masks_stop_token_ids_even_with_ignore_eos():
    logits = [0.0, 1.0, 0.0, 4.0, 0.0, 0.0, 0.0, 5.0]  # EOS 7 best, stop token 3 second
    kwargs = dict(eos_ids={EOS}, min_tokens=2, stop_token_ids=[3])
    assert greedy_pick(logits, [], [], **kwargs) == 1
    assert greedy_pick(logits, [], [1], **kwargs) == 1
    assert greedy_pick(logits, [], [1, 1], **kwargs) == EOS
    # ignore_eos: EOS is an ordinary token, but the stop token stays masked
    assert greedy_pick(logits, [], [], ignore_eos=True, **kwargs) == EOS
    assert greedy_pick([0.0, 1.0, 0.0, 4.0, 0, 0, 0, -1.0], [], [], ignore_eos=True, **kwargs) == 1
    assert greedy_pick(logits, [], [], **{**kwargs, "min_tokens": 0}) == EOS


def test_min_tokens_masks_eos_when_sampling():
    logits = [0.0, 0.5, 0.2, 0.0, -0.5, 0.1, 0.3, 3.0]  # EOS holds most of the mass
    rows = 300
    params = SamplingParams(temperature=1.0, min_tokens=2)
    tensor = torch.tensor([logits] * rows)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    tokens = sample(tensor, make_batch([params] * rows, gens, output_ids=[[1]] * rows)).token_ids
    assert EOS not in tokens
    assert len(set(tokens)) > 3
    tensor = torch.tensor([logits] * rows)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    tokens = sample(tensor, make_batch([params] * rows, gens, output_ids=[[1, 1]] * rows)).token_ids
    assert tokens.count(EOS) > rows // 2


# --- logprobs ----------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    gen = torch.Generator().manual_seed(3)
    vocab = 64
    raw = torch.randn(6, vocab, generator=gen) * 2
    reference = torch.log_softmax(raw.double(), dim=-1)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.6, top_k=10, logprobs=3),
        SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05, logprobs=0),
        SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=1.0, logprobs=20),
        SamplingParams(temperature=1.0),  # no logprobs
        SamplingParams(temperature=0, min_tokens=1, logprobs=1),
    ]
    outputs = [[], [], [], [int(raw[3].argmax()), 5], [], []]
    out = sample(raw.clone(), make_batch(params, output_ids=outputs, prompt_ids=[[1, 2]] * 6,
                                         eos_ids={int(raw[5].argmax())}))
    for i, p in enumerate(params):
        token = out.token_ids[i]
        if p.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        # the raw model distribution, not the penalised / tempered / filtered one
        assert abs(out.logprobs[i] - float(reference[i, token])) <= 1e-6
        top = out.top_logprobs[i]
        assert len(top) == p.logprobs
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        expected = reference[i].topk(p.logprobs)
        assert [t for t, _ in top] == expected.indices.tolist()
        assert all(abs(v - float(e)) <= 1e-6 for v, e in zip(values, expected.values))
    # row 5: min_tokens masked the argmax, yet its logprob is the raw one of the second-best token
    assert out.token_ids[5] == int(raw[5].topk(2).indices[1])


@pytest.mark.parametrize("vocab", [49152, 151936, 1000, 1024])
def test_argmax_rows_is_torch_argmax(vocab):
    """The chunked CPU argmax picks torch's index: the first of equal maxima, the first NaN, any -inf row."""
    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab)
    logits[1, [3, vocab // 2, vocab - 1]] = 50.0  # ties: the first wins
    logits[2, [vocab - 5, 7]] = float("nan")
    logits[3] = float("-inf")
    logits[4, vocab - 1] = 60.0
    logits[5] = logits[5].bfloat16().float()  # many exact ties among rounded values
    for x in (logits, logits.bfloat16(), logits[:, : vocab // 2 * 2][::2]):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
