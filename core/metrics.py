"""Request and engine metrics, read by the server's /metrics and the UI dashboard, and where and how an engine runs
(RuntimeInfo)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvforge.core.request import Sequence


def request_metrics(seq: Sequence) -> dict:
    """Per-request timings (seconds) and token counts, once the sequence has finished."""
    generated = len(seq.output_token_ids)
    first, finish = seq.first_token_time, seq.finish_time or time.monotonic()
    return {
        "queue_time": (seq.first_scheduled_time - seq.arrival_time) if seq.first_scheduled_time else None,
        "ttft": (first - seq.arrival_time) if first else None,
        "tpot": ((finish - first) / (generated - 1)) if first and generated > 1 else None,
        "e2e_latency": finish - seq.arrival_time,
        "prompt_tokens": len(seq.prompt_token_ids),
        "cached_tokens": seq.num_cached_tokens or 0,
        "generated_tokens": generated,
        "preemptions": seq.num_preemptions,
    }


def available_memory_bytes() -> int | None:
    """Memory the kernel can give this process without swapping (Linux MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class RateMeter:
    """Events per second over a sliding window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0  # the counts in _events (the engine reads the rate after every step)

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, count))
        self._total += count
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = min(self.window_s, max(now - self._events[0][0], 1.0))  # >= 1 s: no burst spikes
        return self._total / span


@dataclass
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # unused blocks that still hold a reusable prefix
    kv_blocks_free: int  # unused blocks holding nothing reusable
    kv_cache_bytes: int
    running: int
    waiting: int
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    requests_finished: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    preemptions_total: int
    # the persisted KV tier (zeros when it is off)
    kv_disk_blocks: int = 0  # this model's blocks on disk
    kv_disk_bytes: int = 0  # every model's blocks in the KV directory
    kv_disk_pending: int = 0  # blocks queued for writing, or deferred until the engine is idle
    kv_disk_loaded_blocks_total: int = 0
    kv_disk_load_failures_total: int = 0
    # speculative decoding (zeros when it is off)
    spec_drafted_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_steps_total: int = 0  # steps of a sequence that verified drafts
    images_encoded_total: int = 0  # pictures through a vision model's tower (each once per request)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        drafted = self.spec_drafted_tokens_total
        return self.spec_accepted_tokens_total / drafted if drafted else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: accepted drafts + the target's own token."""
        steps = self.spec_verify_steps_total
        return (self.spec_accepted_tokens_total + steps) / steps if steps else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                               "spec_acceptance_rate": self.spec_acceptance_rate,
                               "spec_mean_accepted_length": self.spec_mean_accepted_length}


def gpu_memory() -> list[dict[str, Any]]:
    """Used / total bytes per visible GPU; empty on a CPU-only machine."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i), "used": total - free,
                     "total": total})
    return gpus


@dataclass
class RuntimeInfo:
    """Where and how the engine runs: what the API's model card, the CLI and the benches report."""

    device: str
    kernels: str  # "triton" | "torch"
    cuda_graph_batch_sizes: list[int] | None  # decode batch sizes that replay captured CUDA graphs
    weight_bytes: int  # the model's weights on this process's rank
    embedding_bytes: int  # of which the input embedding table (a decode step reads one row of it)
    kv_cache_bytes: int  # the paged KV pool on this process's rank
    kv_bytes_per_token: float
    kernel_choices: dict[str, str]  # op class and shape (core/kernel_choice.py ShapeChoice.key) -> the kernel chosen
    # where each part of the model lives: one entry per pipeline stage (core/runner.py StagePlacement.as_dict)
    stages: list[dict] = field(default_factory=list)
    gguf_weights: str | None = None  # a GGUF's blocks "copied" onto huge pages or "mapped" from the file; else None

    @property
    def cuda_graphs(self) -> bool:
        return self.cuda_graph_batch_sizes is not None
