"""Parallel layout of the model being built: how many tensor-parallel ranks split each layer and which one this
process is (with the process group their collectives run on), and which pipeline stage's layers it holds.

Layers read the layout when they are built (`with tensor_parallel(size, rank): build the model`, `with
pipeline_stage(stages, stage)`) and keep it; outside those blocks a model is whole (one rank, one stage), even in a
process that belongs to a process group -- so rank 0 can run a replicated draft model, or build the next model
while the old one exists.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# (size, rank, group) and (stages, stage) for the layers being built, per thread: a server may build one model while
# another is being built
_building = threading.local()


@contextmanager
def tensor_parallel(size: int, rank: int, group: Any = None) -> Iterator[None]:
    """`group`: the process group of this rank's tensor-parallel peers (None: the default group, all ranks)."""
    previous, _building.layout = _layout(), (size, rank, group)
    try:
        yield
    finally:
        _building.layout = previous


@contextmanager
def pipeline_stage(stages: int, stage: int) -> Iterator[None]:
    previous, _building.stage = _stage(), (stages, stage)
    try:
        yield
    finally:
        _building.stage = previous


def _layout() -> tuple[int, int, Any]:
    return getattr(_building, "layout", (1, 0, None))


def _stage() -> tuple[int, int]:
    return getattr(_building, "stage", (1, 0))


def tp_size() -> int:
    return _layout()[0]


def tp_rank() -> int:
    return _layout()[1]


def tp_group() -> Any:
    """The tensor-parallel peers' process group for a layer's collectives (None: the default group)."""
    return _layout()[2]


@dataclass(frozen=True)
class StageLayers:
    """The decoder layers one pipeline stage holds, [first, last), and whether it also holds the embedding and the LM
    head (the first stage: rank 0, where the last stage's final hidden states come back to be turned into logits, a
    few KB a row instead of a vocabulary of fp32 logits) or the final norm (the last)."""

    first: int
    last: int
    is_first: bool
    is_last: bool

    def __contains__(self, layer: int) -> bool:
        return self.first <= layer < self.last

    @property
    def count(self) -> int:
        return self.last - self.first


def stage_layers(config, stages: int | None = None, stage: int | None = None) -> StageLayers:
    """The layers of the stage being built (or of `stage` of `stages`): consecutive, split so that each stage's work
    per token is about even, counting the first stage's LM head as the layers its matmul weighs (SmolLM2-135M's
    49k-row head weighs 8 of its 30 layers: 11 + 19). Every stage holds at least one layer."""
    if stages is None:
        stages, stage = _stage()
    bounds = stage_bounds(config.num_hidden_layers, head_weight_in_layers(config), stages)
    return StageLayers(bounds[stage], bounds[stage + 1], stage == 0, stage == stages - 1)


def stage_bounds(num_layers: int, head: float, stages: int) -> list[int]:
    """Each stage's first layer and the end [stages + 1]: `head` (the first stage's LM head in decoder layers' work)
    counted with the first stage's layers, every stage at least one layer."""
    if num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot be split into {stages} pipeline stages")
    total = num_layers + head
    return [0 if s == 0 else num_layers if s == stages else
            min(max(round(s * total / stages - head), s), num_layers - (stages - s)) for s in range(stages + 1)]


def head_weight_in_layers(config) -> float:
    """The LM head's matmul per token in units of one decoder layer's (a mixture-of-experts layer: its active
    experts'), by parameter count."""
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = getattr(config, "num_experts_per_tok", None)
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    mlp = 3 * hidden * (size * experts if experts else config.intermediate_size)
    return config.vocab_size * hidden / (attention + mlp)


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


def pool_layer(layer: int, config) -> int:
    """Which layer of this stage's KV pool holds decoder layer `layer`'s KV (a stage's pool has only its layers)."""
    return layer - stage_layers(config).first
