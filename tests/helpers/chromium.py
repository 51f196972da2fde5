"""Debian's Chromium driven by Playwright (no `playwright install`), for the browser tests; a missing
part skips (or fails under KVFORGE_REQUIRE_ALL=1)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.optional_parts import require

CHROMIUM = "/usr/bin/chromium"
# the resolver rule stops Chromium's own lookups of outside hosts, so only the page's requests go out
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
RESOLVER_RULES = "MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"


@contextmanager
def launch_browser(to_loopback: tuple[str, ...] = ()) -> Iterator:
    """`to_loopback`: host names Chromium resolves to 127.0.0.1 (a DNS-rebinding attacker's name, say)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "playwright is not installed (pip install playwright)")
    require(shutil.which(CHROMIUM) is not None, f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        rules = ", ".join([*(f"MAP {name} 127.0.0.1" for name in to_loopback), RESOLVER_RULES])
        browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                             args=[*CHROMIUM_ARGS, f"--host-resolver-rules={rules}"])
        try:
            yield browser
        finally:
            browser.close()
