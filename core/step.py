"""The scheduler's interface (core/scheduler.py): what one step runs (StepPlan of ScheduledSeq items, in plan order)
for the runner and the sampler, and what each sequence got from it (SeqUpdate)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvforge.core.request import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `num_new_tokens` positions from `num_computed_tokens` on (its drafts
    included). `samples`: the chunk reaches the sequence's end, so the step samples its next token(s)
    from 1 + drafts logits rows (the logits after its last token and after each draft)."""

    seq: Sequence
    num_new_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.samples = (not seq.pools
                        and seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + len(seq.spec_token_ids))

    @property
    def num_logits_rows(self) -> int:
        return 1 + len(self.seq.spec_token_ids) if self.samples else 0

    @property
    def prompt_logprob_span(self) -> tuple[int, int]:
        """[first, last) of the chunk's positions (0 = its first) whose logits give the next prompt token's
        logprob still to record (params.prompt_logprobs; a recomputed chunk after preemption records nothing
        twice); (0, 0) when none."""
        seq = self.seq
        if getattr(seq.params, "prompt_logprobs", None) is None:
            return 0, 0
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs))
        last = min(start + self.num_new_tokens, len(seq.prompt_token_ids) - 1)
        return (first - start, last - start) if last > first else (0, 0)


@dataclass
class StepPlan:
    """What one step runs (`scheduled`, in plan order) and who gets tokens from it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    forks: dict[tuple[str, int], list[Sequence]] = field(default_factory=dict)  # parent key -> samples forking off
    num_prompt_tokens: int = 0  # prompt positions computed in this step (the prefill rate)

    @property
    def sampled(self) -> list[ScheduledSeq]:
        """The items that get a next token; the runner returns their logits rows in this order."""
        return [item for item in self.scheduled if item.samples]

    @functools.cached_property  # read by the sampler and by update_from_output: laid out once, before drafts clear
    def sampling_rows(self) -> list[tuple[Sequence, list[int], Sequence | None]]:
        """Every sequence that gets tokens this step, with its rows of the runner's logits and the parent it
        forks off (None for the scheduled sequences): a forked sample draws from its parent's last row."""
        entries, row = [], 0
        for item in self.sampled:
            num_rows = item.num_logits_rows
            entries.append((item.seq, list(range(row, row + num_rows)), None))
            entries.extend((child, [row], item.seq) for child in self.forks.get(item.seq.key, []))
            row += num_rows
        return entries


@dataclass
class SeqUpdate:
    """One sequence's result of a step: how many tokens it appended and, when it finished, why."""

    seq: Sequence
    num_new_tokens: int
    finish_reason: str | None = None
    entry: int | None = None  # its entry in the step's sampled tokens (`StepPlan.sampling_rows`); None: pooled
