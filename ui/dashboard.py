"""DashboardSampler: one server-side sampler of the engine's figures, every second, for every open tab.

Each tab's timer reads the latest sample and the recent history; no tab triggers sampling of its own,
so ten open tabs cost what one does.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvforge.core.metrics import gpu_memory


def process_rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Sample:
    time: float
    model: str | None
    stats: dict[str, Any]  # EngineStats.as_dict(), empty when no model is loaded
    rss_bytes: int
    gpus: list[dict[str, Any]]
    # dtype, quant and decoding plugins and their options, tp, the configured KV budget (None: automatic)
    config: dict[str, Any] = field(default_factory=dict)


class DashboardSampler:
    def __init__(self, host, metrics=None, interval_s: float = 1.0, window_s: float = 300.0) -> None:
        self.host, self.metrics, self.interval_s = host, metrics, interval_s
        self._samples: deque[Sample] = deque(maxlen=int(window_s / interval_s))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> DashboardSampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self.sample()
            with self._lock:
                self._samples.append(sample)
            self._stop.wait(self.interval_s)

    def sample(self) -> Sample:
        engine = self.host.engine
        stats, config = {}, {}
        if engine is not None:
            stats = engine.stats().as_dict()
            core = engine.engine.config
            config = {"dtype": core.dtype, "quant": core.quant, "quant_options": core.quant_options,
                      "decoding": core.decoding or "none", "decoding_options": core.decoding_options,
                      "tp": core.tp_size, "persist_kv": core.persist_kv and core.enable_prefix_caching,
                      "kv_cache_bytes": core.kv_cache_bytes}
        return Sample(time.time(), self.host.name, stats, process_rss_bytes(), gpu_memory(), config)

    def latest(self) -> Sample:
        with self._lock:
            if self._samples:
                return self._samples[-1]
        return self.sample()

    def history(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def recent_ttfts(self) -> list[float]:
        return list(self.metrics.recent_ttft) if self.metrics is not None else []
