"""SamplingParams: per-request generation settings, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 64
MAX_STOP_STRINGS = 32  # each is matched against the text's tail after every token
MAX_STOP_CHARS = 512
REPETITION_PENALTY_RANGE = (0.01, 10.0)  # logits are multiplied or divided by it: 1e-308 makes them inf


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float (NaN and infinities are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    n: int = 1  # samples of the same prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # OpenAI semantics, on output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None  # the same seed gives the same tokens, alone or in a batch
    max_tokens: int = 256
    min_tokens: int = 0  # EOS / stop tokens are masked until this many tokens exist
    stop: list[str] | str | None = None  # stop strings, matched on the text, not included in it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the top N
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        checks = [
            ("n", _is_int(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and -1 <= self.top_k < 2**62, "an integer >= -1 (0 or -1 = off)"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("repetition_penalty", _is_number(self.repetition_penalty)
             and REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
             f"a number in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]:g}]"),
            ("presence_penalty", _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "a number in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "a number in [-2, 2]"),
            ("seed", self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
             "an integer in [-2**63, 2**64)"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= (
                self.max_tokens if _is_int(self.max_tokens) else 0), "an integer in [0, max_tokens]"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS
             and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, each at most {MAX_STOP_CHARS} "
             "characters"),
            ("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of non-negative integers"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
