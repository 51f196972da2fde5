"""Token-budget continuous batching with chunked prefill, prefix caching and preemption.

Every step spends up to `max_num_batched_tokens` under `max_num_seqs`: running sequences first, in
arrival order (one token each when decoding -- 1 + k with k speculative draft tokens to verify -- the
next chunk when still prefilling), then waiting
sequences, first come first served. When the KV pool runs out, the running sequence that arrived
last is preempted: its blocks are freed (its full blocks stay in the prefix cache) and it is
recomputed later, producing the same tokens. Admission control rejects, before anything runs, a
request that could never fit the model's context or the whole KV pool.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from kvforge.core.kv.manager import KVCacheManager
from kvforge.core.request import Sequence, Status


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool)."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
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

    def add(self, seq: Sequence) -> None:
        self.check_admissible(len(seq.prompt_token_ids), seq.params.max_tokens)
        self._insert(self.waiting, seq)

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        keys = [s.arrival for s in queue]
        queue.insert(bisect.bisect_right(keys, seq.arrival), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. A decoding sequence with draft tokens verifies them in this step: it gets
        slots and budget for 1 + drafts tokens (drafts that do not fit are dropped, never preempting)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_token_ids:
                del seq.spec_token_ids[max(0, budget - pending):]
            while True:
                n = min(pending + len(seq.spec_token_ids), budget)
                if self.kv.allocate(seq, n):
                    break
                if seq.spec_token_ids:  # drop the drafts before taking anyone's blocks
                    seq.clear_drafts()
                    continue
                victim = self.running[-1]  # the latest arrival: possibly this very sequence
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                if seq.spec_draft_probs is not None:
                    seq.spec_draft_probs = seq.spec_draft_probs[:len(seq.spec_token_ids)]
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: everything after it already was too
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.monotonic()
        for item in out.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq)
            n = self.kv.admit(seq, hits, budget, on_disk=self.kv.match_persisted(seq, len(hits)))
            if n == 0:
                break  # not enough KV right now; it stays first in line (FCFS, no overtaking)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self._insert(self.running, seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.clear_drafts()
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set next to its parent."""
        seq.status = Status.RUNNING
        self._insert(self.running, seq)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._insert(self.waiting, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finish_time = time.monotonic()
        self.kv.free(seq)
