"""Per-sequence output state: incremental text, stop strings across token boundaries, logprobs.

Text is streamed through the UTF-8-safe detokenizer. With stop strings, the last
(longest stop string - 1) characters are held back until they can no longer start a stop string,
so a stop string never reaches the client, not even in part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.core.sampling import SamplingParams
from kvforge.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvforge.core.request import Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token id, logprob) pairs at this position


@dataclass
class RequestOutput:
    """What one step produced for one sample of a request; `text` / `token_ids` are the totals so far."""

    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | None = None  # the stop string that ended it (None: an end-of-sequence token, or not "stop")
    num_cached_tokens: int = 0
    metrics: dict[str, Any] | None = None  # set on the final output
    # an embedding request's (core/pooling.py), on its final output; a scoring request's: its score tokens' logits
    embedding: list[float] | None = None
    # params.prompt_logprobs: on the sample's first output, prompt token i + 1's logprob at [i] (the first token,
    # with nothing before it, has none)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class OutputState:
    tokenizer: Tokenizer
    params: SamplingParams
    text: str = ""  # decoded so far (after a stop string is found: cut before it)
    sent: int = 0  # characters of `text` already streamed
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    stop_string: str | None = None  # the stop string found, once one is
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.detokenizer = self.tokenizer.detokenizer(self.params.skip_special_tokens)
        self.hold_back = max((len(s) for s in self.params.stop), default=1) - 1

    def add_token(self, token: int, text_visible: bool, num_output_tokens: int) -> bool:
        """Append one token; True when a stop string was found (the text is then cut before it)."""
        self.pending_tokens.append(token)
        if not text_visible:
            return False
        before = len(self.text)
        self.text += self.detokenizer.step(token)
        if not self.params.stop or num_output_tokens < self.params.min_tokens:
            return False
        search_from = max(0, before - self.hold_back)
        found = [(i, s) for s in self.params.stop if (i := self.text.find(s, search_from)) >= 0]
        if found:
            at, self.stop_string = min(found, key=lambda f: f[0])
            self.text = self.text[:at]
            return True
        return False

    def take_delta(self, finished: bool) -> str:
        limit = len(self.text) if finished else max(self.sent, len(self.text) - self.hold_back)
        delta = self.text[self.sent:limit]
        self.sent = limit
        return delta

    def emitted_text(self) -> str:
        return self.text[: self.sent]

    def output(self, seq: Sequence) -> RequestOutput:
        """The sequence's output of a step in which it got tokens and goes on: the text decoded since the last one
        (held back where a stop string may be starting), its tokens and logprobs."""
        return self._emit(seq, self.pending_tokens, finished=False)

    def final_output(self, seq: Sequence, delta_tokens: list[int], reason: str | None,
                     metrics: dict[str, Any]) -> RequestOutput:
        """The sequence's last output: the rest of its text, why it finished (and the stop string found), and the
        request's metrics."""
        return self._emit(seq, list(delta_tokens), finished=True, finish_reason=seq.finish_reason or reason,
                          stop_reason=self.stop_string, metrics=metrics)

    def _emit(self, seq: Sequence, delta_tokens: list[int], finished: bool, **final: Any) -> RequestOutput:
        delta_text = self.take_delta(finished)  # first: it moves what emitted_text() holds
        out = RequestOutput(seq.request_id, seq.index, seq.prompt_token_ids, list(seq.output_token_ids),
                            self.emitted_text(), delta_text, delta_tokens,
                            self.pending_logprobs if seq.params.logprobs is not None else None,
                            finished=finished, num_cached_tokens=seq.num_cached_tokens or 0, **final)
        self.pending_tokens, self.pending_logprobs = [], []
        if getattr(seq.params, "prompt_logprobs", None) is not None and not self.prompt_logprobs_sent:
            out.prompt_logprobs, self.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return out
