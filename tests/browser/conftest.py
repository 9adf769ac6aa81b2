"""Real headless Chromium (Debian's `chromium`, which the Makefile installs), driven by Playwright.

A page's requests can be fenced to the stack: `fence(context)` lets through only 127.0.0.1 and localhost, aborts any
other address, and records every request (the targets of redirects too, which a route handler never sees: the
api's playback answers redirect to storage), so a test asserts that nothing asked for the internet. In CI these tests
run and are never skipped: a missing browser is a failure that says how to install it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser, BrowserContext, Request, Route, async_playwright

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
    """Every request the pages of one context made, and those that left the stack (aborted, or seen and counted when
    a redirect led there)."""

    requests: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


async def fence(context: BrowserContext) -> Fence:
    seen = Fence()

    def local(url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in ("data", "blob") or parts.hostname in LOCAL_HOSTS

    def issued(request: Request) -> None:
        seen.requests.append(request.url)
        if not local(request.url):
            seen.outside.append(request.url)

    async def route(r: Route) -> None:
        if local(r.request.url):
            await r.continue_()
        else:
            await r.abort("blockedbyclient")

    context.on("request", issued)
    await context.route("**/*", route)
    return seen
