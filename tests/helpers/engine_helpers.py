"""Helpers shared by the engine tests that step the embedded model's LLMEngine directly."""

from __future__ import annotations

import time

from kvforge.core import LLM


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_pool.num_used == 0
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def drain(engine, max_steps: int = 1000) -> dict[str, list]:
    """Step until done; every RequestOutput per request id, in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def async_idle(engine) -> bool:
    """An AsyncEngine with nothing unfinished and no KV block in use."""
    return not engine.engine.has_unfinished() and engine.engine.block_pool.num_used == 0


def wait_idle(engine, timeout: float = 20) -> bool:
    """Poll an AsyncEngine (whose loop runs in its own thread) until it is idle or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if async_idle(engine):
            return True
        time.sleep(0.05)
    return False
