"""Tensor-parallel layout: how many ranks split the model being built, and which one this process is.

Layers read the layout when they are built (`with tensor_parallel(size, rank): build the model`) and
keep it; outside that block a model is whole (one rank), even in a process that belongs to a process
group -- so rank 0 can run a replicated draft model, or build the next model while the old one exists.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# (size, rank) for the layers being built, per thread: a server may build one model while another is being built
_building = threading.local()


@contextmanager
def tensor_parallel(size: int, rank: int) -> Iterator[None]:
    previous, _building.layout = _layout(), (size, rank)
    try:
        yield
    finally:
        _building.layout = previous


def _layout() -> tuple[int, int]:
    return getattr(_building, "layout", (1, 0))


def tp_size() -> int:
    return _layout()[0]


def tp_rank() -> int:
    return _layout()[1]


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_first, q_first + q_count) and KV heads
    [kv_first, kv_first + kv_count); its query heads all read its KV heads."""

    q_first: int
    q_count: int
    kv_first: int
    kv_count: int


def heads_of_rank(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Split whole KV heads (with the query heads that read them) across ranks, as evenly as the head
    count allows (lower ranks take the extra: the embedded model's 3 KV heads on 2 ranks are 2 + 1).
    With fewer KV heads than ranks each KV head is replicated on size / num_kv_heads ranks, which split
    its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        base, extra = divmod(num_kv_heads, size)
        kv_first, kv_count = rank * base + min(rank, extra), base + (rank < extra)
        return HeadShard(kv_first * group, kv_count * group, kv_first, kv_count)
    replicas = size // num_kv_heads
    if size % num_kv_heads or group % replicas:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads cannot be split across {size} "
                         f"tensor-parallel ranks (with fewer KV heads than ranks, the ranks must be a multiple of "
                         f"the KV heads and each KV head's query heads a multiple of its replicas)")
    kv_first, q_count = rank // replicas, group // replicas
    return HeadShard(kv_first * group + rank % replicas * q_count, q_count, kv_first, 1)
