"""Uploads from a page in real headless Chromium, with @weir/upload, against api and auth as processes beside the
session's PostgreSQL, S3 and NATS (issue 14).

The page is an app's own: a small HTTP server on 127.0.0.1 serves a blank page and the SDK's module, as an app hosts
its bundle. The app allows that origin; the same server reached as `localhost` is another origin, which it does not.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page

from shared.authcheck import AppCreated
from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.settings import CommonSettings
from tests.browser.conftest import fence
from tests.integration.apihelpers import UNLIMITED, Services, completed_events, free_port, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

SDK_SRC = Path(__file__).resolve().parents[2] / "sdk" / "js" / "src"
MiB = 1024 * 1024
PART = 5 * MiB  # the api's part_size_min: a 12 MiB file is 3 parts (5 + 5 + 2)

# The page's own code: a File of `size` bytes from a seeded generator (the same bytes after a reload), beginning
# with an MP4's first box so the api's content check accepts it, and an upload whose events the test can read.
PAGE_JS = """
async ({apiUrl, publishableKey, size, seed, options, pauseAfterFirstPart}) => {
  const { upload } = await import("/weir-upload.js");
  const bytes = new Uint8Array(size);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < size; i += 4) {  // xorshift32: cheap, and the same every time for the same seed
    x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
    bytes[i] = x & 255; bytes[i + 1] = (x >>> 8) & 255; bytes[i + 2] = (x >>> 16) & 255; bytes[i + 3] = x >>> 24;
  }
  bytes.set([0, 0, 0, 0x20, ...new TextEncoder().encode("ftypisom")]);
  const file = new File([bytes], `clip-${seed}.mp4`, { type: "video/mp4", lastModified: seed });
  const seen = window.seen = { progress: [], parts: [], resumed: null, retries: 0, done: false, error: null,
                               video: null, videoId: null };
  const up = window.up = upload(file, { apiUrl, publishableKey }, { storage: localStorage, ...options });
  up.on("progress", (p) => seen.progress.push(p));
  up.on("resumed", (r) => { seen.resumed = r; });
  up.on("retry", () => { seen.retries++; });
  up.on("part", (p) => {
    seen.parts.push(p.partNumber);
    if (pauseAfterFirstPart && seen.parts.length === 1) { up.pause(); seen.pausedAfterFirst = true; }
  });
  up.promise.then((v) => { seen.video = v; }, (e) => { seen.error = { code: e.code, message: e.message }; })
    .finally(() => { seen.videoId = up.videoId; seen.done = true; });
}
"""


@dataclass
class AppPages:
    port: int

    @property
    def allowed(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def other(self) -> str:  # the same server by another name: another origin, which the app does not allow
        return f"http://localhost:{self.port}"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        if self.path in ("/", "/index.html"):
            body = b"<!DOCTYPE html><html><head><link rel=icon href='data:,'></head><body>an app</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None
        if self.path == "/weir-upload.js":  # the app's copy of the SDK, as its bundle would carry it
            self.path = "/index.js"
        return super().send_head()


@pytest.fixture(scope="module")
def app_pages() -> Iterator[AppPages]:
    SimpleHTTPRequestHandler.extensions_map[".js"] = "text/javascript"
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), partial(_Quiet, directory=str(SDK_SRC)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield AppPages(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), **UNLIMITED) as s:
        yield s


@pytest.fixture(scope="module")
async def app(services: Services, prepared: CommonSettings, app_pages: AppPages) -> AppCreated:
    nc = await connect(prepared, name="test")
    try:
        _, created = await create_account_with_app(nc, "browser", allowed_origins=(app_pages.allowed,))
    finally:
        await nc.close()
    return created


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context()
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def _finished(page: Page, timeout: float = 60) -> dict[str, Any]:
    await page.wait_for_function("window.seen && window.seen.done", timeout=timeout * 1000)
    seen: dict[str, Any] = await page.evaluate("window.seen")
    return seen


def _storage_puts(requests: list[str], s3_endpoint: str) -> list[str]:
    return [u for u in requests if u.startswith(f"PUT {s3_endpoint}")]


async def _listed(services: Services, app: AppCreated) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{services.api_url}/v1/videos", headers={"Authorization": f"Bearer {app.secret_key}"})
    assert r.status_code == 200, r.text
    videos: list[dict[str, Any]] = r.json()["videos"]
    return videos


async def test_a_12_mib_file_uploads_in_3_parts_and_publishes_one_upload_completed(
    page: Page, services: Services, app: AppCreated, app_pages: AppPages, prepared: CommonSettings
) -> None:
    seen_requests = await fence(page.context)
    methods: list[str] = []
    page.on("request", lambda r: methods.append(f"{r.method} {r.url}"))
    await page.goto(app_pages.allowed)
    size = 12 * MiB
    await page.evaluate(PAGE_JS, {"apiUrl": services.api_url, "publishableKey": app.publishable_key, "size": size,
                                  "seed": 1, "options": {}, "pauseAfterFirstPart": False})
    seen = await _finished(page)
    assert seen["error"] is None, seen["error"]
    video = seen["video"]
    assert video["status"] == "uploaded" and video["file"] == {"size": size, "content_type": "video/mp4"}
    assert sorted(seen["parts"]) == [1, 2, 3] == list(range(1, -(-size // PART) + 1))
    assert len(_storage_puts(methods, prepared.s3_endpoint)) == 3  # one PUT a part, straight to storage
    sent = [p["sent"] for p in seen["progress"]]
    assert sent == sorted(sent) and seen["progress"][-1] == {"sent": size, "total": size}
    assert len(await completed_events(prepared, video["id"], expect=1)) == 1
    await asyncio.sleep(0.5)  # a second event would have been published with the first
    assert len(await completed_events(prepared, video["id"], expect=2, wait=0)) == 1
    assert seen_requests.outside == []


async def test_cut_off_after_the_first_part_the_reloaded_page_resumes_and_completes_once(
    page: Page, services: Services, app: AppCreated, app_pages: AppPages, prepared: CommonSettings
) -> None:
    methods: list[str] = []
    page.on("request", lambda r: methods.append(f"{r.method} {r.url}"))
    await page.goto(app_pages.allowed)
    size = 12 * MiB
    args = {"apiUrl": services.api_url, "publishableKey": app.publishable_key, "size": size, "seed": 2,
            "options": {"concurrency": 1, "maxAttempts": 2, "backoffBaseMs": 50}, "pauseAfterFirstPart": True}
    await page.evaluate(PAGE_JS, args)
    await page.wait_for_function("window.seen && window.seen.pausedAfterFirst", timeout=60_000)
    await page.context.set_offline(True)  # the network goes away after part 1 is stored
    await page.evaluate("window.up.resume()")
    seen = await _finished(page)
    assert seen["error"] is not None and seen["error"]["code"] == "network_error", seen
    assert seen["parts"] == [1] and seen["retries"] >= 1
    video_id = seen["videoId"]
    assert (await page.evaluate("Object.keys(localStorage)")) == ["weir-upload:clip-2.mp4:12582912:2:video/mp4"]

    await page.context.set_offline(False)
    await page.reload()  # the page starts over: only localStorage knows the upload
    methods.clear()
    await page.evaluate(PAGE_JS, {**args, "pauseAfterFirstPart": False})
    seen = await _finished(page)
    assert seen["error"] is None, seen["error"]
    assert seen["videoId"] == video_id and seen["video"]["status"] == "uploaded"
    assert seen["resumed"] == {"stored": 1, "missing": 2}
    assert sorted(seen["parts"]) == [2, 3]
    assert len(_storage_puts(methods, prepared.s3_endpoint)) == 2  # part 1 was not sent again
    assert seen["video"]["file"]["size"] == size
    assert len(await completed_events(prepared, video_id, expect=1)) == 1
    await asyncio.sleep(0.5)
    assert len(await completed_events(prepared, video_id, expect=2, wait=0)) == 1
    assert await page.evaluate("Object.keys(localStorage)") == []  # done: nothing left to resume


async def test_a_page_on_an_origin_the_app_does_not_allow_creates_nothing_and_reads_nothing(
    page: Page, services: Services, app: AppCreated, app_pages: AppPages
) -> None:
    await page.goto(app_pages.other)
    before = {v["id"] for v in await _listed(services, app)}
    # the SDK's own way: its create fails as the browser reports it (a blocked response is a network error)
    await page.evaluate(PAGE_JS, {"apiUrl": services.api_url, "publishableKey": app.publishable_key,
                                  "size": 6 * MiB, "seed": 3, "options": {"maxAttempts": 1},
                                  "pauseAfterFirstPart": False})
    seen = await _finished(page)
    assert seen["error"] is not None and seen["error"]["code"] == "network_error" and seen["parts"] == []
    # by hand: every answer the page asks for, success or refusal, is unreadable to it
    async with httpx.AsyncClient(timeout=10) as http:  # a video and token made by the app's server
        created = await http.post(f"{services.api_url}/v1/videos", json={"name": "server-made"},
                                  headers={"Authorization": f"Bearer {app.secret_key}"})
    assert created.status_code == 201, created.text
    token, video_id = created.json()["upload_token"], created.json()["id"]
    outcomes = await page.evaluate("""async ({apiUrl, key, token, videoId}) => {
      const tries = {
        create: [`${apiUrl}/sdk/v1/videos`, {method: "POST", headers: {Authorization: `Bearer ${key}`,
                 "Content-Type": "application/json"}, body: JSON.stringify({name: "x"})}],
        create_simple: [`${apiUrl}/sdk/v1/videos`, {method: "POST", headers: {Authorization: `Bearer ${key}`}}],
        status: [`${apiUrl}/sdk/v1/videos/${videoId}`, {headers: {Authorization: `Bearer ${token}`}}],
        parts: [`${apiUrl}/sdk/v1/videos/${videoId}/upload/parts`, {headers: {Authorization: `Bearer ${token}`}}],
        refused: [`${apiUrl}/sdk/v1/videos/${videoId}`, {headers: {Authorization: "Bearer wut_forged"}}],
      };
      const out = {};
      for (const [name, [url, init]] of Object.entries(tries)) {
        try { const r = await fetch(url, init); out[name] = `read ${r.status}`; }
        catch (e) { out[name] = e.name; }
      }
      return out;
    }""", {"apiUrl": services.api_url, "key": app.publishable_key, "token": token, "videoId": video_id})
    assert outcomes == dict.fromkeys(("create", "create_simple", "status", "parts", "refused"), "TypeError"), outcomes
    after = {v["id"] for v in await _listed(services, app)}
    assert after - before == {video_id}  # only the server's video: the page created none


async def test_the_allowed_origin_reads_answers_and_refusals_with_their_limit_headers(
    page: Page, services: Services, app: AppCreated, app_pages: AppPages
) -> None:
    await page.goto(app_pages.allowed)
    got = await page.evaluate("""async ({apiUrl, key}) => {
      const create = (name) => fetch(`${apiUrl}/sdk/v1/videos`, {method: "POST", headers: {
        Authorization: `Bearer ${key}`, "Content-Type": "application/json"}, body: JSON.stringify({name})});
      const r = await create("allowed");
      const video = await r.json();
      const other = await (await create("another")).json();
      const s = await fetch(`${apiUrl}/sdk/v1/videos/${video.id}`,
                            {headers: {Authorization: `Bearer ${video.upload_token}`}});
      // the token's app is known, so its refusal is readable: a token for one video used on another
      const refused = await fetch(`${apiUrl}/sdk/v1/videos/${other.id}/upload/parts`,
                                  {headers: {Authorization: `Bearer ${video.upload_token}`}});
      return {create: r.status, policy: r.headers.get("RateLimit-Policy"), limit: r.headers.get("X-RateLimit-Limit"),
              status: s.status, shown: (await s.json()).status, refused: refused.status,
              code: (await refused.json()).code, refusedPolicy: refused.headers.get("RateLimit-Policy")};
    }""", {"apiUrl": services.api_url, "key": app.publishable_key})
    assert got["create"] == 201 and got["policy"] and got["limit"], got
    assert got["status"] == 200 and got["shown"] == "created", got
    assert got["refused"] == 403 and got["code"] == "forbidden" and got["refusedPolicy"], got
