"""Admission: the one gate every request that runs the model passes — the OpenAI routes, the sessions API,
the browser UI and any later API — before its prompt is rendered or tokenized.

At most `max_pending` requests are admitted at once, counting those still preparing their prompt and
those waiting out a model swap or a load on demand (app/models/host.py), so a burst of requests cannot queue
unbounded work; the next one gets 503 with Retry-After. A ticket holds its place (and the model, which cannot
be swapped or unloaded under it) until released, once, however the request ends.
"""

from __future__ import annotations

from kvforge.app.http.errors import APIError
from kvforge.app.models.host import ModelHost, NoModelLoaded
from kvforge.app.models.residents import Lease, ModelUnavailable
from kvforge.app.models.spec import InvalidSpec
from kvforge.core.async_engine import AsyncEngine

RETRY_AFTER_S = 1


class Ticket:
    def __init__(self, admission: Admission, lease: Lease, holders: list[int] | None = None) -> None:
        self.admission, self.lease = admission, lease
        self._held = True
        self._holders = holders if holders is not None else [1]  # the tickets sharing this place, still held

    def split(self, count: int) -> list[Ticket]:
        """This ticket as `count` tickets, one per part of one request (completions' batch of prompts): one place,
        released with the model when the last part's ticket is. This one is then spent."""
        self._held = False
        holders = [count]
        return [Ticket(self.admission, self.lease, holders) for _ in range(count)]

    @property
    def engine(self) -> AsyncEngine:
        return self.lease.engine

    @property
    def model(self) -> str:
        """The name of the model the request runs on (what its response names)."""
        return self.lease.name

    def release(self) -> None:
        if self._held:
            self._held = False
            self._holders[0] -= 1
            if self._holders[0] == 0:
                self.admission.host.release(self.lease)
                self.admission.pending -= 1


class Admission:
    def __init__(self, host: ModelHost, max_pending: int) -> None:
        self.host, self.max_pending = host, max_pending
        self.pending = 0  # admitted and not yet released: preparing, waiting for a swap or a model, or in the engine

    def check_open(self, model: str | None = None) -> None:
        """503 when full, 404 / 503 as check_model for `model`: before anything is read or rendered."""
        if self.pending >= self.max_pending:
            raise APIError(503, f"the server is busy ({self.max_pending} requests in flight); retry later", None,
                           "server_busy", "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.check_model(model)

    def check_loaded(self) -> None:
        """503 when no model is loaded and none is being loaded."""
        if self.host.engine is None and not self.host.swapping:
            raise APIError(503, "no model is loaded; load one with POST /admin/models/load", None, "server_error",
                           "no_model")

    def check_model(self, name: str | None) -> None:
        """404 when a request names no model this server serves or can load; 503 when it asks for the server's own
        model (no name, "", or its name) and none is loaded."""
        try:
            entry = self.host.entry_for(name)
        except LookupError as exc:
            raise APIError(404, str(exc), "model", "not_found_error", "model_not_found") from None
        if entry is None:
            self.check_loaded()

    async def enter(self, model: str | None = None, keep_alive_s: float | None = None) -> Ticket:
        """A place for a request for `model` (None: the server's own), holding that model until released; it waits
        for a swap in progress, or for a model to load (and for room to load it)."""
        self.check_open(model)
        self.pending += 1
        try:
            lease = await self.host.acquire(model, keep_alive_s)
        except NoModelLoaded as exc:
            self.pending -= 1
            raise APIError(503, str(exc), None, "server_error", "no_model") from None
        except LookupError as exc:  # the model went from the models directory meanwhile
            self.pending -= 1
            raise APIError(404, str(exc), "model", "not_found_error", "model_not_found") from None
        except (ModelUnavailable, InvalidSpec) as exc:
            self.pending -= 1
            raise APIError(400, f"model: {exc}", "model") from None
        except BaseException:
            self.pending -= 1
            raise
        return Ticket(self, lease)
