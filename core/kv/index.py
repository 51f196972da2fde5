"""KVIndex: what the persisted KV tier needs from a database, as a protocol (the core imports no database).

The index names every block file on disk: its hash chain, the model fingerprint it belongs to, its size,
checksum and last access. The SQLAlchemy implementation (core/kv/sql_index.py) is imported only when the
persisted tier is on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class KVEntry:
    """One persisted KV block: the file holding it (relative to the KV directory) and what it must contain."""

    hash: bytes
    parent_hash: bytes
    fingerprint: bytes
    token_digest: bytes
    num_tokens: int
    file: str
    nbytes: int
    checksum: bytes
    last_access: float


class KVIndex(Protocol):
    """Shared by every process and model using one KV directory; safe to call from any thread."""

    def entries(self, fingerprint: bytes) -> list[KVEntry]:
        """This model's blocks, least recently used first."""
        ...

    def add(self, entries: Iterable[KVEntry]) -> None:
        """Record blocks (one already indexed is replaced)."""
        ...

    def set_access(self, times: dict[bytes, float]) -> None:
        """Record access times (hash -> Unix seconds); unknown hashes are ignored."""
        ...

    def children(self, parents: Iterable[bytes]) -> list[KVEntry]:
        """The blocks whose parent is one of these."""
        ...

    def remove(self, hashes: Iterable[bytes]) -> None: ...

    def least_recent(self, limit: int) -> list[KVEntry]:
        """Eviction candidates across every model: the budget is for the whole KV directory."""
        ...

    def totals(self) -> dict[bytes, tuple[int, int]]:
        """fingerprint -> (blocks, bytes)."""
        ...
