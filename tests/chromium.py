"""Debian's Chromium driven by Playwright (no `playwright install`), for the browser tests; a missing
part skips (or fails under KVFORGE_REQUIRE_ALL=1)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from optional_parts import require

CHROMIUM = "/usr/bin/chromium"
# the resolver rule stops Chromium's own lookups of outside hosts, so only the page's requests go out
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]


@contextmanager
def launch_browser() -> Iterator:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "playwright is not installed (pip install playwright)")
    require(shutil.which(CHROMIUM) is not None, f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
