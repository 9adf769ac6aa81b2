"""`weir up` as a person uses it, in real headless Chromium: the first page it prints links to the demo, the API
reference and each service's events; the demo takes a file, shows the video's status through `ready`, plays each
rendition (issues 14 and 17), shows the webhook deliveries its video caused, received over HTTP by the api's demo
receiver and verified with the demo endpoint's secret (issue 31), and plays the video's HLS ladder with the hls.js the
stack serves, its poster and its storyboard (issue 32). No page asks for anything outside the stack.

One file is uploaded through the page for the module (`uploaded`): the tests after the first look at that page.

A screenshot of the finished demo is written to .weir/test-artifacts/ and its path printed, for a person to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import re
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import Browser, Frame, Page

from services.webhooks.settings import WebhookSettings
from shared.settings import CommonSettings
from shared.webpages import HLS_JS, VENDOR_PREFIX
from tests.browser.conftest import Fence, fence
from tests.e2e.test_weir_up import _start_up
from tests.integration.test_encode_helpers import make_source
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

ARTIFACTS = Path(__file__).resolve().parents[2] / ".weir" / "test-artifacts"
# the source: long enough for two ~4 s HLS segments (a switch in the first, playback going on after it), 720p for a
# ladder of 360p and 720p, few frames to keep the farm's work small
SOURCE_SECONDS, SOURCE_HEIGHT, SOURCE_FPS = 8, 720, 10
LADDER = [360, 720]
READY_WITHIN_S = 120  # the ladder, its HLS and artwork on one worker of this 2-core machine, with room for a slow day
PLAYBACK_WITHIN_S = 30  # a ready video's playback shown, and each step of playing it (loads from the same machine)
ADVANCE_S = 0.5  # how far playback must go on after the switch shows
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


async def test_the_demo_reads_a_storyboard_as_webvtt_may_write_it(browser: Browser, stack: dict[str, Any]) -> None:
    """The page's own WebVTT reading: cue identifiers and settings, hours or not, CRLF, `pixel:`, relative URLs;
    a cue without a tile is skipped."""
    vtt = ("WEBVTT\r\n\r\nNOTE made by hand\r\n\r\n1\r\n00:00.000 --> 00:02.500 align:start\r\n"
           "sprite.jpg#xywh=0,0,160,90\r\n\r\n01:00:02.500 --> 01:00:05.000\r\n"
           "/v1/sprite.jpg?sig=a#xywh=pixel:160,90,160,90\r\n\r\n00:05.000 --> 00:06.000\r\nno tile here\r\n")
    context = await browser.new_context()
    seen = await fence(context)
    try:
        page = await context.new_page()
        await page.goto(str(stack["demo_url"]))
        cues = await page.evaluate("([text, base]) => weirDemo.parseStoryboard(text, base)",
                                   [vtt, "http://127.0.0.1:1/v1/videos/v/storyboard.vtt?x=1"])
        assert cues == [
            {"start": 0, "end": 2.5, "url": "http://127.0.0.1:1/v1/videos/v/sprite.jpg", "x": 0, "y": 0, "w": 160,
             "h": 90},
            {"start": 3602.5, "end": 3605, "url": "http://127.0.0.1:1/v1/sprite.jpg?sig=a", "x": 160, "y": 90,
             "w": 160, "h": 90},
        ]
        assert seen.outside == []
    finally:
        await context.close()


@dataclass
class Uploaded:
    """The demo page after a file went through it and its video became ready: every status it showed on the way."""

    page: Page
    seen: Fence
    statuses: list[str]
    video_id: str


@pytest.fixture(scope="module")
async def uploaded(browser: Browser, stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
                   ) -> AsyncIterator[Uploaded]:
    source = make_source(tmp_path_factory.mktemp("demo") / "clip.mp4", height=SOURCE_HEIGHT, seconds=SOURCE_SECONDS,
                         fps=SOURCE_FPS)
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
        yield Uploaded(page, seen, statuses, str(await page.text_content("#video-id")))
    finally:
        await context.close()


async def test_the_demo_page_takes_a_file_reaches_ready_and_plays_each_rendition(
    stack: dict[str, Any], uploaded: Uploaded
) -> None:
    page, seen, statuses = uploaded.page, uploaded.seen, uploaded.statuses
    shown = [s for i, s in enumerate(statuses) if s and (i == 0 or statuses[i - 1] != s)]
    assert shown[-1] == "ready" and "uploaded" in shown, shown
    assert shown.index("uploaded") < len(shown) - 1  # it went on from uploaded to ready while the page watched
    assert await page.evaluate("document.getElementById('progress').value") == 1
    assert await page.text_content("#error") == ""

    players = await page.query_selector_all("#renditions video")
    heights = [int(await p.get_attribute("data-height") or 0) for p in players]
    assert heights == LADDER
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
    video_id = uploaded.video_id
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



def storyboard_cues(vtt: str) -> list[tuple[float, float, str, tuple[int, int, int, int]]]:
    """(start, end, sprite URL, (x, y, w, h)) of each cue of a storyboard WebVTT, read here apart from the page's
    own parser."""
    def seconds(stamp: str) -> float:
        total = 0.0
        for part in stamp.strip().split(":"):
            total = total * 60 + float(part)
        return total

    cues = []
    lines = vtt.splitlines()
    for line, payload in zip(lines, [*lines[1:], ""], strict=True):
        if "-->" in line:
            start, end = line.split("-->")
            url, _, fragment = payload.strip().partition("#xywh=")
            x, y, w, h = (int(n) for n in fragment.removeprefix("pixel:").split(","))
            cues.append((seconds(start), seconds(end.split()[0]), url, (x, y, w, h)))
    return cues


async def test_the_demo_plays_the_hls_ladder_with_the_stacks_hls_js_switches_rendition_and_shows_the_artwork(
    stack: dict[str, Any], uploaded: Uploaded
) -> None:
    page, seen, api = uploaded.page, uploaded.seen, stack["api_url"]
    async with httpx.AsyncClient(timeout=10) as http:
        async def complete_playback() -> dict[str, Any] | None:
            r = await http.get(f"{api}/v1/videos/{uploaded.video_id}",
                               headers={"Authorization": f"Bearer {stack['demo']['secret_key']}"})
            shown: dict[str, Any] = r.json()["playback"]
            return shown if all(shown[k] for k in ("hls", "thumbnail", "storyboard")) else None

        # the HLS ladder and the artwork, perhaps announced a little after the MP4s made the video ready
        playback = await wait_for(complete_playback, PLAYBACK_WITHIN_S, "the video's HLS, thumbnail and storyboard",
                                  interval=0.5)
        assert playback["policy"] == "public", playback
        vtt = await http.get(playback["storyboard"])  # as a player asks: public playback needs no credential
        assert vtt.status_code == 200, vtt.text
    cues = storyboard_cues(vtt.text)
    assert cues, vtt.text
    await page.evaluate("() => document.querySelectorAll('#renditions video').forEach((v) => v.pause())")

    # hls.js, as the stack serves it (web/node_modules), plays the master playlist
    await page.wait_for_selector("#levels button[data-level='1']", timeout=PLAYBACK_WITHIN_S * 1000)
    assert f"{api}{VENDOR_PREFIX}{HLS_JS}" in seen.requests
    installed = json.loads((CommonSettings().web_assets_dir / "hls.js" / "package.json").read_text())["version"]
    assert await page.evaluate("window.Hls.version") == installed
    assert playback["hls"] in seen.requests
    levels = await page.evaluate("weirDemo.hls.levels.map((l) => l.height)")
    assert sorted(levels) == LADDER
    shown = await page.eval_on_selector_all("#levels button[data-height]", "bs => bs.map((b) => b.dataset.height)")
    assert shown == [str(h) for h in levels]
    await page.evaluate("() => weirDemo.video.play()")
    await page.wait_for_function("() => weirDemo.video.currentTime > 0.2 && weirDemo.hls.currentLevel >= 0",
                                 timeout=PLAYBACK_WITHIN_S * 1000)

    # pin the rendition playing (hls.js stops choosing), then force the other one
    playing = await page.evaluate("weirDemo.hls.currentLevel")
    target = next(i for i in range(len(levels)) if i != playing)
    await page.click(f"#levels button[data-level='{playing}']")
    await page.evaluate("""() => {
        const seen = (window.switchSeen = {switched: [], fragments: []});
        weirDemo.hls.on(Hls.Events.LEVEL_SWITCHED, (_, d) => seen.switched.push(d.level));
        weirDemo.hls.on(Hls.Events.FRAG_LOADED, (_, d) => {
          if (d.frag.type === 'main') seen.fragments.push(d.frag.level);
        });
    }""")
    await page.click(f"#levels button[data-level='{target}']")
    await page.wait_for_function("t => switchSeen.switched.includes(t) && switchSeen.fragments.includes(t)",
                                 arg=target, timeout=PLAYBACK_WITHIN_S * 1000)
    # the target's frames are decoded and shown (videoHeight is the decoded frame's), then playback goes on
    await page.wait_for_function("h => weirDemo.video.videoHeight === h", arg=levels[target],
                                 timeout=PLAYBACK_WITHIN_S * 1000)
    switched_at = await page.evaluate("weirDemo.video.currentTime")
    await page.wait_for_function("t => weirDemo.video.currentTime > t", arg=switched_at + ADVANCE_S,
                                 timeout=PLAYBACK_WITHIN_S * 1000)
    assert await page.evaluate("weirDemo.hls.currentLevel") == target
    assert await page.get_attribute("#level-current", "data-level") == str(target)
    assert await page.get_attribute(f"#levels button[data-level='{target}']", "aria-pressed") == "true"
    assert await page.text_content("#playback-note") == ""

    # the poster: the video's thumbnail, loaded by the page
    assert await page.evaluate("weirDemo.video.poster") == playback["thumbnail"]
    assert playback["thumbnail"] in seen.requests
    poster = await page.evaluate("""async (url) => { const i = new Image(); i.src = url; await i.decode();
                                                     return [i.naturalWidth, i.naturalHeight]; }""",
                                 playback["thumbnail"])
    assert poster[0] > 0 and poster[1] > 0, poster

    # hovering the scrub bar shows the storyboard's tile of the time under the pointer
    bar = await page.locator("#scrub").bounding_box()
    assert bar is not None
    await page.mouse.move(bar["x"] + bar["width"] * 0.7, bar["y"] + bar["height"] / 2)
    await page.wait_for_selector("#storyboard-tile:not([hidden])", timeout=PLAYBACK_WITHIN_S * 1000)
    tile = await page.evaluate("""() => { const t = document.getElementById('storyboard-tile');
        return {time: Number(t.dataset.time), image: t.style.backgroundImage, position: t.style.backgroundPosition,
                width: t.style.width, height: t.style.height}; }""")
    duration = await page.evaluate("weirDemo.video.duration")
    assert abs(tile["time"] - duration * 0.7) < duration / 20, (tile, duration)
    start, _, sprite, (x, y, w, h) = next((c for c in cues if c[0] <= tile["time"] < c[1]), cues[-1])
    image = re.fullmatch(r'url\("(.+)"\)', tile["image"])
    assert image is not None, tile
    assert urlsplit(image.group(1)).path == urlsplit(sprite).path == f"/v1/videos/{uploaded.video_id}/storyboard.jpg"
    assert tile["position"] == f"{-x}px {-y}px" and (tile["width"], tile["height"]) == (f"{w}px", f"{h}px"), tile
    if start > 0:  # the tile of that time, not the first
        assert (x, y) != cues[0][3][:2], (tile, cues)
    await wait_for(lambda: image.group(1) in seen.requests, PLAYBACK_WITHIN_S, "the page to ask for the sprite")
    loaded = await page.evaluate("""async (url) => { const i = new Image(); i.src = url; await i.decode();
                                                     return [i.naturalWidth, i.naturalHeight]; }""", image.group(1))
    assert loaded[0] >= x + w and loaded[1] >= y + h, (loaded, tile)
    shot = ARTIFACTS / "demo-playback.png"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(shot), full_page=True)
    print(f"\nthe demo page playing the HLS ladder, the storyboard under the pointer: {shot}")

    # nothing left the stack: hls.js, the playlists, the segments (through the api's redirects to storage), the
    # poster and the sprite all came from this machine's servers
    assert seen.outside == [], seen.outside
    assert {urlsplit(u).hostname for u in seen.requests if urlsplit(u).scheme in ("http", "https")} == {"127.0.0.1"}
    api_address = urlsplit(api).netloc  # the segments' URLs are the api's, which redirect to storage's
    stored = [u for u in seen.requests if "X-Amz-Signature" in u and urlsplit(u).netloc != api_address]
    assert any(urlsplit(u).path.endswith(".m4s") for u in stored), seen.requests


# a track uploaded as WebVTT and one as SubRip, with cues inside the SOURCE_SECONDS clip
CAPTIONS_EN = "WEBVTT\n\n00:00:00.500 --> 00:00:03.000\nFirst words\n\n00:00:04.000 --> 00:00:07.500\nLater words\n"
CAPTIONS_FR = ("1\r\n00:00:00,500 --> 00:00:03,000\r\nPremiers mots\r\n\r\n"
               "2\r\n00:00:04,000 --> 00:00:07,500\r\nEnsuite\r\n")
CUES_EN = [(0.5, 3.0, "First words"), (4.0, 7.5, "Later words")]
CUES_FR = [(0.5, 3.0, "Premiers mots"), (4.0, 7.5, "Ensuite")]
SHOWN_CUES = """() => { const t = [...weirDemo.video.textTracks].find((t) => t.mode === 'showing');
    return t && t.cues && t.cues.length ? {language: t.language, label: t.label,
        cues: [...t.cues].map((c) => [c.startTime, c.endTime, c.text])} : null; }"""


def active_cue(video: str = "weirDemo.video") -> str:
    """A function of the page: the text of the cue the browser shows now over `video`, or null."""
    return f"""() => {{ const t = [...{video}.textTracks].find((t) => t.mode === 'showing');
        return t && t.activeCues && t.activeCues.length ? t.activeCues[0].text : null; }}"""


async def test_the_demo_offers_the_videos_caption_tracks_and_the_browser_shows_their_cues_at_their_times(
    stack: dict[str, Any], uploaded: Uploaded
) -> None:
    """Tracks the app's server adds (secret key) reach the viewer: hls.js finds them in the master playlist, the page
    offers them, and the browser's text track holds the cues at the times written, the one of the moment active."""
    page, api, vid = uploaded.page, stack["api_url"], uploaded.video_id
    secret = {"Authorization": f"Bearer {stack['demo']['secret_key']}"}
    async with httpx.AsyncClient(timeout=10) as http:
        for language, body, media_type, name in (("en", CAPTIONS_EN, "text/vtt", "English"),
                                                 ("fr", CAPTIONS_FR, "application/x-subrip", "Français")):
            r = await http.put(f"{api}/v1/videos/{vid}/captions/{language}", content=body.encode(),
                               params={"name": name, "closed_captions": str(language == "en").lower()},
                               headers={**secret, "Content-Type": media_type})
            assert r.status_code == 201, r.text
        master = (await http.get(f"{api}/v1/videos/{vid}", headers=secret)).json()["playback"]["hls"]

    await page.evaluate("() => weirDemo.video.pause()")
    await page.evaluate("(url) => weirDemo.playHls(weirDemo.video, url)", master)
    await page.wait_for_selector("#captions button[data-language='fr']", timeout=PLAYBACK_WITHIN_S * 1000)
    offered = await page.eval_on_selector_all("#captions button", "bs => bs.map((b) => [b.dataset.language || '', "
                                              "b.textContent, b.getAttribute('aria-pressed')])")
    assert offered == [["", "off", "true"], ["en", "English (CC)", "false"], ["fr", "Français", "false"]], offered

    for language, label, expected in (("en", "English", CUES_EN), ("fr", "Français", CUES_FR)):
        await page.click(f"#captions button[data-language='{language}']")
        shown = await (await page.wait_for_function(
            f"() => {{ const s = ({SHOWN_CUES})(); return s && s.language === '{language}' ? s : null; }}",
            timeout=PLAYBACK_WITHIN_S * 1000)).json_value()
        assert shown["label"] == label
        assert [(pytest.approx(s, abs=0.05), pytest.approx(e, abs=0.05), t) for s, e, t in expected] == [
            tuple(c) for c in shown["cues"]]
        # playing inside the second cue, the browser shows that cue
        await page.evaluate("(t) => { weirDemo.video.currentTime = t; return weirDemo.video.play(); }",
                            (expected[1][0] + expected[1][1]) / 2)
        await page.wait_for_function(f"() => ({active_cue()})() === {json.dumps(expected[1][2])}",
                                     timeout=PLAYBACK_WITHIN_S * 1000)
        await page.evaluate("() => weirDemo.video.pause()")
    shot = ARTIFACTS / "demo-captions.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"\nthe demo page showing a caption track's cue over the video: {shot}")
    await page.click("#captions button[data-track='-1']")
    await page.wait_for_function("() => ![...weirDemo.video.textTracks].some((t) => t.mode === 'showing')",
                                 timeout=PLAYBACK_WITHIN_S * 1000)


