"""Every service's docs pages, `/docs` (Swagger UI) and `/asyncapi` (AsyncAPI's React component), with their scripts
and stylesheets served by the service itself; the api's demo page takes its HLS player (hls.js) from the same place.

FastAPI's and FastStream's pages load them from CDNs, so offline or behind a firewall they stay blank. Here a page
names only `/static/vendor/...`, an allowlist of files from the npm packages in `web/` (`make install`); without
them the pages answer a 503 problem that says how to install them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from faststream.specification import Specification
from faststream.specification.asyncapi.site import get_asyncapi_html

from shared.problems import problem
from shared.routeclass import OPERATIONS_ROUTE

VENDOR_PREFIX = "/static/vendor/"
SWAGGER_JS = "swagger-ui-dist/swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui-dist/swagger-ui.css"
FAVICON = "swagger-ui-dist/favicon-32x32.png"
ASYNCAPI_JS = "@asyncapi/react-component/browser/standalone/index.js"
ASYNCAPI_CSS = "@asyncapi/react-component/styles/default.min.css"
HLS_JS = "hls.js/dist/hls.min.js"  # the demo's player (services/api/pages/demo.html): a UMD build, sets window.Hls

# all that /static/vendor/ serves, by path under the assets dir (node_modules' own layout), with its content type:
# a name not here is a 404 whatever the file system holds, so no path can reach anything else
VENDOR_FILES: Mapping[str, str] = {
    SWAGGER_JS: "text/javascript; charset=utf-8",
    SWAGGER_CSS: "text/css; charset=utf-8",
    FAVICON: "image/png",
    ASYNCAPI_JS: "text/javascript; charset=utf-8",
    ASYNCAPI_CSS: "text/css; charset=utf-8",
    HLS_JS: "text/javascript; charset=utf-8",
}
# the files change only with web/package-lock.json, and then with a restart; a day bounds how long a browser keeps
# an old copy after an upgrade (their URLs carry no version)
VENDOR_CACHE = "public, max-age=86400"

# FastStream's page links four favicons on www.asyncapi.com and get_asyncapi_html takes no favicon parameter: they
# are replaced by one of the service's own (otherwise every view of the page asks asyncapi.com)
_ASYNCAPI_FAVICONS = re.compile(r'[ \t]*<link rel="icon"[^>]*href="https?://[^"]*"[^>]*>\n?')


def install_docs_pages(app: FastAPI, *, title: str, asyncapi: Callable[[], Specification], assets_dir: Path) -> None:
    """`/docs` (and its `/docs/oauth2-redirect`), `/asyncapi` and `/static/vendor/{path}` on `app`, which must be
    made with `docs_url=None` (FastAPI's own /docs would win, and it asks a CDN). `asyncapi` gives the document of
    `/asyncapi.json` at each request; `assets_dir` holds the npm packages (WEIR_WEB_ASSETS_DIR)."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("make the app with docs_url=None, redoc_url=None: FastAPI's own pages load a CDN's scripts")

    def missing() -> JSONResponse | None:
        absent = [name for name in VENDOR_FILES if not (assets_dir / name).is_file()]
        if not absent:
            return None
        return problem(503, "unavailable", "the pages' scripts and stylesheets are not installed: run `make "
                       "install` (npm ci --prefix web), or point WEIR_WEB_ASSETS_DIR at web/node_modules",
                       missing=absent)

    def vendor(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{VENDOR_PREFIX}{name}"

    @app.get(VENDOR_PREFIX + "{path:path}", include_in_schema=False, **OPERATIONS_ROUTE)
    async def vendor_file(path: str) -> Response:
        media_type = VENDOR_FILES.get(path)
        if media_type is None:
            return problem(404, "not_found", "no such file among the pages' scripts and stylesheets")
        return missing() or FileResponse(assets_dir / path, media_type=media_type, headers={
            "Cache-Control": VENDOR_CACHE, "X-Content-Type-Options": "nosniff"})

    if app.openapi_url is not None:
        openapi_url = app.openapi_url
        redirect_path = "/docs/oauth2-redirect"

        @app.get("/docs", include_in_schema=False, **OPERATIONS_ROUTE)
        async def swagger_ui(request: Request) -> Response:
            root = request.scope.get("root_path", "")
            return missing() or get_swagger_ui_html(
                openapi_url=root + openapi_url, title=f"{title} - Swagger UI",
                swagger_js_url=vendor(request, SWAGGER_JS), swagger_css_url=vendor(request, SWAGGER_CSS),
                swagger_favicon_url=vendor(request, FAVICON), oauth2_redirect_url=root + redirect_path,
                # null: no validator badge, which would send the document's address to validator.swagger.io
                swagger_ui_parameters={"validatorUrl": None})

        @app.get(redirect_path, include_in_schema=False, **OPERATIONS_ROUTE)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get("/asyncapi", include_in_schema=False, **OPERATIONS_ROUTE)
    async def asyncapi_page(request: Request) -> Response:
        unavailable = missing()
        if unavailable is not None:
            return unavailable
        html = get_asyncapi_html(asyncapi(), asyncapi_js_url=vendor(request, ASYNCAPI_JS),
                                 asyncapi_css_url=vendor(request, ASYNCAPI_CSS), try_it_out_path=None)
        icon = f'<link rel="icon" type="image/png" href="{vendor(request, FAVICON)}">'
        html = _ASYNCAPI_FAVICONS.sub("", html).replace("</title>", f"</title>\n        {icon}", 1)
        return HTMLResponse(html)
