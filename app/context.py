"""What every route of one server shares: the model host, the one admission gate, the metrics and the generation
limits `kvforge serve` was started with. create_app (app/server.py) builds it once and hands it to each router."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.app.generate.admission import Admission
from kvforge.app.http.metrics import ServerMetrics
from kvforge.app.models.host import ModelHost
from kvforge.app.settings import serve_default


@dataclass(frozen=True)
class ServerContext:
    host: ModelHost
    admission: Admission
    metrics: ServerMetrics
    default_max_tokens: int  # a request that names no max_tokens gets this (bounded by the context window; 0: none)
    request_timeout_s: float | None  # a request still generating after this is aborted (None: never)
    # a chat longer than its context: "truncate" (its oldest turns left out: app/generate/context_fit.py) or "error"
    context_overflow: str = serve_default("context_overflow")
    picture_hosts: frozenset[str] = frozenset()  # hosts whose image URLs are fetched (--image-url-hosts)

    @classmethod
    def build(cls, host: ModelHost, max_pending: int, default_max_tokens: int,
              request_timeout_s: float | None, context_overflow: str = serve_default("context_overflow"),
              picture_hosts: frozenset[str] = frozenset()) -> ServerContext:
        admission = Admission(host, max_pending)
        return cls(host, admission, ServerMetrics(host, admission), default_max_tokens, request_timeout_s,
                   context_overflow, picture_hosts)
