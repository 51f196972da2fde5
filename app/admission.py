"""Admission: the one gate every request that runs the model passes — the OpenAI routes, the sessions API,
the browser UI and any later API — before its prompt is rendered or tokenized.

At most `max_pending` requests are admitted at once, counting those still preparing their prompt and
those waiting out a model swap, so a burst of requests cannot queue unbounded work; the next one gets
503 with Retry-After. A ticket holds its place (and the model, which cannot be swapped under it) until
released, once, however the request ends.
"""

from __future__ import annotations

from kvforge.app.errors import APIError
from kvforge.app.models import ModelHost, NoModelLoaded
from kvforge.core.async_engine import AsyncEngine

RETRY_AFTER_S = 1


class Ticket:
    def __init__(self, admission: Admission, engine: AsyncEngine) -> None:
        self.admission, self.engine = admission, engine
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.admission.host.release()
            self.admission.pending -= 1


class Admission:
    def __init__(self, host: ModelHost, max_pending: int) -> None:
        self.host, self.max_pending = host, max_pending
        self.pending = 0  # admitted and not yet released: preparing, waiting for a swap, or in the engine

    def check_open(self) -> None:
        """503 when full or when no model is loaded, before anything is read or rendered."""
        if self.pending >= self.max_pending:
            raise APIError(503, f"the server is busy ({self.max_pending} requests in flight); retry later", None,
                           "server_busy", "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.check_loaded()

    def check_loaded(self) -> None:
        """503 when no model is loaded and none is being loaded."""
        if self.host.engine is None and not self.host.swapping:
            raise APIError(503, "no model is loaded; load one with POST /admin/models/load", None, "server_error",
                           "no_model")

    def check_model(self, name: str | None) -> None:
        """503 when no model is loaded; 404 when a request names a model other than the one served (no name, or
        "", asks for that one). Not checked during a model swap, when the served name is changing."""
        self.check_loaded()  # before the name check: with no model there is no name to compare
        if name not in (None, "", self.host.name) and not self.host.swapping:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.host.name!r}", "model",
                           "not_found_error", "model_not_found")

    async def enter(self) -> Ticket:
        self.check_open()
        self.pending += 1
        try:
            engine = await self.host.acquire()  # waits while a model swap is in progress
        except NoModelLoaded as exc:
            self.pending -= 1
            raise APIError(503, str(exc), None, "server_error", "no_model") from None
        except BaseException:
            self.pending -= 1
            raise
        return Ticket(self, engine)
