"""How long a model loaded on demand stays once idle: Ollama's keep_alive (seconds, or a Go duration such as
'5m' or '1h30m'; negative: forever) parsed as Ollama parses it, and the server's --keep-alive."""

from __future__ import annotations

import math
import re
import time
from typing import Any

FOREVER = math.inf


# Ollama's keep_alive is a Go time.Duration (api/types.go, Duration.UnmarshalJSON): a JSON number is seconds, a
# string is Go's time.ParseDuration syntax, negative is forever; anything else is refused. Go's durations are int64
# nanoseconds, so the longest is ~292 years: Ollama keeps a model "forever" for exactly that long, and /api/ps shows
# it expiring then. A longer value is refused (a Go string of that size fails to parse; a number's conversion
# overflows). Hand-written: no maintained Python library parses Go's duration syntax exactly.
LONGEST_KEEP_ALIVE_S = (2**63 - 1) / 1e9  # Go's math.MaxInt64 nanoseconds
GO_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                     "h": 3600.0}
_GO_NUMBER = r"(?:\d+\.?\d*|\.\d+)"
_GO_UNIT = "|".join(sorted(map(re.escape, GO_DURATION_UNITS), key=len, reverse=True))
_GO_DURATION = re.compile(rf"([-+]?)((?:{_GO_NUMBER}(?:{_GO_UNIT}))+)")
_GO_TERM = re.compile(rf"({_GO_NUMBER})({_GO_UNIT})")
_BARE_SECONDS = re.compile(rf"[-+]?{_GO_NUMBER}")
KEEP_ALIVE_FORMS = "seconds (a number) or a duration such as '5m', '1h30m', '250ms'; negative keeps the model loaded"


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive in seconds, parsed as Ollama parses it (see above): a number of seconds, or a Go duration
    string ("5m", "1h30m", "1.5h", "250ms", "-1m"; a bare number string such as "45" is taken as seconds, as
    Ollama's OLLAMA_KEEP_ALIVE takes it); negative: forever (math.inf); 0: unload as soon as idle. None when not
    given. ValueError for a boolean or any other JSON type, NaN, or more than ~292 years."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"must be {KEEP_ALIVE_FORMS}; got {type(value).__name__} {value!r}")
    if isinstance(value, str):
        seconds = _duration_seconds(value)
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an integer beyond any float
            seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds):
        raise ValueError(f"must be {KEEP_ALIVE_FORMS}; got {value!r}")
    if seconds < 0:
        return FOREVER
    if seconds > LONGEST_KEEP_ALIVE_S:
        raise ValueError(f"must be at most {int(LONGEST_KEEP_ALIVE_S)} seconds (~292 years, Ollama's longest "
                         f"duration); negative keeps the model loaded; got {value!r}")
    return seconds


def _duration_seconds(text: str) -> float:
    """Go's time.ParseDuration in seconds (or a bare number of seconds); ValueError naming the forms."""
    if _BARE_SECONDS.fullmatch(text):
        return float(text)
    parts = _GO_DURATION.fullmatch(text)
    if parts is None:
        raise ValueError(f"must be {KEEP_ALIVE_FORMS} (units ns, us, ms, s, m, h); got {text!r}")
    seconds = sum(float(number) * GO_DURATION_UNITS[unit] for number, unit in _GO_TERM.findall(parts.group(2)))
    return -seconds if parts.group(1) == "-" else seconds


def forever_from_now() -> float:
    """The expiry Ollama's /api/ps shows for a model kept loaded: now + Go's longest duration (time.time())."""
    return time.time() + LONGEST_KEEP_ALIVE_S
