"""SamplingParams: per-request generation settings, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvforge.core.constraint import Constraint

MAX_LOGPROBS = 20
MAX_N = 64
MAX_STOP_STRINGS = 32  # each is matched against the text's tail after every token
MAX_STOP_CHARS = 512
REPETITION_PENALTY_RANGE = (0.01, 10.0)  # logits are multiplied or divided by it: 1e-308 makes them inf
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float (NaN and infinities are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


@dataclass(frozen=True)
class Bounds:
    """What one numeric sampling field accepts. SamplingParams checks it; the HTTP request models
    (app/dialects/openai/protocol.py) take their schema's limits from it (`limits()`), so a bound is declared only
    here."""

    integer: bool
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    expected: str | None = None  # the error's words, where the bounds alone say too little

    def holds(self, value) -> bool:
        return ((_is_int(value) if self.integer else _is_number(value))
                and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def describe(self) -> str:
        if self.expected:
            return self.expected
        kind = "an integer" if self.integer else "a number"
        low = f"[{_show(self.ge)}" if self.ge is not None else f"({_show(self.gt)}" if self.gt is not None else None
        if low is not None and self.le is not None:
            return f"{kind} in {low}, {_show(self.le)}]"
        return f"{kind} {'>=' if self.ge is not None else '>'} {low[1:]}"

    def limits(self) -> dict[str, float]:
        """pydantic's Field(ge=, gt=, le=) for this field."""
        return {name: value for name, value in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if value is not None}


BOUNDS = {
    "n": Bounds(True, ge=1, le=MAX_N),
    "temperature": Bounds(False, ge=0),
    "top_p": Bounds(False, gt=0, le=1),
    "top_k": Bounds(True, ge=-1, le=2**62 - 1, expected="an integer >= -1 (0 or -1 = off)"),
    "min_p": Bounds(False, ge=0, le=1),
    "repetition_penalty": Bounds(False, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]),
    "presence_penalty": Bounds(False, ge=-2, le=2),
    "frequency_penalty": Bounds(False, ge=-2, le=2),
    "seed": Bounds(True, ge=-(2**63), le=2**64 - 1, expected="an integer in [-2**63, 2**64)"),  # manual_seed's
    "max_tokens": Bounds(True, ge=1),
    "min_tokens": Bounds(True, ge=0, expected="an integer in [0, max_tokens]"),  # and <= max_tokens
    "logprobs": Bounds(True, ge=0, le=MAX_LOGPROBS),
    "prompt_logprobs": Bounds(True, ge=0, le=MAX_LOGPROBS),
}
OPTIONAL = ("seed", "logprobs", "prompt_logprobs")  # None: not set


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
    # None: none; N: each prompt token's logprob given the tokens before it (the first has none) and the top N,
    # computed in the prompt's own prefill; such a request takes nothing from the prefix cache (no logits there)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (after penalties)
    constraint: Constraint | None = None  # the output must match it (core/constraint.py)
    repetition_guard: bool = False  # end an output stuck in a loop: finish_reason "repetition" (core/repetition.py)

    def __post_init__(self) -> None:  # the numeric fields' bounds: BOUNDS
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        first = [self._bounded(name) for name in BOUNDS if "logprobs" not in name]  # n ... min_tokens
        checks = first + [
            ("min_tokens", not _is_int(self.max_tokens) or self.min_tokens <= self.max_tokens,
             BOUNDS["min_tokens"].describe()),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS
             and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, each at most {MAX_STOP_CHARS} "
             "characters"),
            ("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of non-negative integers"),
            self._bounded("logprobs"),
            self._bounded("prompt_logprobs"),
            ("logit_bias", self.logit_bias is None or (
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS
                and all(_is_int(t) and t >= 0 and _is_number(b) and LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1]
                        for t, b in self.logit_bias.items())),
             f"a map of at most {MAX_LOGIT_BIAS_TOKENS} token ids to numbers in [{LOGIT_BIAS_RANGE[0]:g}, "
             f"{LOGIT_BIAS_RANGE[1]:g}]"),
            ("constraint", self.constraint is None or isinstance(self.constraint, Constraint), "a Constraint"),
            ("repetition_guard", isinstance(self.repetition_guard, bool), "true or false"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    def _bounded(self, name: str) -> tuple[str, bool, str]:
        value, bounds = getattr(self, name), BOUNDS[name]
        return name, (value is None and name in OPTIONAL) or bounds.holds(value), bounds.describe()

    @classmethod
    def default(cls, name: str):
        """A field's default: what the CLI's flags and the HTTP request models start from."""
        return cls.__dataclass_fields__[name].default

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
