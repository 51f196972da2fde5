"""Prompt-lookup drafting and the per-request speculation policy (adaptive k, pauses, batch-size cut-off)."""

from __future__ import annotations

import pytest

from kvforge.core.draft_target import EngineDraftTarget
from kvforge.core.plugins import DECODING_GROUP, discover
from kvforge.core.request import Sequence
from kvforge.core.sampling import SamplingParams
from kvforge.core.speculative import PAUSE_TOKENS, Speculator
from kvforge.plugins.decoding.ngram import NgramProposer, lookup

NO_TARGET = EngineDraftTarget(None, None, None, None, None)  # the n-gram proposer needs no model


def test_lookup_proposes_what_followed_the_latest_occurrence():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert lookup(tokens, 3, 2, 4) == [4, 5, 6]  # the latest earlier "1 2 3" is followed by 4 5 6
    assert lookup(tokens, 10, 2, 4) == [4, 5, 6, 7, 1, 2, 3]  # up to the end of the sequence
    assert lookup([5, 6, 7, 8, 6, 7], 2, 1, 3) == [8, 6]


def test_longest_ngram_wins_and_min_n_bounds_the_search():
    tokens = [7, 3, 100, 1, 3, 200, 1, 3]
    assert lookup(tokens, 1, 1, 2) == [200]  # "1 3" (n = 2) before "3" alone (n = 1, latest: 200 too)
    assert lookup([4, 3, 100, 9, 3], 1, 1, 2) == [100]  # only "3" matches: n = 1
    assert lookup([4, 3, 100, 9, 3], 1, 2, 2) == []  # min_n = 2: no match, no draft
    assert lookup([1], 3, 1, 3) == []
    assert lookup([2, 2, 2, 2], 3, 1, 2) == [2]  # overlapping occurrences end before the last token


def test_proposer_respects_each_sequences_budget():
    proposer = NgramProposer(NO_TARGET, min_n=1)
    seqs = [Sequence("a", [1, 2, 3, 4, 1, 2], SamplingParams()), Sequence("b", [8, 9], SamplingParams())]
    assert proposer.propose(seqs, [1, 4]) == [[3], []]
    assert "ngram" in discover(DECODING_GROUP).plugins and "draft" in discover(DECODING_GROUP).plugins


def make_decoding(n: int, max_tokens: int = 100) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=max_tokens))
        seq.output_token_ids = [3]
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    return seqs


def drafts_of(spec: Speculator, seqs: list[Sequence]) -> dict[tuple[str, int], list[int]]:
    """The drafts the speculator proposes for each sequence this step (none: no entry)."""
    return {seq.key: proposal.token_ids for seq, proposal in spec.propose(seqs)}


def test_ngram_shrinks_k_but_never_pauses():
    spec = Speculator("ngram", {"k": 5}, NO_TARGET)
    seq = make_decoding(1)[0]
    for _ in range(30):
        spec.record(seq, seq.spec_k or 5, 0)
    assert seq.spec_k == 1 and not seq.spec_paused_until
    assert len(drafts_of(spec, [seq])[seq.key]) == 1


def test_adaptive_k_follows_acceptance_and_pauses():
    spec = Speculator("ngram", {"k": 5}, NO_TARGET)
    spec.proposer.drafting_runs_a_model = True  # as a model drafter: low acceptance pauses drafting
    seq = make_decoding(1)[0]
    assert drafts_of(spec, [seq])[seq.key] == [1, 2, 3]  # "1 2 3" occurred at the start: what followed it
    assert seq.spec_k == 5
    spec.record(seq, 4, 1)
    assert seq.spec_k == 5  # one mostly rejected step: the moving rate is still high
    ks = []
    while not seq.spec_paused_until:  # drafts keep failing: k falls with the moving rate, then a pause
        spec.record(seq, 1, 0)
        ks.append(seq.spec_k)
        assert len(ks) < 20
    assert ks[0] == 5 and min(ks[:-1]) < 5 and ks == sorted(ks, reverse=True)
    assert seq.spec_paused_until == len(seq.output_token_ids) + PAUSE_TOKENS
    assert seq.key not in drafts_of(spec, [seq])
    seq.output_token_ids += [1, 2, 3] * PAUSE_TOKENS  # generated past the pause: drafting resumes, k below max
    seq.num_computed_tokens = seq.num_tokens - 1
    assert 0 < len(drafts_of(spec, [seq])[seq.key]) < 5
    for _ in range(5):
        spec.record(seq, seq.spec_k, seq.spec_k)
    assert seq.spec_k == 5  # fully accepted again: back to the maximum
    assert spec.totals["spec_verify_steps_total"] == seq.num_verify_steps and seq.num_drafted > seq.num_accepted


def test_drafts_stop_short_of_max_tokens_and_large_batches():
    spec = Speculator("ngram", {"k": 4, "max_batch_size": 2}, NO_TARGET)
    near_end = make_decoding(1, max_tokens=3)[0]  # 1 generated, 2 to go: one draft + one token of its own
    assert len(drafts_of(spec, [near_end])[near_end.key]) == 1
    batch = make_decoding(3)
    assert not drafts_of(spec, batch)  # 3 decoding sequences > max_batch_size 2
    assert len(drafts_of(spec, batch[:2])) == 2


def test_non_adaptive_k_stays():
    spec = Speculator("ngram", {"k": 3, "adaptive": False}, NO_TARGET)
    seq = make_decoding(1)[0]
    spec.propose([seq])
    for _ in range(10):
        spec.record(seq, 3, 0)
    assert len(drafts_of(spec, [seq])[seq.key]) == 3


def test_options_errors_name_the_option():
    with pytest.raises(ValueError, match="'min_n'"):
        NgramProposer(NO_TARGET, min_n=4, max_n=2)
    with pytest.raises(ValueError, match="'k'.*>= 1"):
        NgramProposer(NO_TARGET, k=0)
