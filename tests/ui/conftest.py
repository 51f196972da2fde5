"""Fixtures of the browser tests."""

from __future__ import annotations

import pytest

from tests.helpers.chromium import launch_browser


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium for one test module (a missing browser skips, or fails under KVFORGE_REQUIRE_ALL=1)."""
    with launch_browser() as browser:
        yield browser
