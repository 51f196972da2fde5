"""Prometheus metrics of the server (prometheus_client, one registry per app), served at GET /metrics beside GET
/health."""

from __future__ import annotations

from collections import deque

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvforge.core.output import RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self, host, admission) -> None:
        self.host = host  # app.models.ModelHost: the engine changes when the model is swapped
        self.admission = admission  # app.admission.Admission: requests admitted and not yet done
        self.registry = CollectorRegistry()
        self.recent_ttft: deque[float] = deque(maxlen=20)  # seconds, newest last (the UI dashboard)
        r = self.registry
        self.requests = Counter("kvforge_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("kvforge_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvforge_cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("kvforge_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("kvforge_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvforge_tpot_seconds", "Time per output token", buckets=LATENCY_BUCKETS, registry=r)
        self.gauges = {name: Gauge(f"kvforge_{name}", help_text, registry=r) for name, help_text in {
            "kv_blocks_used": "KV blocks in use", "kv_blocks_cached": "Unused KV blocks holding a cached prefix",
            "kv_blocks_free": "KV blocks holding nothing", "requests_running": "Sequences running",
            "requests_admitted": "Requests admitted: preparing their prompt, waiting for a model swap or in the engine",
            "requests_waiting": "Sequences waiting", "generation_tokens_per_second": "Generated tokens/s (10 s)",
            "kv_disk_blocks": "Persisted KV blocks of this model", "kv_disk_bytes": "Bytes of persisted KV on disk",
            "kv_disk_pending": "KV blocks queued for writing to disk, or deferred until the engine is idle",
            "kv_disk_loaded_blocks": "KV blocks loaded from disk since start",
            "kv_disk_load_failures": "Persisted KV blocks dropped as missing or corrupt since start",
            "spec_drafted_tokens": "Speculative draft tokens proposed since the model was loaded",
            "spec_accepted_tokens": "Speculative draft tokens accepted since the model was loaded",
            "spec_verify_steps": "Sequence steps that verified speculative drafts since the model was loaded",
            "spec_acceptance_rate": "Accepted / drafted speculative tokens (0 when speculation is off)",
            "spec_mean_accepted_length": "Tokens gained per verify step: accepted drafts + 1 (0 when off)",
            "images_encoded": "Pictures through a vision model's tower since it was loaded (each once per request; "
                              "none for a picture whose positions came from the prefix cache)",
            "models_loaded": "Models holding memory: resident, loading or closing (the server's own included)",
            "models_loaded_peak": "The most models that held memory at once since start (--max-loaded-models)",
            "models_memory_bytes": "Weights and KV pools of the models holding memory (estimates while loading)",
            "models_memory_peak_bytes": "The most bytes models_memory_bytes counted at once (--models-memory-gb)",
        }.items()}

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics or {}
        if out.index == 0 and m.get("ttft") is not None:
            self.recent_ttft.append(m["ttft"])
        self.requests.labels(out.finish_reason or "unknown").inc()
        if out.index == 0:
            self.prompt_tokens.inc(m.get("prompt_tokens", 0))
            self.cached_tokens.inc(m.get("cached_tokens", 0))
        self.generated_tokens.inc(m.get("generated_tokens", 0))
        if m.get("ttft") is not None:
            self.ttft.observe(m["ttft"])
        if m.get("tpot") is not None:
            self.tpot.observe(m["tpot"])

    def render(self) -> tuple[bytes, str]:
        self.gauges["requests_admitted"].set(self.admission.pending)
        loaded, used = self.host.occupancy()
        for name, value in {"models_loaded": loaded, "models_loaded_peak": self.host.peak_loaded,
                            "models_memory_bytes": used, "models_memory_peak_bytes": self.host.peak_bytes}.items():
            self.gauges[name].set(value)
        if self.host.engine is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        stats = self.host.engine.stats()
        values = {"kv_blocks_used": stats.kv_blocks_used, "kv_blocks_cached": stats.kv_blocks_cached,
                  "kv_blocks_free": stats.kv_blocks_free, "requests_running": stats.running,
                  "requests_waiting": stats.waiting, "generation_tokens_per_second": stats.generation_tokens_per_s,
                  "kv_disk_blocks": stats.kv_disk_blocks, "kv_disk_bytes": stats.kv_disk_bytes,
                  "kv_disk_pending": stats.kv_disk_pending, "kv_disk_loaded_blocks": stats.kv_disk_loaded_blocks_total,
                  "kv_disk_load_failures": stats.kv_disk_load_failures_total,
                  "spec_drafted_tokens": stats.spec_drafted_tokens_total,
                  "spec_accepted_tokens": stats.spec_accepted_tokens_total,
                  "spec_verify_steps": stats.spec_verify_steps_total,
                  "spec_acceptance_rate": stats.spec_acceptance_rate,
                  "spec_mean_accepted_length": stats.spec_mean_accepted_length,
                  "images_encoded": stats.images_encoded_total}
        for name, value in values.items():
            self.gauges[name].set(value)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def status_router(metrics: ServerMetrics, root_page: bool) -> APIRouter:
    """GET /health (the served model's name) and GET /metrics (Prometheus' text format); HEAD on / and /health, the
    probes clients send before they talk (Claude Code's HEAD /); without the browser UI at /, GET / says the server
    runs, as Ollama's "Ollama is running" (clients that find an Ollama server by it)."""
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": metrics.host.name}

    if root_page:  # else the browser UI answers / (GET and HEAD)
        @router.api_route("/", methods=["GET", "HEAD"])
        async def running():
            return PlainTextResponse("kvforge is running")

    @router.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router
