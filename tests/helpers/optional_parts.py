"""Optional parts (PostgreSQL, Chromium, a GPU): a test that needs a missing one skips with the reason,
except under KVFORGE_REQUIRE_ALL=1 (CI), where it fails."""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL = os.environ.get("KVFORGE_REQUIRE_ALL") == "1"


def require(condition: bool, reason: str) -> None:
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"KVFORGE_REQUIRE_ALL=1 but {reason}")
    pytest.skip(reason)
