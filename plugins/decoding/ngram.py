"""`ngram` proposer (prompt lookup decoding): the draft is what followed the latest earlier occurrence
of the sequence's last n tokens, in its prompt or its output. No model, no KV: it pays when the answer
copies from its input (rewriting, fixing or quoting a text or code) and costs nothing when nothing matches.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvforge.core.plugins import DraftTarget, Proposer


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: drafts what followed the last n tokens' latest earlier occurrence"
    drafting_runs_a_model = False
    settings = Proposer.settings | {
        # a wrong n-gram draft costs little (no model runs), and copied spans are long
        "k": Proposer.settings["k"] | {"default": 8},
        "max_n": {"type": "integer", "minimum": 1, "default": 4,
                  "description": "longest n-gram to look up (longer ones are tried first)"},
        "min_n": {"type": "integer", "minimum": 1, "default": 2, "description": "shortest n-gram to look up"},
    }

    def __init__(self, target: DraftTarget, **options) -> None:
        super().__init__(target, **options)
        if self.options["min_n"] > self.options["max_n"]:
            raise ValueError(f"option 'min_n' of plugin 'ngram' ({self.options['min_n']}) must be <= "
                             f"option 'max_n' ({self.options['max_n']})")

    def propose(self, seqs, num_tokens: list[int]) -> list[list[int]]:
        return [lookup(seq.token_ids, k, self.options["min_n"], self.options["max_n"])
                for seq, k in zip(seqs, num_tokens)]


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the largest n
    in [min_n, max_n] that occurs."""
    ids = np.asarray(tokens)
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows that end before the last token, so each has a follower and none is the suffix itself
        windows = sliding_window_view(ids[:length - 1], n)
        found = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if found.size:
            start = int(found[-1]) + n
            return ids[start:start + k].tolist()
    return []
