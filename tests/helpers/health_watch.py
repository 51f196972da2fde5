"""/health watched from a thread while a test attacks a server: the slowest answer tells whether the event loop was
ever held (a refused or timed-out request counts as 5 s)."""

from __future__ import annotations

import threading
import time

import httpx


class HealthWatch:
    """GET /health every 0.2 s from a thread; `slowest`: the slowest answer in seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.samples = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.2):
                start = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                self.slowest = max(self.slowest, time.monotonic() - start if ok else 5.0)
                self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
