"""`weir up` as a person uses it, in real headless Chromium: the first page it prints links to the demo, the API
reference and each service's events; the demo takes a file, shows the video's status through `ready`, plays each
rendition (issues 14 and 17), and shows the webhook deliveries its video caused, received over HTTP by the api's demo
receiver and verified with the demo endpoint's secret (issue 31). No page asks for anything outside the stack.

A screenshot of the finished demo is written to .weir/test-artifacts/ and its path printed, for a person to look at.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser

from services.webhooks.settings import WebhookSettings
from tests.browser.conftest import fence
from tests.e2e.test_weir_up import _start_up
from tests.integration.test_encode_helpers import make_source

pytestmark = pytest.mark.asyncio(loop_scope="session")

ARTIFACTS = Path(__file__).resolve().parents[2] / ".weir" / "test-artifacts"
READY_WITHIN_S = 120  # a 2 s 720p source, 360p and 720p on one worker of this 2-core machine, with room for a slow day
# a delivery at SPEC 13's defaults: the first attempt at once, within its timeout; a failed one again after the first
# retry interval (and its jitter); and room for a slow day
_HOOKS = WebhookSettings()
WEBHOOK_WITHIN_S = (_HOOKS.webhook_retry_intervals_seconds[0] * (1 + _HOOKS.webhook_retry_jitter_share)
                    + 2 * _HOOKS.webhook_delivery_timeout_seconds + 20)


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[dict[str, Any]]:
    """`weir up` in a data dir of its own (not pytest's tmp: PostgreSQL runs as its own user and must reach it)."""
    with tempfile.TemporaryDirectory(prefix="weir-demo-") as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc, info, _ = await asyncio.to_thread(_start_up, Path(tmp) / "weir", env)
        try:
            yield {**info, "proc": proc}
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.to_thread(proc.communicate, None, 90)
            assert proc.returncode == 0, out.decode()[-4000:]
            printed = out.decode()
            # what a person reads first: the page to open, then the demo's and the docs' addresses
            api_url = info["api_url"]
            assert f"open {api_url}/ " in printed and f"demo {api_url}/demo" in printed, printed[-3000:]


async def test_the_first_page_links_to_the_demo_the_docs_and_every_services_events(
    browser: Browser, stack: dict[str, Any]
) -> None:
    context = await browser.new_context()
    seen = await fence(context)
    try:
        page = await context.new_page()
        await page.goto(f"{stack['api_url']}/")
        assert await page.get_attribute("#demo-link", "href") == "/demo"
        assert await page.get_attribute("#docs-link", "href") == "/docs"
        links = await page.eval_on_selector_all("#asyncapi-links a", "els => els.map(e => [e.textContent, e.href])")
        services = stack["services"]
        expected = {name: f"{url}/asyncapi" for name, url in services.items()}
        assert {name: href for name, href in links} == {**expected, "api": f"{stack['api_url']}/asyncapi"}
        await page.click("#demo-link")
        await page.wait_for_url(f"{stack['api_url']}/demo")
        assert seen.outside == []
    finally:
        await context.close()


async def test_the_demo_page_takes_a_file_reaches_ready_and_plays_each_rendition(
    browser: Browser, stack: dict[str, Any], tmp_path: Path
) -> None:
    source = make_source(tmp_path / "clip.mp4", height=720, seconds=2, fps=10)
    context = await browser.new_context(viewport={"width": 1100, "height": 900})
    seen = await fence(context)
    try:
        page = await context.new_page()
        statuses: list[str] = []
        await page.expose_function("weirStatus", lambda s: statuses.append(s))
        await page.goto(str(stack["demo_url"]))
        # the page knows the demo app's publishable key: nothing to type, and no secret anywhere in it
        html = await page.content()
        assert stack["demo"]["publishable_key"] in html and stack["demo"]["secret_key"] not in html
        assert await page.is_hidden("#key-section")
        # every status the page shows, as it shows it
        await page.evaluate("""() => new MutationObserver(() => window.weirStatus(
            document.querySelector('[data-video-status]').dataset.videoStatus)).observe(
            document.querySelector('[data-video-status]'), {attributes: true})""")
        await page.set_input_files("#file", str(source))
        await page.wait_for_selector('[data-video-status="ready"]', timeout=READY_WITHIN_S * 1000)
        shown = [s for i, s in enumerate(statuses) if s and (i == 0 or statuses[i - 1] != s)]
        assert shown[-1] == "ready" and "uploaded" in shown, shown
        assert shown.index("uploaded") < len(shown) - 1  # it went on from uploaded to ready while the page watched
        assert await page.evaluate("document.getElementById('progress').value") == 1
        assert await page.text_content("#error") == ""

        players = await page.query_selector_all("#renditions video")
        heights = [int(await p.get_attribute("data-height") or 0) for p in players]
        assert heights == [360, 720]
        for player, height in zip(players, heights, strict=True):
            # playable: the browser loads it, decodes frames of the rendition's size, and plays
            await player.evaluate("""async (v) => {
                if (v.readyState < 2) await new Promise((ok, bad) => {
                  v.addEventListener('loadeddata', ok, {once: true});
                  v.addEventListener('error', () => bad(new Error('media error ' + (v.error && v.error.code))),
                                     {once: true});
                });
                await v.play();
            }""")
            size = await player.evaluate("v => [v.videoWidth, v.videoHeight, v.duration]")
            assert size[1] == height and size[0] == height * 16 // 9 // 2 * 2 and size[2] > 1, size
            await page.wait_for_function("v => v.currentTime > 0.2", arg=player, timeout=20_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "demo-ready.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nthe demo page after a finished upload: {shot}")
        assert seen.outside == [], seen.outside
        assert any(re.match(r"http://127\.0\.0\.1:\d+/.*X-Amz-Signature", u) for u in seen.requests)  # renditions
        # the video the demo made is the demo app's, as the secret key sees it
        video_id = await page.text_content("#video-id")
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"{stack['api_url']}/v1/videos/{video_id}",
                               headers={"Authorization": f"Bearer {stack['demo']['secret_key']}"})
        assert r.status_code == 200 and r.json()["status"] == "ready", r.text

        # the webhook deliveries of the video, as the demo's receiver got and verified them
        for event_type in ("video.created", "upload.completed"):
            await page.wait_for_selector(f'#webhooks tr[data-type="{event_type}"][data-verified="yes"]',
                                         timeout=WEBHOOK_WITHIN_S * 1000)
        shown = await page.eval_on_selector_all(
            "#webhooks tbody tr", "rows => rows.map(r => [r.dataset.type, r.dataset.webhookId, r.dataset.verified, "
            "Number(r.dataset.attempts)])")
        assert all(verified == "yes" and attempts >= 1 for _, _, verified, attempts in shown), shown
        # the same deliveries in the endpoint's log, as the app's secret key sees it (never the browser)
        async with httpx.AsyncClient(base_url=stack["api_url"], timeout=10,
                                     headers={"Authorization": f"Bearer {stack['demo']['secret_key']}"}) as http:
            endpoints = (await http.get("/v1/webhooks")).json()["webhooks"]
            demo_endpoint = next(e for e in endpoints if e["url"] == f"{stack['api_url']}/demo/receiver")
            logged: list[dict[str, Any]] = []
            cursor: str | None = ""
            while cursor is not None:  # every page: the video's encode.progress events come in their dozens
                page_of = (await http.get(f"/v1/webhooks/{demo_endpoint['id']}/deliveries",
                                          params={"limit": 200, **({"cursor": cursor} if cursor else {})})).json()
                logged += page_of["deliveries"]
                cursor = page_of.get("next_cursor")
        delivered = {d["event_id"]: d["event_type"] for d in logged
                     if d["video_id"] == video_id and d["status"] == "delivered"}
        for event_type, webhook_id, _, _ in shown:
            if event_type in ("video.created", "upload.completed"):
                assert delivered.get(webhook_id) == event_type, (webhook_id, event_type, delivered)
        await page.screenshot(path=str(shot), full_page=True)
        print(f"the demo page with its webhook deliveries: {shot}")
        assert seen.outside == [], seen.outside
    finally:
        await context.close()

