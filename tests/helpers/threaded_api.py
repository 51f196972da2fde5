"""The OpenAI-compatible app over the shared embedded engine, served by uvicorn in a thread (faster to start
than a `kvforge serve` process), and an `openai` client for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import LLM, AsyncEngine


@contextmanager
def threaded_api(llm: LLM, model: str, api_key: str, max_pending: int = 8) -> Iterator[tuple[str, AsyncEngine]]:
    """(base URL, the AsyncEngine serving `llm`'s engine) while the server runs."""
    engine = AsyncEngine(llm.engine)
    try:
        with serve_in_thread(create_app(engine, model, api_key=api_key, max_pending=max_pending)) as url:
            yield url, engine
    finally:
        engine.close()


def openai_client(url: str, api_key: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)
