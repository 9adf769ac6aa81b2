"""The docs pages' wiring (shared/webpages.py), without servers: what /docs and /asyncapi name, what /static/vendor/
serves and refuses, the 503 without the npm packages, and the image's copy of the same files.

That the pages really render offline is tests/browser/test_docs_pages.py, in Chromium against the running services.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.testclient import TestClient
from faststream.nats import NatsBroker
from faststream.specification.asyncapi.site import get_asyncapi_html

from shared.messaging import asyncapi_specification
from shared.metrics import Metrics
from shared.runtime import Runtime, ServiceDefinition, build_http
from shared.settings import CommonSettings
from shared.webpages import FAVICON, VENDOR_FILES, VENDOR_PREFIX, install_docs_pages

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "web" / "node_modules"
ORIGIN = "http://testserver"  # TestClient's own
SUBJECT = "unit.docs.subject"
URL = re.compile(r"""https?://[^\s"'<>`)\\]+""")



@pytest.fixture(autouse=True, scope="module")
def installed() -> None:
    if not all((ASSETS / name).is_file() for name in VENDOR_FILES):
        pytest.fail("web/node_modules lacks the docs pages' files: run `make install` (npm ci --prefix web)")


def broker_with_a_subscriber() -> NatsBroker:
    broker = NatsBroker("nats://127.0.0.1:4222")  # never connected: the document needs only the declarations

    @broker.subscriber(SUBJECT, title=SUBJECT)
    async def handle(body: dict[str, str]) -> None:
        pass

    return broker


def docs_app(assets_dir: Path = ASSETS) -> FastAPI:
    app = FastAPI(title="weir unit", docs_url=None, redoc_url=None)
    broker = broker_with_a_subscriber()
    install_docs_pages(app, title=app.title, assets_dir=assets_dir,
                       asyncapi=lambda: asyncapi_specification(broker, service="unit"))
    return app


def foreign_urls(html: str) -> list[str]:
    return [u for u in URL.findall(html) if not u.startswith(ORIGIN + "/") and u != ORIGIN]


def local_assets(html: str) -> set[str]:
    return set(re.findall(r'(?:src|href)="(/static/vendor/[^"]+)"', html))


@pytest.fixture
def client() -> TestClient:
    return TestClient(docs_app())


@pytest.mark.parametrize("page", ["/docs", "/asyncapi", "/docs/oauth2-redirect"])
def test_a_page_names_no_address_but_its_own(client: TestClient, page: str) -> None:
    answer = client.get(page)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    assert foreign_urls(answer.text) == [], answer.text[:2000]


def test_the_address_check_is_not_blind() -> None:
    """FastAPI's and FastStream's own pages name a CDN and asyncapi.com: the check above sees them."""
    fastapi_page = bytes(get_swagger_ui_html(openapi_url="/openapi.json", title="t").body).decode()
    assert {urlsplit(u).hostname for u in foreign_urls(fastapi_page)} >= {"cdn.jsdelivr.net"}
    faststream_page = get_asyncapi_html(asyncapi_specification(broker_with_a_subscriber(), service="unit"),
                                        try_it_out_path=None)
    assert {urlsplit(u).hostname for u in foreign_urls(faststream_page)} >= {"unpkg.com", "www.asyncapi.com"}


@pytest.mark.parametrize(("page", "assets"), [
    ("/docs", {"swagger-ui-dist/swagger-ui-bundle.js", "swagger-ui-dist/swagger-ui.css", FAVICON}),
    ("/asyncapi", {"@asyncapi/react-component/browser/standalone/index.js",
                   "@asyncapi/react-component/styles/default.min.css", FAVICON}),
])
def test_a_page_loads_its_scripts_from_the_service_and_each_is_served(client: TestClient, page: str,
                                                                      assets: set[str]) -> None:
    html = client.get(page).text
    assert local_assets(html) == {VENDOR_PREFIX + name for name in assets}
    for path in local_assets(html):
        answer = client.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["content-type"] == VENDOR_FILES[path.removeprefix(VENDOR_PREFIX)]
        assert answer.content == (ASSETS / path.removeprefix(VENDOR_PREFIX)).read_bytes()
        assert "max-age" in answer.headers["cache-control"]


def test_the_asyncapi_page_has_one_favicon_its_own(client: TestClient) -> None:
    html = client.get("/asyncapi").text
    icons = re.findall(r'<link rel="icon"[^>]*>', html)
    assert icons == [f'<link rel="icon" type="image/png" href="{VENDOR_PREFIX}{FAVICON}">']


