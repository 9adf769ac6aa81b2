"""Every service's /docs and /asyncapi in real headless Chromium with no internet (issue 17): the five services run as
processes beside the session's PostgreSQL, S3 and NATS, and each page's context is fenced, so any request that is not
to 127.0.0.1 or localhost is aborted and recorded.

Each page must render what it documents (the api's operations; each service's subjects) from the service's own
/static/vendor/ files, and ask nothing of anyone else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from playwright.async_api import Browser, Page

from shared.settings import CommonSettings
from shared.webpages import ASYNCAPI_CSS, ASYNCAPI_JS, SWAGGER_CSS, SWAGGER_JS, VENDOR_PREFIX
from tests.browser.conftest import Fence, fence
from tests.integration.apihelpers import Services, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

SERVICES = ("auth", "api", "encode", "media", "sweep")
RENDER_TIMEOUT_MS = 30_000  # the AsyncAPI bundle is 3 MB of script to parse; generous on a busy machine

# a subject each service's AsyncAPI document has (its /asyncapi.json), which its page must show
SUBJECTS = {
    "auth": "auth.check",  # request/reply, declared when it starts
    "api": "video.created",  # an event it publishes
    "encode": "upload.completed",  # an event it consumes
    "media": "encode.progress",  # an event it publishes
    "sweep": "video.retired",  # an event it publishes
}


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), names=SERVICES) as s:
        yield s


@dataclass
class Visit:
    page: Page
    fence: Fence
    errors: list[str] = field(default_factory=list)  # the page's uncaught script errors


async def visit(browser: Browser, url: str) -> Visit:
    context = await browser.new_context()
    seen = await fence(context)
    page = await context.new_page()
    v = Visit(page, seen)
    page.on("pageerror", lambda exc: v.errors.append(str(exc)))
    answer = await page.goto(url)
    assert answer is not None and answer.status == 200, f"{url}: {answer and answer.status}"
    return v


def asked_for(v: Visit, origin: str, *names: str) -> None:
    """The page loaded each of these files from its own service (so it did not pass by loading nothing)."""
    for name in names:
        assert f"{origin}{VENDOR_PREFIX}{name}" in v.fence.requests, (name, v.fence.requests)


def stayed_local(v: Visit) -> None:
    assert v.fence.outside == [], f"asked outside the stack: {v.fence.outside}"
    assert v.errors == [], v.errors


async def test_every_asyncapi_document_has_the_subject_its_page_must_show(services: Services) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        for name, subject in SUBJECTS.items():
            answer = await http.get(f"{services.urls[name]}/asyncapi.json")
            assert answer.status_code == 200, (name, answer.text[:300])
            addresses = {c.get("address") for c in answer.json().get("channels", {}).values()}
            assert subject in addresses, (name, sorted(a for a in addresses if a))


async def test_the_apis_docs_render_its_operations_offline(services: Services, browser: Browser) -> None:
    origin = services.urls["api"]
    v = await visit(browser, f"{origin}/docs")
    try:
        operation = v.page.locator('.opblock.opblock-post:has(.opblock-summary-path[data-path="/v1/videos"])')
        await operation.first.wait_for(timeout=RENDER_TIMEOUT_MS)
        text = await operation.first.inner_text()
        assert "POST" in text and "/v1/videos" in text, text
        asked_for(v, origin, SWAGGER_JS, SWAGGER_CSS)
        assert f"{origin}/openapi.json" in v.fence.requests
        stayed_local(v)
    finally:
        await v.page.context.close()


@pytest.mark.parametrize("name", SERVICES)
async def test_each_services_asyncapi_page_names_its_subjects_offline(services: Services, browser: Browser,
                                                                     name: str) -> None:
    origin = services.urls[name]
    v = await visit(browser, f"{origin}/asyncapi")
    try:
        rendered = v.page.locator("#asyncapi")  # the component's output, not the document inside the <script>
        await rendered.get_by_text(SUBJECTS[name], exact=True).filter(visible=True).first.wait_for(
            timeout=RENDER_TIMEOUT_MS)
        assert f"weir {name}" in await rendered.inner_text()
        asked_for(v, origin, ASYNCAPI_JS, ASYNCAPI_CSS)
        stayed_local(v)
    finally:
        await v.page.context.close()


@pytest.mark.parametrize("name", ["auth", "encode", "media", "sweep"])
async def test_each_services_docs_render_offline(services: Services, browser: Browser, name: str) -> None:
    """The other services' /docs: their operations routes (`/healthz`), from the same local files."""
    origin = services.urls[name]
    v = await visit(browser, f"{origin}/docs")
    try:
        operation = v.page.locator('.opblock.opblock-get:has(.opblock-summary-path[data-path="/healthz"])')
        await operation.first.wait_for(timeout=RENDER_TIMEOUT_MS)
        asked_for(v, origin, SWAGGER_JS, SWAGGER_CSS)
        stayed_local(v)
    finally:
        await v.page.context.close()
