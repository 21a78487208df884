"""The console in a real browser for tests: Debian's Chromium driven by Playwright, and a page signed
in with the link ``fleet console`` prints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

from playwright.async_api import Browser, Page, async_playwright

from fleetctl.testing.e2e import Stack, fleet

CHROMIUM_FLAGS = [
    "--no-sandbox",  # the tests may run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # No calls home: the machines these tests run on have no internet, and refused connections
    # only slow Chromium down.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    """Chromium's executable (``FLEET_CHROMIUM``, or Debian's ``chromium``)."""
    found = os.environ.get("FLEET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "the console tests need Chromium: Debian's chromium package (scripts/dev test installs it)"
    return found


@contextlib.asynccontextmanager
async def launched() -> AsyncIterator[Browser]:
    """A headless Chromium for the block."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            await browser.close()


def sign_in_link(stack: Stack, tenant: str) -> str:
    """The one-time sign-in link ``fleet console`` prints for the operator of ``tenant``."""
    result = fleet("console", "--data-dir", stack.data_dir, "--tenant", tenant, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    assert answer["console"] == stack.endpoints["console"]
    link: str = answer["sign_in"]
    return link


async def signed_in(stack: Stack, browser: Browser, tenant: str, *, height: int = 900) -> Page:
    """A page of the console, signed in as the operator of ``tenant`` with the link it printed."""
    page = await browser.new_page(viewport={"width": 1400, "height": height})
    await page.goto(await asyncio.to_thread(sign_in_link, stack, tenant))
    await page.wait_for_url(f"{stack.endpoints['console']}/")
    return page
