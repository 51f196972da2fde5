"""The repetition guard: ends a reply stuck in a loop (finish_reason "repetition") instead of letting it run to
max_tokens. A small model sampled hot, or greedy on a prompt it cannot answer, can fall into a cycle ("laquelle,
laquelle, ...", a sentence over and over) that it never leaves; each token after that is wasted time.

A loop here is the output's tail repeating itself exactly with some period p of at most MAX_PERIOD tokens, for at
least MIN_REPEATS periods and at least MIN_SPAN tokens (so a short legitimate repeat, "ha ha ha", or a table's
separator row, passes). Checked incrementally: per period, the length of the current run of tokens equal to the
token p places before them, O(MAX_PERIOD) per token; a sequence pays for it only when its request asks for it.
"""

from __future__ import annotations

MAX_PERIOD = 64  # tokens: a repeated sentence or list item
MIN_REPEATS = 4  # periods seen (the first plus three repeats)
MIN_SPAN = 48  # tokens of the tail the loop covers, at least


class RepetitionGuard:
    """Per sequence: feed it every output token; it says when the output ends in a loop."""

    __slots__ = ("runs", "tokens")

    def __init__(self) -> None:
        self.runs = [0] * (MAX_PERIOD + 1)  # runs[p]: trailing tokens equal to the token p before each
        self.tokens: list[int] = []

    def looping(self, token: int) -> bool:
        """Add `token`; whether the output now ends in a loop."""
        tokens, runs = self.tokens, self.runs
        tokens.append(token)
        n, found = len(tokens), False
        for period in range(1, min(MAX_PERIOD, n - 1) + 1):
            if tokens[n - 1 - period] == token:
                runs[period] += 1
                # a run of r matches at period p means the last r + p tokens repeat with period p
                if runs[period] + period >= max(MIN_SPAN, MIN_REPEATS * period):
                    found = True
            else:
                runs[period] = 0
        if n > 4 * MAX_PERIOD * MIN_REPEATS:  # only the recent tail is ever compared
            del tokens[: n - MAX_PERIOD - 1]
        return found
