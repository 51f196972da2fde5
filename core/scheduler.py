"""Token-budget continuous batching with chunked prefill, prefix caching and preemption, shared fairly between
client requests: the owner of every sequence's progress.

`schedule()` plans a step of up to `max_num_batched_tokens` tokens and `max_num_seqs` sequences: for each running
sequence one token when decoding (1 + k with k speculative draft tokens to verify) or the next chunk of its
prefill, then the first chunks of waiting sequences. When the KV pool runs out, the running sequence last in the
step's order is preempted: its blocks are freed (its full blocks stay in the prefix cache) and it is recomputed
later, producing the same tokens. Admission control rejects, before anything runs, a request that could never fit
the model's context or the whole KV pool.

Fair sharing. A client request may bring many sequences (an embeddings request one per input, an n-sample request
n samples): they form its group (`Sequence.share_group`), and the engine is shared between groups, not sequences,
so that one heavy request cannot starve a small chat beside it (vLLM v1 and llama.cpp's server serve sequences
first come first served: a 2048-input batch holds every slot until it is done):
- Tokens: each step's budget is split max-min fairly between the running groups and the waiting line (one more
  party): each gets what it asks for up to an equal share, and what the small ones leave goes to the others (a
  chat's decode token is always served, a lone request still gets the whole budget). Within a group, sequences are
  served in arrival order; the line's share goes to the newcomers in admission order (below), so requests that
  arrive together are prefilled first come first served and the later ones reuse the earlier ones' cached prefix.
- Slots: waiting sequences are admitted round-robin between groups, the group holding the fewest running
  sequences first (ties: the earliest arrival), first come first served within a group. A group waiting with no
  sequence running while every slot is taken gets one at the next step: the group holding the most slots, if it
  holds more than an equal share, gives up its latest arrival (preempted, as above).
- Preemption for KV: the step's order interleaves the groups (each group's first sequence, then each one's second,
  ...), so the sequence preempted when the pool runs out is the latest arrival of the group holding the most.
With one sequence per request all of this is first come first served, as before.

Steps in flight (pipeline parallelism, core/pp.py): the engine may plan a step while earlier ones still run. Their
sequences (`busy`) are left out of the new plan -- neither scheduled nor preempted -- and the new plan takes at most
`max_seqs` sequences, so the steps in flight share them. A sequence finished (aborted) while in flight is skipped when
its step's output is applied.

`update_from_output(plan, sampled)` applies what the step produced: computed tokens, accepted and
rejected drafts (rolled back in the KV), forks of n-sample requests at their prompt's end, new tokens (each
decoded into the sequence's own text, core/output.py, where stop strings are found), stop conditions and finishing.
Sequence progress (`num_computed_tokens`, drafts) changes only here.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING

from kvforge.core.kv.manager import KVCacheManager
from kvforge.core.repetition import RepetitionGuard
from kvforge.core.request import Sequence, Status
from kvforge.core.step import ScheduledSeq, SeqUpdate, StepPlan

if TYPE_CHECKING:
    from kvforge.core.sampler import StepTokens
    from kvforge.core.speculative import Speculator


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool)."""


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Collection[int] = (), speculator: Speculator | None = None) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.speculator = speculator
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self._forks: dict[tuple[str, int], list[Sequence]] = {}  # sample 0's key -> the samples forking off it
        self.num_preemptions = 0

    def check_admissible(self, prompt_len: int, max_tokens: int) -> None:
        total = prompt_len + max_tokens
        if prompt_len == 0:
            raise RequestRejected("prompt is empty")
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the "
                f"maximum context length of {self.max_model_len} tokens")
        blocks = -(-total // self.kv.block_size)
        if blocks > self.kv.pool.num_blocks:
            pool = self.kv.pool.num_blocks
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens needs {blocks} KV "
                f"blocks; the KV pool has only {pool} ({pool * self.kv.block_size} tokens)")

    def add(self, seq: Sequence, forks: Collection[Sequence] = ()) -> None:
        """Queue a request's first sample; `forks` (its other samples) fork off it once its prompt is computed. The
        engine has checked it (check_admissible, through LLMEngine.validate_prompt) before."""
        self._insert(self.waiting, seq)
        if forks:
            self._forks[seq.key] = list(forks)

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        keys = [s.arrival for s in queue]
        queue.insert(bisect.bisect_right(keys, seq.arrival), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- planning -----------------------------------------------------------------------------

    def schedule(self, busy: Collection[int] = (), max_seqs: int | None = None) -> StepPlan:
        """Pick this step's work. A decoding sequence with draft tokens verifies them in this step: it gets
        slots and budget for 1 + drafts tokens (drafts that do not fit are dropped, never preempting).
        `busy`: ids of the sequences in steps still in flight (left alone); `max_seqs`: this step's most sequences."""
        if self.speculator is not None:
            self._propose_drafts()
        plan = StepPlan()
        cap = self.max_num_seqs if max_seqs is None else max_seqs
        self._make_room(busy)
        newcomers = self._admission_order()
        shares = self._token_shares(newcomers, busy)
        budget = self.max_num_batched_tokens
        order = [seq for seq in self._interleaved() if id(seq) not in busy]
        i = 0
        while i < len(order) and budget > 0 and len(plan.scheduled) < cap:
            seq = order[i]
            limit = min(budget, shares[seq.share_group])
            if limit == 0:  # its group's share is spent: it waits for the next step
                seq.clear_drafts()
                i += 1
                continue
            pending = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_token_ids:
                del seq.spec_token_ids[max(0, limit - pending):]
            while True:
                n = min(pending + len(seq.spec_token_ids), limit)
                if pending > 1 and not seq.spec_token_ids:  # a prefill chunk: an image attended both ways goes whole
                    n = seq.chunk_end(seq.num_computed_tokens, seq.num_computed_tokens + n) - seq.num_computed_tokens
                if self.kv.allocate(seq, n):
                    break
                if seq.spec_token_ids:  # drop the drafts before taking anyone's blocks
                    seq.clear_drafts()
                    continue
                victim = order.pop()  # last in the step's order: possibly this very sequence
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                if seq.spec_draft_probs is not None:
                    seq.spec_draft_probs = seq.spec_draft_probs[:len(seq.spec_token_ids)]
                self._plan(plan, seq, n)
                budget -= n
                shares[seq.share_group] -= n
                i += 1
                continue
            break  # seq itself was preempted: everything after it already was too
        if not plan.preempted:
            self._admit_waiting(plan, newcomers[:max(0, cap - len(plan.scheduled))], budget, shares)
        now = time.monotonic()
        for item in plan.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return plan

    def _interleaved(self) -> list[Sequence]:
        """The running sequences in this step's order: each group's first (in arrival order), then each group's
        second, ...: the budget reaches every group early, and the last in line (preempted first) belongs to the
        group holding the most. One sequence per group: arrival order."""
        held: Counter[str] = Counter()
        ranked = []
        for seq in self.running:  # in arrival order
            ranked.append((held[seq.share_group], seq.arrival, len(ranked), seq))
            held[seq.share_group] += 1
        return [seq for *_, seq in sorted(ranked, key=lambda entry: entry[:3])]

    def _make_room(self, busy: Collection[int]) -> None:
        """A group waiting with no sequence running while every slot is taken gets a slot: the group holding the most
        slots, beyond an equal share, gives up its latest arrival (preempted: recomputed later, its full blocks kept
        in the prefix cache)."""
        held = Counter(seq.share_group for seq in self.running)
        newcomers = sum(1 for group in {seq.share_group for seq in self.waiting} if not held[group])
        if not newcomers:
            return
        fair = max(1, self.max_num_seqs // (len(held) + newcomers))
        while held and len(self.running) > self.max_num_seqs - min(newcomers, self.max_num_seqs):
            group, count = held.most_common(1)[0]
            if count <= fair:
                return
            idle = [s for s in self.running if s.share_group == group and id(s) not in busy]
            if not idle:  # its sequences are all in flight: the slot frees up at a later step
                return
            self._preempt(max(idle, key=lambda s: (s.arrival, s.index)))
            held[group] -= 1

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences that may take this step's free slots, in order: round-robin between groups, the
        group holding the fewest running sequences first (ties: the earliest arrival), arrival order within one."""
        free = self.max_num_seqs - len(self.running)
        if free <= 0 or not self.waiting:
            return []
        queues: dict[str, list[Sequence]] = {}
        for seq in self.waiting:  # in arrival order
            queues.setdefault(seq.share_group, []).append(seq)
        held = Counter(seq.share_group for seq in self.running)
        turns = [(held[group], queue[0].arrival, group) for group, queue in queues.items()]
        heapq.heapify(turns)
        taken: Counter[str] = Counter()
        order = []
        while turns and len(order) < free:
            count, _, group = heapq.heappop(turns)
            queue = queues[group]
            order.append(queue[taken[group]])
            taken[group] += 1
            if taken[group] < len(queue):
                heapq.heappush(turns, (count + 1, queue[taken[group]].arrival, group))
        return order

    def _token_shares(self, newcomers: list[Sequence], busy: Collection[int] = ()) -> Counter[str | None]:
        """Each running group's tokens of this step, and the waiting line's (key None: spent on the newcomers in
        admission order): the budget split max-min fairly by what each asks for (a newcomer: what the prefix cache
        does not hold of it)."""
        demand: Counter[str | None] = Counter()
        for seq in self.running:
            if id(seq) not in busy:
                demand[seq.share_group] += seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids)
        for seq in newcomers:
            cached = 0 if seq.needs_every_position else len(self.kv.match_prefix(seq)) * self.kv.block_size
            demand[None] += seq.num_tokens - cached
        shares: Counter[str | None] = Counter()
        left = self.max_num_batched_tokens
        ranked = sorted(demand.items(), key=lambda item: item[1])  # the smallest first: what they leave goes on
        for k, (group, wanted) in enumerate(ranked):
            shares[group] = min(wanted, left // (len(ranked) - k))
            left -= shares[group]
        return shares

    def _propose_drafts(self) -> None:
        """This step's draft tokens for the decoding sequences (none for those that should not draft)."""
        for seq in self.running:
            seq.clear_drafts()
        for seq, proposal in self.speculator.propose(self.running):
            seq.spec_token_ids = list(proposal.token_ids)
            seq.spec_draft_probs = proposal.probs
            if seq.grammar is not None:  # drafts the constraint forbids are never verified
                valid = seq.grammar.valid_drafts(seq.output_token_ids, seq.spec_token_ids)
                del seq.spec_token_ids[valid:]
                if seq.spec_draft_probs is not None:
                    seq.spec_draft_probs = seq.spec_draft_probs[:valid]

    def _plan(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        item = ScheduledSeq(seq, n)
        plan.scheduled.append(item)
        plan.num_prompt_tokens += max(0, min(n, len(seq.prompt_token_ids) - seq.num_computed_tokens))
        if item.samples and seq.key in self._forks:  # forks happen at a prompt's end
            plan.forks[seq.key] = self._forks.pop(seq.key)

    def _admit_waiting(self, plan: StepPlan, newcomers: list[Sequence], budget: int,
                       shares: Counter[str | None]) -> None:
        """Admit the newcomers in order while the waiting line's share of the budget lasts."""
        for seq in newcomers:
            limit = min(budget, shares[None])
            if limit <= 0:
                break
            if seq.needs_every_position:  # nothing of it can be taken from the cache
                n = self.kv.admit(seq, [], limit)
            else:
                hits = self.kv.match_prefix(seq)
                n = self.kv.admit(seq, hits, limit, on_disk=self.kv.match_persisted(seq, len(hits)))
            if n == 0:
                break  # not enough KV right now; it stays in line (no overtaking)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self._insert(self.running, seq)
            self._plan(plan, seq, n)
            budget -= n
            shares[None] -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.clear_drafts()
        seq.num_computed_tokens = 0
        seq.pooled = None  # recomputed from the start
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    # --- applying a step's output -------------------------------------------------------------

    def update_from_output(self, plan: StepPlan,
                           sampled: StepTokens | None) -> tuple[list[SeqUpdate], list[tuple[int, int]]]:
        """Apply a step that ran `plan` and sampled `sampled` (one entry per `plan.sampling_rows`).
        Returns each sampled sequence's update, in that order, then those of the embedding requests whose prompt
        is now computed (finished), and the KV blocks (source, destination) the
        runner must copy for the samples forked in this step."""
        pooled = []
        for item in plan.scheduled:  # draft positions count as computed only once accepted (below)
            seq = item.seq
            if seq.is_finished:  # aborted while its step was in flight
                continue
            seq.num_computed_tokens += item.num_new_tokens - len(seq.spec_token_ids)
            self.kv.cache_computed_blocks(seq)
            if seq.pools and seq.num_computed_tokens == seq.num_tokens:  # its whole prompt is pooled
                self.finish(seq, "stop")
                pooled.append(SeqUpdate(seq, 0, "stop"))
        if sampled is None:
            return pooled, []
        entries = plan.sampling_rows
        # Fork every sample before any token is processed: a parent that finishes on its first token (max_tokens
        # 1, EOS, a stop string) frees its blocks below, and its samples share or copy them.
        copies = []
        for seq, _, parent in entries:
            if parent is not None and not parent.is_finished:
                copies.extend(self._fork(parent, seq))
        now = time.monotonic()
        updates = []
        for entry, ((seq, _, _), tokens) in enumerate(zip(entries, sampled.token_ids)):
            if seq.is_finished:
                continue
            if seq.spec_token_ids:  # keep the accepted drafts' KV, roll back the rejected ones
                accepted = len(tokens) - 1
                self.speculator.record(seq, len(seq.spec_token_ids), accepted)
                seq.num_computed_tokens += accepted
                self.kv.truncate(seq, seq.num_computed_tokens)
                seq.clear_drafts()
            if seq.first_token_time is None:
                seq.first_token_time = now
            update = self._append(seq, tokens)
            update.entry = entry
            if len(tokens) > 1 and not seq.is_finished:
                self.kv.cache_computed_blocks(seq)
            updates.append(update)
        return updates + pooled, copies

    def _append(self, seq: Sequence, tokens: list[int]) -> SeqUpdate:
        """Append the step's tokens (several when drafts were accepted) up to the first stop; each is decoded into
        the sequence's text as it is appended (a stop token's text stays hidden), where a stop string ends it."""
        params = seq.params
        for count, token in enumerate(tokens, 1):
            seq.output_token_ids.append(token)
            is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
            generated = len(seq.output_token_ids)
            found_stop_string = seq.output_state is not None and seq.output_state.add_token(
                token, text_visible=not is_stop_token, num_output_tokens=generated)
            if seq.grammar is not None:
                seq.grammar.accept(token, seq.output_token_ids)
            reason = None
            if (is_stop_token and generated >= params.min_tokens) or found_stop_string:
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.finished:  # the constraint is complete
                reason = "stop"
            elif generated >= params.max_tokens:
                reason = "length"
            elif params.repetition_guard and self._looping(seq, token):
                reason = "repetition"
            if reason is not None:
                self.finish(seq, reason)
                return SeqUpdate(seq, count, reason)
        return SeqUpdate(seq, len(tokens))

    @staticmethod
    def _looping(seq: Sequence, token: int) -> bool:
        if seq.repetition is None:  # first token, or after a preemption or fork: start from the whole output
            seq.repetition = RepetitionGuard()
            for earlier in seq.output_token_ids[:-1]:
                seq.repetition.looping(earlier)
        return seq.repetition.looping(token)

    def _fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        child.num_cached_tokens = parent.num_cached_tokens
        child.prompt_logprobs = parent.prompt_logprobs  # one prompt, one prefill
        child.first_scheduled_time = parent.first_scheduled_time
        copies = self.kv.fork(parent, child)
        if copies is None:  # no block for its copy of the partial block: recompute it later
            child.status = Status.WAITING
            self._insert(self.waiting, child)
            return []
        child.status = Status.RUNNING  # it joins the running set next to its parent
        self._insert(self.running, child)
        return copies

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finish_time = time.monotonic()
        self._forks.pop(seq.key, None)  # samples that were still to fork off it finish with it
        self.kv.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
