"""Sequence state: its tokens, its KV block table, how much of it the cache holds, and its timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from kvforge.core.constraint import GrammarState
from kvforge.core.images import ImageInput, chunk_end
from kvforge.core.pooling import PooledHidden, PoolingParams
from kvforge.core.repetition import RepetitionGuard
from kvforge.core.sampling import SamplingParams

if TYPE_CHECKING:
    from kvforge.core.output import OutputState, TokenLogprob


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself: compared (and found in the scheduler's queues) by identity
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    generator: torch.Generator | None = None  # per-sequence RNG: same seed, same tokens, any batch
    index: int = 0  # which of the request's n samples
    arrival: int = 0  # global arrival order: FCFS within a group, latest-first preemption
    group: str | None = None  # the client request it is part of, which shares the engine fairly (core/scheduler.py)
    output_token_ids: list[int] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images (core/images.py)
    prompt_keys: list[int] | None = None  # the prompt as the prefix cache keys it, where it has images
    # its output's text, decoded as each token is appended (where stop strings are found); None: not decoded
    output_state: OutputState | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit on first admission
    num_preemptions: int = 0
    grammar: GrammarState | None = None  # where the output stands in its constraint (params.constraint)
    # speculative decoding: this step's draft tokens (verified after the sequence's last token) and, for
    # a proposer that samples its drafts, their draft distributions [drafts, vocab]
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None
    spec_k: int | None = None  # the adaptive number of drafts (None: not speculated yet)
    spec_paused_until: int = 0  # no drafts until the output reaches this many tokens (low acceptance)
    spec_acceptance: float = 1.0  # moving average of the acceptance rate
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0  # steps that verified at least one draft
    pooled: PooledHidden | None = None  # an embedding request's hidden states of its computed positions
    repetition: RepetitionGuard | None = None  # its loop detector, when params.repetition_guard asks for one
    # params.prompt_logprobs: prompt token i + 1's logprob at [i], recorded as its prefill computes it
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "repetition" | "abort"
    # timings (time.monotonic)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_keys(self) -> list[int]:
        """Its tokens as the prefix cache and the persisted tier key them: the token ids, with each image position's
        key in place of its placeholder id (core/images.py)."""
        return self.token_ids if self.prompt_keys is None else self.prompt_keys + self.output_token_ids

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from `start` planned to end at `end` ends: never inside an image run that attends
        both ways (core/images.py chunk_end)."""
        return chunk_end(self.images, start, end) if self.images else end

    @property
    def token_ids_with_drafts(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + self.spec_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def pools(self) -> bool:
        """An embedding request: prefilled, never sampled (core/pooling.py)."""
        return isinstance(self.params, PoolingParams)

    @property
    def needs_every_position(self) -> bool:
        """Its prefill must compute every position (none from the prefix cache): an embedding request pools them
        all, prompt_logprobs asks for each one's logits; a scoring request needs the last one only."""
        if isinstance(self.params, PoolingParams):
            return not self.params.score_token_ids
        return self.params.prompt_logprobs is not None

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_draft_probs = [], None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def share_group(self) -> str:
        """Whose share of the engine it takes: its group (an embeddings request's inputs), else its request (an n-sample
        request's samples)."""
        return self.group or self.request_id
