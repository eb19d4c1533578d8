"""Debian's chromium, driven by Playwright: the browser tier.

The browser is the system one (``executable_path``); ``playwright install`` is never run (no
browser is downloaded). ``make chromium`` installs it with apt-get where it is missing, and
``make test`` does that first. Without it the tier fails with the cause; it is never skipped.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, async_playwright

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
#: Headless, and nothing that reaches past 127.0.0.1 (no updates, sync, QUIC or first run).
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    """A fresh chromium profile for one test."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no chromium at {CHROMIUM}: `make chromium` installs Debian's "
                    "(apt-get install chromium, as root); the browser tier is never skipped",
                    pytrace=False)
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=ARGS, viewport={"width": 1280, "height": 900}, locale="en-GB",
            timezone_id="UTC")
        try:
            yield context
        finally:
            await context.close()