@contextlib.contextmanager
def embedding_site(body: str | bytes, content_type: str = "text/html; charset=utf-8") -> Iterator[str]:
    """A developer's site on an origin of its own (another port of this machine): every path answers `body`."""
    class Site(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


EMBED_START_S = 4.0  # inside the second cue of CUES_FR
SITE = """<!DOCTYPE html><html><body><h1>A developer's page</h1>
<iframe id="weir" src="{src}" width="640" height="360" allow="autoplay; fullscreen"></iframe>
<iframe id="missing" src="{missing}" width="320" height="180"></iframe>
<iframe id="signed" src="{signed}" width="320" height="180"></iframe>
<iframe id="waiting" src="{waiting}" width="320" height="180"></iframe>
<script>window.heard = []; addEventListener("message", (e) => {{
  if (e.data && e.data.source === "weir-player") heard.push({{origin: e.origin, ...e.data}}); }});</script>
</body></html>"""


async def test_a_site_on_another_origin_embeds_the_player_which_plays_the_video_with_its_captions(
    browser: Browser, stack: dict[str, Any], uploaded: Uploaded
) -> None:
    """`/embed/<id>` in an iframe of a page on another origin: it starts where asked, muted, by itself, with the
    asked caption track shown and the poster set, and tells the page what happens; a video that does not exist, one
    that needs a token and one not processed yet each say so in the frame."""
    api, vid = stack["api_url"], uploaded.video_id
    secret = {"Authorization": f"Bearer {stack['demo']['secret_key']}"}
    async with httpx.AsyncClient(timeout=10) as http_client:
        r = await http_client.put(f"{api}/v1/videos/{vid}/captions/fr", content=CAPTIONS_FR.encode(),
                                  params={"name": "Français"},
                                  headers={**secret, "Content-Type": "application/x-subrip"})
        assert r.status_code in (200, 201), r.text
        made = {}
        for policy in ("signed", "public"):
            r = await http_client.post(f"{api}/v1/videos", params={"playback_policy": policy}, json={"name": policy},
                                       headers=secret)
            assert r.status_code == 201, r.text
            made[policy] = r.json()["id"]
        embed = (await http_client.get(f"{api}/v1/videos/{vid}", headers=secret)).json()["playback"]["embed"]
        assert embed == f"{api}/embed/{vid}"
        r = await http_client.get(embed)
        assert r.status_code == 200 and r.headers["content-security-policy"] == "frame-ancestors *"
        assert "x-frame-options" not in r.headers
    page_html = SITE.format(src=f"{embed}?autoplay=1&muted=1&captions=fr&start={EMBED_START_S}",
                            missing=f"{api}/embed/01a2519b-0000-7000-8000-000000000000",
                            signed=f"{api}/embed/{made['signed']}", waiting=f"{api}/embed/{made['public']}")
    context = await browser.new_context()
    seen = await fence(context)
    try:
        page = await context.new_page()
        with embedding_site(page_html) as site:
            await page.goto(site)
            assert urlsplit(site).netloc != urlsplit(api).netloc  # another origin

            async def frame_of(url_part: str) -> Frame:
                found = await wait_for(lambda: next((f for f in page.frames if url_part in f.url), None),
                                       PLAYBACK_WITHIN_S, f"the frame of {url_part}")
                assert isinstance(found, Frame)
                return found

            player = await frame_of(f"/embed/{vid}?")
            await player.wait_for_function(f"() => weirPlayer.video.currentTime > {EMBED_START_S} + {ADVANCE_S}"
                                           " && !weirPlayer.video.paused", timeout=PLAYBACK_WITHIN_S * 1000)
            assert await player.evaluate("weirPlayer.video.muted") is True
            assert "fr" in await player.evaluate("weirPlayer.hls.subtitleTracks.map((t) => t.lang)")
            shows = active_cue("weirPlayer.video")
            await player.wait_for_function(f"() => ({shows})() === {json.dumps(CUES_FR[1][2])}",
                                           timeout=PLAYBACK_WITHIN_S * 1000)
            assert await player.evaluate("weirPlayer.video.poster") == f"{api}/v1/videos/{vid}/thumbnail.jpg"
            heard = await page.evaluate("heard")
            mine = [h for h in heard if h["video_id"] == vid]
            assert {h["origin"] for h in heard} == {api.rstrip("/")}
            assert {"tracks", "ready", "play"} <= {h["event"] for h in mine}, mine
            assert next(h for h in mine if h["event"] == "ready")["levels"] == LADDER

            async def said(url_part: str, text: str, code: str) -> None:
                frame = await frame_of(url_part)
                await frame.wait_for_function(f"() => weirPlayer.problem === {json.dumps(code)}",
                                              timeout=PLAYBACK_WITHIN_S * 1000)
                assert text in await frame.text_content("#note")

            await said("/embed/01a2519b-0000-7000-8000-000000000000", "no such video", "not_found")
            await said(f"/embed/{made['signed']}", "only with a playback token", "playback_token_required")
            await said(f"/embed/{made['public']}", "still being processed", "not_ready")
            shot = ARTIFACTS / "embed-player.png"
            await page.screenshot(path=str(shot), full_page=True)
            print(f"\nthe player page embedded in another origin's page: {shot}")
        assert seen.outside == [], seen.outside
    finally:
        await context.close()


async def test_a_file_imported_from_a_url_on_this_machine_is_encoded_to_ready_and_plays(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """`weir up` lets imports read from this machine (development, as for webhooks): a file a developer's server
    serves is imported with the demo app's secret key (POST /v1/videos/{id}/import), encoded by the stack's farm,
    and its HLS ladder plays."""
    source = make_source(tmp_path / "imported.mp4", height=LADDER[0], seconds=2, fps=SOURCE_FPS).read_bytes()
    with embedding_site(source, "video/mp4") as site:
        async with httpx.AsyncClient(base_url=str(stack["api_url"]), timeout=30, headers={
                "Authorization": f"Bearer {stack['demo']['secret_key']}"}) as http:
            created = await http.post("/v1/videos", json={"name": "imported"})
            assert created.status_code == 201, created.text
            video_id = created.json()["id"]
            queued = await http.post(f"/v1/videos/{video_id}/import", json={"url": f"{site}clip.mp4?sig=x"})
            assert queued.status_code == 202 and queued.json()["import"]["state"] == "queued", queued.text

            async def ready() -> dict[str, Any] | None:
                r = await http.get(f"/v1/videos/{video_id}")
                assert r.status_code == 200 and r.json()["status"] != "failed", r.text
                return dict(r.json()) if r.json()["status"] == "ready" else None

            shown = await wait_for(ready, READY_WITHIN_S, "the imported video ready")
            assert shown["import"]["state"] == "completed" and shown["import"]["url"] == f"{site}clip.mp4"
            assert shown["file"]["size"] == len(source) and [r["height"] for r in shown["renditions"]] == LADDER[:1]
            master = await http.get(shown["playback"]["hls"])
            assert master.status_code == 200 and "#EXT-X-STREAM-INF" in master.text, master.text
