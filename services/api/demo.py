"""The api's pages: `/` links to the demo, the API reference and each service's AsyncAPI page; `/embed/{id}` is a
player page for an `<iframe>` on any site; `/demo` uploads a file with @weir/upload and the demo app's publishable key
(never a secret), then watches it encode and plays what came out, and shows the webhook deliveries its video caused.

They are static but for what `weir up` tells the api: the demo app's publishable key (`WEIR_DEMO_PUBLISHABLE_KEY`,
meant for pages) and the other services' addresses (`WEIR_SERVICE_PAGES`). They are operations routes, which the
guard lets through unchecked (shared/routeclass.py): they carry no one's data (the player page asks the playback
routes for what it plays, under their rules).

The demo's receiver (`POST /demo/receiver`) is a developer's endpoint like any other: `weir up` registers it for the
demo app through the public API and keeps its signing secret in a file only the api reads (`WEIR_DEMO_WEBHOOK_FILE`);
the webhooks service delivers to it over real HTTP, and it verifies each delivery as Standard Webhooks specify. It
keeps the newest deliveries in memory (`WEIR_DEMO_RECEIVER_KEEP`), and `GET /demo/receiver?video_id=` shows those of
one video (its id is what the page knows; the secret key never reaches the browser). One api instance's memory: after
a restart or a rollout it shows what arrived since.
"""

from __future__ import annotations

import html
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from standardwebhooks import Webhook, WebhookVerificationError

from services.api.captions import language_tag
from services.api.settings import ApiSettings
from shared.problems import Problem
from shared.routeclass import OPERATIONS_ROUTE

PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
# the player page is framed by developers' sites: any may embed it (a signed video still needs its token)
EMBED_HEADERS = {**PAGE_HEADERS, "Cache-Control": "public, max-age=300", "Content-Security-Policy": "frame-ancestors *"}


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


@dataclass
class DemoDelivery:
    """One event as the demo's receiver saw it: first and last arrival, whether the last verified, how many came."""

    webhook_id: str
    type: str
    video_id: str | None
    occurred_at: str | None  # the event's own time
    received_at: str
    last_received_at: str
    verified: bool
    attempts: int


class DemoReceiver:
    """The demo endpoint's receiving end: verifies with the secret in `secret_file` (read again when the file
    changes), keeps the newest `keep` events' deliveries."""

    def __init__(self, secret_file: Path | None, keep: int) -> None:
        self.secret_file = secret_file
        self.keep = keep
        self.seen: OrderedDict[str, DemoDelivery] = OrderedDict()
        self._secret: tuple[int, str | None] = (-1, None)  # the file's mtime, its secret

    @property
    def enabled(self) -> bool:
        return self.secret_file is not None

    def secret(self) -> str | None:
        if self.secret_file is None:
            return None
        try:
            changed = self.secret_file.stat().st_mtime_ns
            if changed != self._secret[0]:
                secret = json.loads(self.secret_file.read_text()).get("secret")
                self._secret = (changed, secret if isinstance(secret, str) else None)
        except (OSError, ValueError):
            return None
        return self._secret[1]

    def receive(self, headers: dict[str, str], body: bytes, now: datetime) -> bool:
        """Keeps the delivery; True when it verified (a receiver acts only on those)."""
        secret = self.secret()
        verified = False
        if secret:
            try:
                Webhook(secret).verify(body, headers)
                verified = True
            except (WebhookVerificationError, ValueError):
                pass
        event = _event_of(body)
        webhook_id = headers.get("webhook-id", "")[:100]
        data = event.get("data") if isinstance(event.get("data"), dict) else {}
        video_id = data.get("video_id") if isinstance(data, dict) else None
        at = now.isoformat()
        before = self.seen.pop(webhook_id, None)
        self.seen[webhook_id] = DemoDelivery(
            webhook_id=webhook_id, type=str(event.get("type", ""))[:100],
            video_id=str(video_id)[:100] if video_id is not None else None,
            occurred_at=str(event["time"])[:100] if "time" in event else None,
            received_at=before.received_at if before else at, last_received_at=at, verified=verified,
            attempts=(before.attempts if before else 0) + 1)
        while len(self.seen) > self.keep:
            self.seen.popitem(last=False)
        return verified

    def of_video(self, video_id: str) -> list[DemoDelivery]:
        return sorted((d for d in self.seen.values() if d.video_id == video_id), key=lambda d: d.received_at)


def _event_of(body: bytes) -> dict[str, Any]:
    try:
        event = json.loads(body)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def page_routes(settings: ApiSettings) -> APIRouter:
    r = APIRouter(tags=["pages"])
    demo = demo_page(settings.demo_publishable_key)
    embed = _page("embed.html")
    index = index_page(service_pages(settings.service_pages))
    sdk = settings.sdk_js_dir / "index.js"
    receiver = DemoReceiver(settings.demo_webhook_file, settings.demo_receiver_keep)

    @r.get("/", response_class=HTMLResponse, include_in_schema=False, **OPERATIONS_ROUTE)
    async def home() -> HTMLResponse:
        return HTMLResponse(index, headers=PAGE_HEADERS)

    @r.get("/embed/{video_id}", response_class=HTMLResponse, tags=["playback"], **OPERATIONS_ROUTE,
           responses={200: {"content": {"text/html": {}}, "description": "the player page"},
                      400: {"model": dict[str, Any], "content": {"application/problem+json": {}},
                            "description": "a start or captions the page could not use (RFC 9457 problem)"}})
    async def embed_page(
            video_id: str,
            start: Annotated[float | None, Query(ge=0, allow_inf_nan=False,
                                                description="where to start playing, in seconds")] = None,
            captions: Annotated[str | None, Query(max_length=40, description="the caption track shown from the "
                                                  "start: its BCP 47 language tag (en, pt-BR)")] = None,
    ) -> HTMLResponse:
        """A player page for an `<iframe>` on any site: the video's HLS ladder with hls.js (served by the stack), its
        poster and caption tracks. The page is the same for every video and carries no one's data: what it plays it
        asks the playback routes for, under their rules (`?token=` a signed video's playback token). Options:
        `autoplay=1`, `muted=1`, `loop=1`, `start=<seconds>`, `captions=<language>`, `poster=0`; a `start` or
        `captions` the page could not use is refused (400) rather than ignored."""
        if captions is not None and language_tag(captions) is None:
            raise Problem(400, "validation_error",
                          f"captions: {captions!r} is not a BCP 47 language tag (e.g. en, pt-BR, es-419)")
        return HTMLResponse(embed, headers=EMBED_HEADERS)

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

    @r.post("/demo/receiver", include_in_schema=False, status_code=204, **OPERATIONS_ROUTE)
    async def demo_receiver(request: Request) -> Response:
        if not receiver.receive(dict(request.headers), await request.body(), datetime.now(UTC)):
            raise Problem(400, "signature_invalid", "the delivery does not verify with the demo endpoint's secret")
        return Response(status_code=204)

    @r.get("/demo/receiver", include_in_schema=False, **OPERATIONS_ROUTE)
    async def demo_deliveries(video_id: str = Query(max_length=100)) -> JSONResponse:
        return JSONResponse({"enabled": receiver.enabled,
                             "deliveries": [asdict(d) for d in receiver.of_video(video_id)]},
                            headers={"Cache-Control": "no-store"})

    return r