def test_the_asyncapi_page_shows_the_document_of_asyncapi_json() -> None:
    """In a service's app as build_http makes it: the document the page renders is /asyncapi.json's."""
    definition = ServiceDefinition(name="unit", settings_cls=CommonSettings, description="the unit test's service")
    settings = CommonSettings(web_assets_dir=ASSETS)
    rt = Runtime(definition=definition, settings=settings, metrics=Metrics("unit"))
    rt.broker = broker_with_a_subscriber()
    app = build_http(rt)
    assert app.docs_url is None and app.redoc_url is None
    client = TestClient(app)
    document = client.get("/asyncapi.json").json()
    assert SUBJECT in json.dumps(document)
    html = client.get("/asyncapi").text
    # FastStream's page: AsyncApiStandalone.render({"schema": "<the document as JSON text>", "config": ...}, ...)
    rendered = re.search(r"AsyncApiStandalone\.render\(\s*(\{.*\}),\s*document\.getElementById", html, re.S)
    assert rendered is not None, html[:2000]
    assert json.loads(json.loads(rendered.group(1))["schema"]) == document
    assert client.get("/docs").status_code == 200
    assert client.get("/redoc").status_code == 404  # dropped: it loads a CDN's script, and /docs says the same


@pytest.mark.parametrize("path", [
    "swagger-ui-dist/package.json",  # in the package, not in the allowlist
    "swagger-ui-dist/index.html",
    "swagger-ui-dist/",
    "",
    "%2e%2e/%2e%2e/package.json",  # web/package.json, through percent-encoded dots
    "swagger-ui-dist/%2e%2e/%2e%2e/package.json",
    "..%2f..%2fpackage.json",
    "swagger-ui-dist%2f..%2f..%2fpackage.json",
])
def test_static_vendor_serves_nothing_outside_its_allowlist(client: TestClient, path: str) -> None:
    answer = client.get(VENDOR_PREFIX + path)
    assert answer.status_code == 404, answer.text[:300]
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["code"] == "not_found"


def test_the_files_a_traversal_would_reach_exist() -> None:
    """So the 404s above are the allowlist's doing, not a missing file's."""
    assert (ASSETS / "swagger-ui-dist" / "package.json").is_file()
    assert (ASSETS / ".." / "package.json").resolve() == ROOT / "web" / "package.json"
    assert (ROOT / "web" / "package.json").is_file()


def test_without_the_npm_packages_the_pages_say_how_to_install_them(tmp_path: Path) -> None:
    client = TestClient(docs_app(tmp_path / "no-such-dir"))
    for path in ("/docs", "/asyncapi", VENDOR_PREFIX + FAVICON):
        answer = client.get(path)
        assert answer.status_code == 503, path
        assert answer.headers["content-type"] == "application/problem+json"
        body = answer.json()
        assert body["code"] == "unavailable" and body["status"] == 503
        assert "make install" in body["detail"] and "npm ci --prefix web" in body["detail"]
        assert set(body["missing"]) == set(VENDOR_FILES)
    assert client.get(VENDOR_PREFIX + "swagger-ui-dist/package.json").status_code == 404


def test_the_pages_need_an_app_without_fastapis_own_docs() -> None:
    with pytest.raises(ValueError, match="docs_url=None"):
        install_docs_pages(FastAPI(), title="t", asyncapi=lambda: asyncapi_specification(
            broker_with_a_subscriber(), service="unit"), assets_dir=ASSETS)


def test_the_default_assets_dir_is_the_repositorys_web_node_modules() -> None:
    clean = {k: v for k, v in os.environ.items() if k != "WEIR_WEB_ASSETS_DIR"}
    with mock.patch.dict(os.environ, clean, clear=True):
        assert CommonSettings().web_assets_dir == ASSETS
    with mock.patch.dict(os.environ, {"WEIR_WEB_ASSETS_DIR": "/opt/weir/web"}):
        assert CommonSettings().web_assets_dir == Path("/opt/weir/web")


def dockerfile_instructions() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(i.split()) for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i.strip()]


def test_the_image_copies_exactly_the_allowlisted_files_where_its_setting_points() -> None:
    instructions = dockerfile_instructions()
    env = [i for i in instructions if i.startswith("ENV WEIR_WEB_ASSETS_DIR=")]
    assert len(env) == 1
    assets_dir = env[0].removeprefix("ENV WEIR_WEB_ASSETS_DIR=")
    copied: set[str] = set()
    for instruction in instructions:
        if not instruction.startswith("COPY --from=web "):
            continue
        *sources, destination = shlex.split(instruction.removeprefix("COPY --from=web "))
        assert destination.startswith(assets_dir + "/") and destination.endswith("/"), instruction
        for source in sources:
            name = source.removeprefix("web/node_modules/")
            assert destination == f"{assets_dir}/{name.rsplit('/', 1)[0]}/", f"{source} lands in {destination}"
            copied.add(name)
    assert copied == set(VENDOR_FILES)
    assert "FROM node:20-slim AS web" in instructions
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "web/node_modules" in ignored  # the context stays small: npm installs in the image's own stage
