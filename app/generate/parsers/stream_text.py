"""What the streaming text readers (app/generate/parsers/reasoning.py, app/generate/parsers/tool_calls.py) share: how
much of a text's tail may
be the start of a marker still arriving, and so must be held back."""

from __future__ import annotations


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (a marker still arriving)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
