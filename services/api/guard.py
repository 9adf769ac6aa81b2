"""The edge of the public API: one `auth.check` per request, the rate-limit headers on every answer, body limits.

A pure ASGI middleware (no per-request copies of the body beyond the route's limit): it classifies the route,
asks auth once, answers refusals itself, and hands the identity to the route in `scope["state"]["auth"]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from shared.authcheck import CheckReply, CheckRequest, RouteClassName
from shared.authclient import AuthError, check
from shared.metrics import Metrics
from shared.problems import problem_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPERATIONS_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/asyncapi.json",
                              "/settings", "/docs/oauth2-redirect"})
DEFAULT_BODY_LIMIT = 64 * 1024
INTERNAL_HEADER = b"x-weir-internal-token"


@dataclass(frozen=True)
class RouteRule:
    method: str
    pattern: re.Pattern[str]
    route_class: RouteClassName
    name: str
    operation: str | None = None
    body_limit: int = DEFAULT_BODY_LIMIT


def _rule(method: str, path: str, route_class: RouteClassName, *, operation: str | None = None,
          body_limit: int = DEFAULT_BODY_LIMIT) -> RouteRule:
    regex = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path) + "$"
    return RouteRule(method, re.compile(regex), route_class, f"{method} {path}", operation, body_limit)


def _upload_rules(prefix: str, route_class: RouteClassName) -> list[RouteRule]:
    return [
        _rule("POST", f"{prefix}/videos/{{id}}/upload", route_class),
        # 10,000 part numbers, and 10,000 parts with their ETags, fit in these
        _rule("POST", f"{prefix}/videos/{{id}}/upload/parts", route_class, body_limit=256 * 1024),
        _rule("POST", f"{prefix}/videos/{{id}}/upload/complete", route_class, body_limit=2 * 1024 * 1024),
        _rule("DELETE", f"{prefix}/videos/{{id}}/upload", route_class),
    ]


ROUTES: tuple[RouteRule, ...] = (
    _rule("POST", "/v1/videos", "secret"),
    _rule("GET", "/v1/videos", "secret"),
    _rule("GET", "/v1/videos/{id}", "secret"),
    _rule("DELETE", "/v1/videos/{id}", "secret"),
    _rule("POST", "/v1/videos/{id}/upload-token", "secret"),
    *_upload_rules("/v1", "secret"),
    _rule("POST", "/sdk/v1/videos", "sdk"),
    *_upload_rules("/sdk/v1", "sdk"),
    _rule("POST", "/v1/account/apps", "management", operation="app_create"),
    _rule("GET", "/v1/account/apps/{id}/keys", "management"),
    _rule("POST", "/v1/account/apps/{id}/keys/rotate", "management", operation="key_rotate"),
    _rule("DELETE", "/v1/account/keys/{id}", "management"),
    _rule("GET", "/internal/v1/videos/{id}", "internal"),
)


def classify(method: str, path: str) -> tuple[RouteRule | None, str | None]:
    """The route's rule and the video id it acts on (SDK upload routes bind an upload token to it)."""
    for rule in ROUTES:
        if rule.method == method:
            m = rule.pattern.match(path)
            if m:
                video = m.groupdict().get("id") if "/videos/" in path else None
                return rule, video
    return None, None


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


class Guard:
    def __init__(self, app: ASGIApp, *, nc: Callable[[], NATS | None], timeout: float, metrics: Metrics) -> None:
        self.app = app
        self.nc = nc
        self.timeout = timeout
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPERATIONS_PATHS:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = _headers(scope)
        if method == "OPTIONS" and path.startswith("/sdk/"):
            await self._preflight(headers, send)
            return
        rule, video_id = classify(method, path)
        peer = (scope.get("client") or ("0.0.0.0", 0))[0]
        request = CheckRequest(
            authorization=_text(headers.get(b"authorization")),
            internal_token=_text(headers.get(INTERNAL_HEADER)),
            peer=peer,
            forwarded_for=_text(headers.get(b"x-forwarded-for")),
            route_class=rule.route_class if rule else "public",
            route=rule.name if rule else f"{method} (no route)",
            operation=rule.operation if rule else None,
            video_id=video_id if rule and rule.route_class == "sdk" else None,
        )
        reply = await self._check(request)
        if reply is None:
            await _send_json(send, 503, problem_body(503, "unavailable", "auth does not answer; retry shortly"),
                             {"Retry-After": "1"})
            return
        limit_headers = reply.headers
        if not reply.allowed:
            await _send_json(send, reply.status, reply.problem or problem_body(reply.status, "forbidden", ""),
                             limit_headers)
            return
        scope.setdefault("state", {})["auth"] = reply
        limit = rule.body_limit if rule else DEFAULT_BODY_LIMIT
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_json(send, 413, _too_large(limit), limit_headers)
            return
        body = await _read_body(receive, limit)
        if body is None:
            await _send_json(send, 413, _too_large(limit), limit_headers)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        encoded = [(k.lower().encode(), v.encode()) for k, v in limit_headers.items()]

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + encoded
            await send(message)

        await self.app(scope, replay, send_with_limits)

    async def _check(self, request: CheckRequest) -> CheckReply | None:
        nc = self.nc()
        if nc is None or not nc.is_connected:
            return None
        try:
            return await check(nc, request, timeout=self.timeout)
        except (TimeoutError, NatsError, AuthError):
            self.metrics.inc("auth_unavailable_total", help="requests answered 503 because auth did not answer")
            return None

    async def _preflight(self, headers: dict[bytes, bytes], send: Send) -> None:
        # a preflight carries no credential: it is answered for any origin, and the real request is checked
        origin = _text(headers.get(b"origin")) or "*"
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode()),
            (b"access-control-allow-methods", b"POST, DELETE, OPTIONS"),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"access-control-max-age", b"600"),
            (b"vary", b"Origin"),
        ]})
        await send({"type": "http.response.body", "body": b""})


def _too_large(limit: int) -> dict[str, Any]:
    return problem_body(413, "payload_too_large", f"bodies here are at most {limit} bytes")


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The body, or None as soon as it passes `limit` (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(raw)).encode()),
        *[(k.lower().encode(), v.encode()) for k, v in headers.items()],
    ]})
    await send({"type": "http.response.body", "body": raw})
