"""Speculative decoding's policy in the engine: which decoding sequences get drafts this step and how
many (an adaptive k per request), asking the proposer plugin for them, and the acceptance counts.

Verification is the sampler's (`sampler.sample_tokens`); the scheduler sets each sequence's drafts, gives
it slots for 1 + k tokens and rolls back the rejected ones (`Scheduler.update_from_output`).
"""

from __future__ import annotations

from kvforge.core.plugins import DECODING_GROUP, DraftTarget, Proposal, Proposer, discover
from kvforge.core.request import Sequence

# Verifying k drafts costs little more than decoding one token where decoding is memory-bound (measured on
# CPU: 9 tokens cost ~1.3x one), so k stays at its maximum while drafts are often right, shrinks in
# proportion below FULL_K_ACCEPTANCE, and -- for a drafter that runs a model -- drafting pauses when they
# are mostly wrong. A drafter that runs none (n-gram) never pauses: a pause measurably misses the next
# copied span, and its wrong drafts cost only their verification.
FULL_K_ACCEPTANCE = 0.25  # moving acceptance rate from which a request drafts the full k
LOW_ACCEPTANCE = 0.1  # below this a request stops drafting for a while ...
PAUSE_TOKENS = 16  # ... for this many generated tokens, then retries with k at half its maximum
ACCEPTANCE_SMOOTHING = 0.3  # weight of the latest step in the moving average


class Speculator:
    def __init__(self, name: str, options: dict, target: DraftTarget) -> None:
        self.proposer: Proposer = discover(DECODING_GROUP).get(name)(target, **options)
        self.options = self.proposer.options
        self.k, self.adaptive = self.options["k"], self.options["adaptive"]
        self.max_batch_size = self.options["max_batch_size"]
        self.totals = dict(spec_drafted_tokens_total=0, spec_accepted_tokens_total=0, spec_verify_steps_total=0)

    def propose(self, running: list[Sequence]) -> list[tuple[Sequence, Proposal]]:
        """This step's drafts for the decoding sequences that should draft (the others get none), at most
        each one's k; the scheduler sets them."""
        decoding = [s for s in running if s.num_computed_tokens == s.num_tokens - 1]
        if len(decoding) > self.max_batch_size:
            return []
        wanted = [(seq, k) for seq in decoding if (k := self._num_drafts(seq)) > 0]
        if not wanted:
            return []
        drafts = []
        proposals = self.proposer.propose([seq for seq, _ in wanted], [k for _, k in wanted])
        for (seq, k), proposal in zip(wanted, proposals):
            if not isinstance(proposal, Proposal):
                proposal = Proposal(list(proposal))
            token_ids = list(proposal.token_ids[:k])
            if token_ids:
                probs = proposal.probs[:len(token_ids)] if proposal.probs is not None else None
                drafts.append((seq, Proposal(token_ids, probs)))
        return drafts

    def _num_drafts(self, seq: Sequence) -> int:
        if seq.spec_k is None:
            seq.spec_k = self.k
        generated = len(seq.output_token_ids)
        if generated < seq.spec_paused_until:
            return 0
        # a step yields at most drafts + 1 tokens; drafting past max_tokens is wasted work
        return max(0, min(seq.spec_k, seq.params.max_tokens - generated - 1))

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` drafts were taken. Adapts the request's k."""
        seq.num_drafted += drafted
        seq.num_accepted += accepted
        seq.num_verify_steps += 1
        self.totals["spec_drafted_tokens_total"] += drafted
        self.totals["spec_accepted_tokens_total"] += accepted
        self.totals["spec_verify_steps_total"] += 1
        if not self.adaptive:
            return
        seq.spec_acceptance += ACCEPTANCE_SMOOTHING * (accepted / drafted - seq.spec_acceptance)
        if seq.spec_acceptance < LOW_ACCEPTANCE and self.proposer.drafting_runs_a_model:
            seq.spec_paused_until = len(seq.output_token_ids) + PAUSE_TOKENS
            seq.spec_acceptance = FULL_K_ACCEPTANCE / 2
        share = min(1.0, seq.spec_acceptance / FULL_K_ACCEPTANCE)
        seq.spec_k = max(1, round(self.k * share))

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)


def spec_metrics(seq: Sequence) -> dict:
    """Per-request speculation counts: drafted, accepted, acceptance rate, mean tokens per verify step."""
    steps = seq.num_verify_steps
    return {
        "spec_drafted_tokens": seq.num_drafted,
        "spec_accepted_tokens": seq.num_accepted,
        "spec_acceptance_rate": seq.num_accepted / seq.num_drafted if seq.num_drafted else None,
        "spec_mean_accepted_length": (seq.num_accepted + steps) / steps if steps else None,
    }
