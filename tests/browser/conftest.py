"""Real headless Chromium (Debian's `chromium`, which the Makefile installs), driven by Playwright.

A page's requests can be fenced to the stack: `fence(context)` lets through only 127.0.0.1 and localhost, aborts any
other address, and records every request, so a test asserts that nothing asked for the internet. In CI these tests
run and are never skipped: a missing browser is a failure that says how to install it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser, BrowserContext, Route, async_playwright

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})


def chromium_path() -> str:
    path = os.environ.get("WEIR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no Chromium: `make install` installs Debian's chromium (apt-get install chromium), "
                    "or point WEIR_CHROMIUM at one")
    return path


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=chromium_path(), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            await b.close()


@dataclass
class Fence:
    """Every request the pages of one context made, and those that left the stack (aborted)."""

    requests: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


async def fence(context: BrowserContext) -> Fence:
    seen = Fence()

    async def route(r: Route) -> None:
        url = r.request.url
        seen.requests.append(url)
        parts = urlsplit(url)
        if parts.scheme in ("data", "blob") or parts.hostname in LOCAL_HOSTS:
            await r.continue_()
        else:
            seen.outside.append(url)
            await r.abort("blockedbyclient")

    await context.route("**/*", route)
    return seen
