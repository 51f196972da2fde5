"""A small first-come-first-served scheduler (replaced by the full continuous-batching one later).

Each step spends a token budget: one token for every sequence that is decoding, then prefill
chunks for the others, oldest first, so a long prompt is fed over several steps. A sequence is
admitted only when the pool can hold all of its KV (prompt + max_tokens), so no running sequence
ever runs out of blocks and nothing needs preempting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvforge.core.kv.blocks import BlockPool
from kvforge.core.request import Sequence, Status


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool)."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.pool, self.block_size = pool, block_size
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def blocks_needed(self, seq: Sequence) -> int:
        return -(-(len(seq.prompt_token_ids) + seq.params.max_tokens) // self.block_size)

    def check_admissible(self, seq: Sequence) -> None:
        total = len(seq.prompt_token_ids) + seq.params.max_tokens
        if not seq.prompt_token_ids:
            raise RequestRejected("prompt is empty")
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.params.max_tokens}) = {total} "
                f"exceeds the model's maximum context length of {self.max_model_len} tokens")
        if self.blocks_needed(seq) > self.pool.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens needs {self.blocks_needed(seq)} KV blocks; "
                f"the KV pool has only {self.pool.num_blocks}")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self.blocks_needed(self.waiting[0]) <= self.pool.num_free):
            seq = self.waiting.popleft()
            seq.block_table = self.pool.allocate(self.blocks_needed(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        decoding = [s for s in self.running if s.num_computed_tokens >= len(s.prompt_token_ids)]
        prefilling = [s for s in self.running if s.num_computed_tokens < len(s.prompt_token_ids)]
        for seq in decoding + prefilling:  # decodes first: a long prefill must not stall them
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
