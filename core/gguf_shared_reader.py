"""One `gguf.GGUFReader` per file while a conversion runs.

A GGUF conversion asks transformers for the config (twice: AutoConfig, and AutoTokenizer's own look at it) and the
tensors, and reads the blocks itself; each of transformers' `load_gguf_checkpoint` calls builds a new GGUFReader,
which walks every metadata array into numpy views: ~15 s each for Gemma 3's 262k-token vocabulary on a 2-core Zen 2,
most of a first load. transformers takes no parsed reader, so while `shared_gguf_reader(path)` is open,
`gguf.GGUFReader(path)` returns the one reader built for that path (any other path: a new reader, as before).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_lock = threading.Lock()
# resolved path -> [reader or None, open count, the lock its first parse holds]; the stand-in is installed in gguf
# exactly while this is not empty
_shared: dict[str, list] = {}
_real = None  # gguf's own GGUFReader (kept: a caller may hold the stand-in after it is uninstalled)


def _reader(path, mode: str = "r"):
    key = os.path.realpath(path)
    with _lock:
        entry = _shared.get(key) if mode == "r" else None
    if entry is None:
        return _real(path, mode)
    with entry[2]:  # others asking for this file wait for its one parse
        if entry[0] is None:
            entry[0] = _real(path, mode)
        return entry[0]


@contextlib.contextmanager
def shared_gguf_reader(path: Path) -> Iterator[None]:
    """Within the block, every read-only GGUFReader of `path` is one reader, parsed at its first use."""
    global _real
    import gguf

    key = os.path.realpath(path)
    with _lock:
        if not _shared:
            _real = _real or gguf.GGUFReader
            gguf.GGUFReader = _reader
        _shared.setdefault(key, [None, 0, threading.Lock()])[1] += 1
    try:
        yield
    finally:
        with _lock:
            _shared[key][1] -= 1
            if not _shared[key][1]:
                del _shared[key]
            if not _shared:
                gguf.GGUFReader = _real
