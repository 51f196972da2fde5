"""Shared fixtures: the embedded model, HF transformers references, and greedy-parity checks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
REQUIRE_ALL = os.environ.get("KVFORGE_REQUIRE_ALL") == "1"


def require(condition: bool, reason: str) -> None:
    """Skip when an optional part is missing, except under KVFORGE_REQUIRE_ALL=1 (CI), where it fails."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"KVFORGE_REQUIRE_ALL=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def embedded_path():
    from kvforge.core.loader import ModelNotFoundError, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        require(False, str(exc))


@pytest.fixture(scope="session")
def embedded_llm(embedded_path):
    from kvforge.core import LLM

    return LLM(str(embedded_path), progress=False, kv_cache_bytes=256 << 20)


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.manual_seed(0)
    yield
