"""SQLKVIndex: the KVIndex (core/kv/index.py) on the kv_blocks table of a Store (core/store.py).

Imported only when the persisted tier is on, so an engine without it never imports SQLAlchemy.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import BigInteger, Float, Integer, LargeBinary, String, delete, func, insert, select, update
from sqlalchemy.orm import Mapped, mapped_column

from kvforge.core.kv.index import KVEntry
from kvforge.core.store import Base, Store


class KVBlockRow(Base):
    """One persisted KV block: the file holding it and what it must contain."""
    __tablename__ = "kv_blocks"
    hash: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    parent_hash: Mapped[bytes] = mapped_column(LargeBinary(16))
    fingerprint: Mapped[bytes] = mapped_column(LargeBinary(16), index=True)
    token_digest: Mapped[bytes] = mapped_column(LargeBinary(16))
    num_tokens: Mapped[int] = mapped_column(Integer)
    file: Mapped[str] = mapped_column(String(200))  # relative to the KV directory
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[bytes] = mapped_column(LargeBinary(32))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    last_access: Mapped[float] = mapped_column(Float, default=time.time, index=True)

    def entry(self) -> KVEntry:
        return KVEntry(self.hash, self.parent_hash, self.fingerprint, self.token_digest, self.num_tokens, self.file,
                       self.nbytes, self.checksum, self.last_access)


class SQLKVIndex:
    """A KVIndex on `store`; it closes the store only if it opened it (see `open`)."""

    def __init__(self, store: Store, owns_store: bool = False) -> None:
        self.store, self._owns_store = store, owns_store

    @classmethod
    def open(cls, url: str) -> SQLKVIndex:
        """The index of a Store opened on `url` (created or upgraded), closed with the index."""
        return cls(Store(url), owns_store=True)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> SQLKVIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def entries(self, fingerprint: bytes) -> list[KVEntry]:
        """This model's persisted blocks, least recently used first."""
        with self.store.session() as s:
            rows = s.scalars(select(KVBlockRow).where(KVBlockRow.fingerprint == fingerprint)
                             .order_by(KVBlockRow.last_access))
            return [r.entry() for r in rows]

    def add(self, entries: Iterable[KVEntry]) -> None:
        """Two statements per batch (a row per block through the ORM costs the writer thread, and so the engine
        thread waiting for the GIL, ~0.5 ms a block): rows of these hashes replaced, in one transaction."""
        rows = {e.hash: {"hash": e.hash, "parent_hash": e.parent_hash, "fingerprint": e.fingerprint,
                         "token_digest": e.token_digest, "num_tokens": e.num_tokens, "file": e.file,
                         "nbytes": e.nbytes, "checksum": e.checksum, "last_access": e.last_access}
                for e in entries}
        if rows:
            with self.store.session() as s, s.begin():
                s.execute(delete(KVBlockRow).where(KVBlockRow.hash.in_(list(rows))))
                s.execute(insert(KVBlockRow), list(rows.values()))

    def touch(self, hashes: Iterable[bytes], when: float | None = None) -> None:
        when = when or time.time()
        self.set_access(dict.fromkeys(hashes, when))

    def set_access(self, times: dict[bytes, float]) -> None:
        """Record access times (hash -> Unix seconds) of indexed blocks; unknown hashes are ignored."""
        if times:
            with self.store.session() as s, s.begin():
                known = set(s.scalars(select(KVBlockRow.hash).where(KVBlockRow.hash.in_(list(times)))))
                rows = [{"hash": h, "last_access": t} for h, t in times.items() if h in known]
                if rows:
                    s.execute(update(KVBlockRow), rows)

    def children(self, parents: Iterable[bytes]) -> list[KVEntry]:
        with self.store.session() as s:
            rows = s.scalars(select(KVBlockRow).where(KVBlockRow.parent_hash.in_(list(parents))))
            return [r.entry() for r in rows]

    def remove(self, hashes: Iterable[bytes]) -> None:
        hashes = list(hashes)
        if hashes:
            with self.store.session() as s, s.begin():
                s.execute(delete(KVBlockRow).where(KVBlockRow.hash.in_(hashes)))

    def least_recent(self, limit: int) -> list[KVEntry]:
        """Eviction candidates across every model: the budget is for the whole KV directory."""
        with self.store.session() as s:
            rows = s.scalars(select(KVBlockRow).order_by(KVBlockRow.last_access).limit(limit))
            return [r.entry() for r in rows]

    def totals(self) -> dict[bytes, tuple[int, int]]:
        """fingerprint -> (blocks, bytes)."""
        with self.store.session() as s:
            rows = s.execute(select(KVBlockRow.fingerprint, func.count(), func.coalesce(func.sum(KVBlockRow.nbytes), 0))
                             .group_by(KVBlockRow.fingerprint))
            return {fp: (int(n), int(b)) for fp, n, b in rows}

    def clear(self) -> int:
        """Remove every model's rows; how many there were."""
        with self.store.session() as s, s.begin():
            return s.execute(delete(KVBlockRow)).rowcount
