"""What every route of one server shares: the model host, the one admission gate, the metrics and the generation
limits `kvforge serve` was started with. create_app (app/server.py) builds it once and hands it to each router."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.app.generate.admission import Admission
from kvforge.app.http.metrics import ServerMetrics
from kvforge.app.models.host import ModelHost


@dataclass(frozen=True)
class ServerContext:
    host: ModelHost
    admission: Admission
    metrics: ServerMetrics
    default_max_tokens: int  # a request that names no max_tokens gets this (bounded by the context window; 0: none)
    request_timeout_s: float | None  # a request still generating after this is aborted (None: never)

    @classmethod
    def build(cls, host: ModelHost, max_pending: int, default_max_tokens: int,
              request_timeout_s: float | None) -> ServerContext:
        admission = Admission(host, max_pending)
        return cls(host, admission, ServerMetrics(host, admission), default_max_tokens, request_timeout_s)
