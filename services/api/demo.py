"""The api's pages: `/` links to the demo, the API reference and each service's AsyncAPI page; `/demo` uploads a file
with @weir/upload and the demo app's publishable key (never a secret), then watches it encode and plays what came out.

Both are static but for what `weir up` tells the api: the demo app's publishable key (`WEIR_DEMO_PUBLISHABLE_KEY`,
meant for pages) and the other services' addresses (`WEIR_SERVICE_PAGES`). They are operations routes, which the
guard lets through unchecked (shared/routeclass.py): they carry no one's data.
"""

from __future__ import annotations

import html
import json
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from services.api.settings import ApiSettings
from shared.problems import Problem
from shared.routeclass import OPERATIONS_ROUTE

PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _page(name: str) -> str:
    return resources.files("services.api").joinpath("pages", name).read_text(encoding="utf-8")


def service_pages(value: str) -> dict[str, str]:
    """`name=url,name=url` (WEIR_SERVICE_PAGES) as a mapping; entries without both parts are skipped."""
    pages: dict[str, str] = {}
    for item in value.split(","):
        name, _, url = item.strip().partition("=")
        if name.strip() and url.strip().startswith(("http://", "https://")):
            pages[name.strip()] = url.strip().rstrip("/")
    return pages


def demo_page(publishable_key: str) -> str:
    config = json.dumps({"publishableKey": publishable_key or None})
    # inside <script type="application/json">: no "</" may end the element early
    return _page("demo.html").replace("__WEIR_DEMO_CONFIG__", config.replace("<", "\\u003c"))


def index_page(others: dict[str, str]) -> str:
    links = ['<li><a href="/asyncapi">api</a></li>'] + [
        f'<li><a href="{html.escape(url, quote=True)}/asyncapi">{html.escape(name)}</a></li>'
        for name, url in sorted(others.items())
    ]
    return _page("index.html").replace("__WEIR_ASYNCAPI_LINKS__", "\n  ".join(links))


def page_routes(settings: ApiSettings) -> APIRouter:
    r = APIRouter(tags=["pages"])
    demo = demo_page(settings.demo_publishable_key)
    index = index_page(service_pages(settings.service_pages))
    sdk = settings.sdk_js_dir / "index.js"

    @r.get("/", response_class=HTMLResponse, include_in_schema=False, **OPERATIONS_ROUTE)
    async def home() -> HTMLResponse:
        return HTMLResponse(index, headers=PAGE_HEADERS)

    @r.get("/demo", response_class=HTMLResponse, include_in_schema=False, **OPERATIONS_ROUTE)
    async def demo_html() -> HTMLResponse:
        return HTMLResponse(demo, headers=PAGE_HEADERS)

    @r.get("/demo/weir-upload.js", include_in_schema=False, **OPERATIONS_ROUTE)
    async def sdk_js() -> Response:
        try:
            body = sdk.read_bytes()
        except OSError as exc:
            raise Problem(503, "unavailable", f"@weir/upload is not at {sdk} (WEIR_SDK_JS_DIR)") from exc
        return Response(body, media_type="text/javascript", headers=PAGE_HEADERS)

    return r
