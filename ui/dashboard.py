"""The live dashboard: VRAM per GPU (on CPU: process RSS), the KV pool (its size, KV cache type and the tokens it
holds) and its blocks, running / waiting requests,
generation tok/s (now and plotted over the last minutes), recent TTFTs, the prefix-cache hit rate, draft
acceptance under speculative decoding, and the active model with its quant and decoding plugins.

DashboardSampler is the one server-side sampler of those figures, every second, for every open tab: each tab's
timer reads the latest sample and the recent history; no tab triggers sampling of its own, so ten open tabs
cost what one does. Gradio is imported inside add_dashboard: the server imports this module before the UI's
offline environment is set.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from kvforge.app.cli.cache import human_bytes
from kvforge.core.metrics import gpu_memory
from kvforge.ui.service import UIService

if TYPE_CHECKING:
    import gradio as gr


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
    # dtype, quant and decoding plugins and their options, tp, the configured KV budget (None: automatic), the KV
    # cache type, the tokens of one KV block
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
            core = engine.config
            config = {"dtype": core.dtype, "quant": core.quant, "quant_options": core.quant_options,
                      "decoding": core.decoding or "none", "decoding_options": core.decoding_options,
                      "tp": core.tp_size, "pp": core.pp_size,
                      "persist_kv": core.persist_kv and core.enable_prefix_caching,
                      "kv_cache_bytes": core.kv_cache_bytes, "kv_cache_dtype": core.kv_cache_dtype,
                      "block_size": core.block_size, "stages": engine.placement}
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


def kv_cache_row(s: Sample) -> str:
    """The KV cache type and the tokens the pool holds: kv_cache_bytes / kv_bytes_per_token (the model card's
    kv_cache_tokens), read as blocks x block size -- the same number, with no call into the engine (runtime() asks
    every tensor-parallel rank for its weights)."""
    st, kv_type = s.stats, s.config.get("kv_cache_dtype") or "auto"
    tokens = st["kv_blocks_total"] * s.config["block_size"]
    per_token = human_bytes(round(st["kv_cache_bytes"] / tokens)) if tokens else "-"
    shown = f"{s.config.get('dtype')} (auto)" if kv_type == "auto" else kv_type  # auto: the model's dtype
    return f"| KV cache type / tokens held | {shown} / {tokens:,} tokens ({per_token} per token) |"


def stage_rows(s: Sample) -> list[str]:
    """Where each part of the model lives: a mixture-of-experts model's experts (host memory under cpu_experts), a
    vision model's tower, and one row per pipeline stage (none for a model in one stage)."""
    stages = s.config.get("stages") or []
    rows = []
    vision = [stage for stage in stages if stage.get("vision_bytes")]
    if vision:
        rows.append(f"| Vision tower | {human_bytes(vision[0]['vision_bytes'])} on {vision[0]['device']} |")
    experts = [stage for stage in stages if stage.get("experts_device")]
    if experts:
        where = experts[0]["experts_device"]
        rows.append(f"| Experts' weights | {human_bytes(sum(st['experts_bytes'] for st in experts))} on {where} |")
    if len(stages) < 2:
        return rows
    for i, stage in enumerate(stages):
        first, last = stage["layers"]
        holds = ", embedding + LM head" if stage["embedding_and_lm_head"] else ""
        rows.append(f"| Stage {i}: layers {first}-{last - 1}{holds} | {stage['device']} x {stage['processes']}, "
                    f"weights {human_bytes(stage['weights_bytes'])}, KV {human_bytes(stage['kv_cache_bytes'])} |")
    return rows


def dashboard_markdown(service: UIService) -> str:
    s = service.latest_sample()
    st = s.stats
    if not st:
        return "**No model loaded**"
    decoding = s.config.get("decoding") or "none"
    tp, pp = s.config.get("tp") or 1, s.config.get("pp") or 1
    header = (f"**Model** {s.model} · {s.config.get('dtype')} · quant **{s.config.get('quant')}** · "
              f"decoding **{decoding}**" + (f" · tp **{tp}**" if tp > 1 else "")
              + (f" · pp **{pp}**" if pp > 1 else ""))
    lines = [header, "", "| Engine | Now |", "|---|---|"]
    if s.gpus:
        for g in s.gpus:
            lines.append(f"| VRAM {g['device']} | {human_bytes(g['used'])} / {human_bytes(g['total'])} |")
    else:
        lines.append(f"| Process RSS | {human_bytes(s.rss_bytes)} |")
    lines += [
        f"| KV pool | {human_bytes(st['kv_cache_bytes'])}"
        + (" (automatic)" if s.config.get("kv_cache_bytes") is None else "") + " |",
        kv_cache_row(s),
        *stage_rows(s),
        f"| KV blocks used / cached / free | {st['kv_blocks_used']} / {st['kv_blocks_cached']} / "
        f"{st['kv_blocks_free']} |",
        f"| Requests running / waiting | {st['running']} / {st['waiting']} |",
        f"| Generation tok/s | {st['generation_tokens_per_s']:.1f} |",
        f"| Prefix cache hit rate | {st['prefix_cache_hit_rate'] * 100:.0f}% |",
    ]
    if decoding != "none":  # speculation: how many drafts the target accepts, tokens gained per step
        lines += [
            f"| Draft acceptance rate | {st.get('spec_acceptance_rate', 0.0) * 100:.0f}% "
            f"({st.get('spec_accepted_tokens_total', 0)} / {st.get('spec_drafted_tokens_total', 0)}) |",
            f"| Mean accepted length | {st.get('spec_mean_accepted_length', 0.0):.2f} tokens per step |",
        ]
    if s.config.get("persist_kv"):
        lines.append(f"| KV on disk | {st['kv_disk_blocks']} blocks, {human_bytes(st['kv_disk_bytes'])} |")
    ttfts = service.recent_ttfts()[-5:]
    if ttfts:
        lines.append(f"| Recent TTFT | {', '.join(f'{t * 1000:.0f} ms' for t in reversed(ttfts))} |")
    return "\n".join(lines)


def throughput_frame(service: UIService) -> pd.DataFrame:
    samples = service.sample_history()
    if not samples:
        return pd.DataFrame({"seconds ago": [], "tok/s": []})
    now = samples[-1].time
    return pd.DataFrame({"seconds ago": [round(s.time - now, 1) for s in samples],
                         "tok/s": [s.stats.get("generation_tokens_per_s", 0.0) for s in samples]})


def add_dashboard(blocks: gr.Blocks, service: UIService) -> None:
    """The figures table and the tok/s plot: filled when the page loads, then refreshed every second from the
    latest sample."""
    import gradio as gr

    dashboard = gr.Markdown(elem_id="dashboard")
    plot = gr.LinePlot(x="seconds ago", y="tok/s", title="Generation tok/s", height=220, elem_id="tokens-plot")

    def refresh():
        return dashboard_markdown(service), throughput_frame(service)

    blocks.load(refresh, outputs=[dashboard, plot], queue=False, show_progress="hidden")
    gr.Timer(1.0).tick(refresh, outputs=[dashboard, plot], queue=False, show_progress="hidden")
