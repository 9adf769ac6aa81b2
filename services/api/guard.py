"""The edge of the public API: one `auth.check` per request, the rate-limit headers on every answer, body limits.

A pure ASGI middleware (no per-request copies of the body beyond the route's limit): it classifies the route by
the table its routes declare (`RouteTable.of(app)`), asks auth once, answers refusals itself, and hands the identity
to the route in `scope["state"]["auth"]`. A request no route serves is checked as "public" (it spends its address's
budget, so probing for paths is not free) and then answered 404 (405) by the guard: nothing outside the table runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from starlette.routing import compile_path

from services.api.playback_routes import OPEN
from shared.authcheck import CheckDecision, CheckRequest, RouteClassName
from shared.authclient import AuthError, CheckSender
from shared.messaging import UnreadableReply
from shared.metrics import Metrics
from shared.modeljson import Encoder, ModelTemplate
from shared.natsconn import ConnectionWatch, PermissionRefused
from shared.overload.domain import Priority
from shared.overload.edge import PASS, Pass
from shared.problems import problem_body, www_authenticate
from shared.routeclass import DeclaredRoute, declared_routes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

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
    priority: Priority | None = None  # when the api sheds, if not the method's (shared/overload/domain.py)
    encode_check: Encoder = field(init=False, repr=False, compare=False)  # its CheckRequest, its own fields written

    def __post_init__(self) -> None:
        object.__setattr__(self, "encode_check", check_request_for(self.route_class, self.name, self.operation))

    @property
    def any_origin(self) -> bool:
        """A player's route (class public): readable from any page, the guard's refusals too (see CORS below)."""
        return self.route_class == "public"


# the CheckRequest's JSON, written by a template made from the model (the route's fields written once per route)
CHECK_REQUEST = ModelTemplate(CheckRequest)


def check_request_for(route_class: RouteClassName, route: str, operation: str | None) -> Encoder:
    """The route's CheckRequest encoder: called with the request's own fields, by keyword."""
    return CHECK_REQUEST.bind(route_class=route_class, route=route, operation=operation)


# ---- CORS on the SDK routes (the only routes a browser calls; the credential's app names its allowed origins)
#
# Real answers and refusals: auth compares the request's Origin with the allowed origins of the app the credential
# names and replies `cors_origin` (in the same auth.check, from its cached lookup: no database read of its own); the
# guard then sends Access-Control-Allow-Origin for it, on the route's answer and on every refusal of auth's or its
# own. No app known (an unknown key, a forged token, auth not answering): no ACAO, the page reads nothing.
#
# Preflights carry no credential (browsers never send one), so no app can be known: they are answered for any
# origin, as most APIs do, since the real request is still checked and its answer unreadable without ACAO. But a
# preflight is not free to send: it goes through auth.check as route class "public" with no credential, so it
# spends its address's budget (and meets an address's auth_failure block) like any request, without counting as a
# failed credential, and costs no database read (no credential to look up; auth remembers the payload). The max age
# is long so that a browser asks rarely (Chromium caps it at 2 hours, Firefox at 24).
CORS_ALLOW_HEADERS = b"authorization, content-type, idempotency-key"
CORS_MAX_AGE = b"7200"
CORS_EXPOSE = (b"RateLimit, RateLimit-Policy, Retry-After, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset,"
               b" ETag, Location, Idempotent-Replayed")
_VARY_ORIGIN = (b"vary", b"Origin")


@dataclass(frozen=True)
class PreflightRule:
    pattern: re.Pattern[str]
    methods: bytes  # Access-Control-Allow-Methods
    encode_check: Encoder  # its auth.check: route class "public", route "OPTIONS <path>"


def cors_headers(origin: str | None) -> list[tuple[bytes, bytes]]:
    """An SDK route's CORS headers for an answer (never a preflight): ACAO only for an origin the app allows."""
    if origin is None:
        return [_VARY_ORIGIN]
    return [(b"access-control-allow-origin", origin.encode("latin-1")), _VARY_ORIGIN,
            (b"access-control-expose-headers", CORS_EXPOSE)]


# ---- CORS on the player routes (class "public": playlists, files, thumbnails, storyboards)
#
# Their answers carry the routes' own OPEN headers (services/api/playback_routes.py: any origin, the URLs being the
# credential). The guard's own answers there (429 past the address's budget, 401/403, 413, 503 when auth does not
# answer or sheds the check) carry the same, or a player on another page would see a network error instead of the
# status; and every answer there exposes the limit headers the guard adds, Retry-After included (none of them is
# CORS-safelisted). The route's own answers get only the exposure: a second ACAO would make browsers refuse them.
PLAYER_EXPOSE = [(b"access-control-expose-headers", CORS_EXPOSE)]
PLAYER_REFUSAL = [*((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in OPEN.items()),
                  *PLAYER_EXPOSE]


# ---- the route table: what each of the app's routes declares (shared/routeclass.py), read once at start


@dataclass(frozen=True)
class RouteTable:
    """The app's routes as the guard reads them; built from the routes themselves, so there is no list to repeat."""

    rules: tuple[RouteRule, ...]  # the routes auth.check guards, in the app's order
    preflights: tuple[PreflightRule, ...]  # the SDK routes' paths, for CORS preflights
    operations_paths: frozenset[str]  # served without auth.check, whatever the method (the route itself answers 405)
    operations_patterns: tuple[re.Pattern[str], ...]  # the same, for templates with parameters (/static/vendor/...)
    player_patterns: tuple[re.Pattern[str], ...] = ()  # the player routes' paths (class public)

    @classmethod
    def of(cls, app: FastAPI) -> RouteTable:
        """Raises UndeclaredRoute, naming them, when routes declare no class: they would be served unguarded."""
        # FastAPI's own /openapi.json is a plain Starlette route, which has nowhere to declare anything
        undeclared_ok = frozenset({app.openapi_url}) if app.openapi_url else frozenset[str]()
        rules: list[RouteRule] = []
        operations_paths: set[str] = set()
        operations_patterns: dict[str, re.Pattern[str]] = {}
        for route in declared_routes(app.routes, undeclared_ok=undeclared_ok):
            pattern, _, convertors = compile_path(route.path)
            if route.route_class == "operations":
                if convertors:
                    operations_patterns[route.path] = pattern
                else:
                    operations_paths.add(route.path)
            else:
                rules.append(RouteRule(route.method, pattern, route.route_class, route.name, route.operation,
                                       route.body_limit or DEFAULT_BODY_LIMIT, _priority(route)))
        return cls(tuple(rules), _preflight_rules(rules), frozenset(operations_paths),
                   tuple(operations_patterns.values()), tuple(rule.pattern for rule in rules if rule.any_origin))

    def any_origin(self, path: str) -> bool:
        """Whether a page on any origin reads the answers at `path` (the SDK's routes and the player's): the
        shedder's refusals there carry CORS headers as the guard's own do."""
        return path.startswith("/sdk/") or any(p.match(path) for p in self.player_patterns)

    def classify(self, method: str, path: str) -> tuple[RouteRule | None, str | None]:
        """The route's rule and the video id it acts on (SDK upload routes bind an upload token to it)."""
        for rule in self.rules:
            if rule.method == method:
                m = rule.pattern.match(path)
                if m:
                    return rule, m.groupdict().get("video_id")
        return None, None

    def shed_priority(self, method: str, path: str) -> Priority | Pass | None:
        """Where a request stands when the api sheds: PASS for an operations route (never shed), the route's own
        priority where it is not its method's, else None (the method decides)."""
        if path in self.operations_paths:
            return PASS
        for rule in self.rules:
            if rule.priority is not None and rule.method == method and rule.pattern.match(path):
                return rule.priority
        if self.unchecked(path):
            return PASS
        return None

    def unchecked(self, path: str) -> bool:
        """An operations route's path: served without auth.check."""
        return path in self.operations_paths or any(p.match(path) for p in self.operations_patterns)

    def methods_of(self, path: str) -> list[str]:
        """The methods the guarded routes serve at `path` (none: no such path)."""
        return sorted({rule.method for rule in self.rules if rule.pattern.match(path)})

    def preflight(self, path: str) -> PreflightRule | None:
        for rule in self.preflights:
            if rule.pattern.match(path):
                return rule
        return None


def _priority(route: DeclaredRoute) -> Priority | None:
    """Management routes are the highest priority (SPEC 15), as is any request with Weir's internal token (which
    the shedder checks itself: an internal route called without it is a read like any other); others as they
    declare, or None (the method decides)."""
    if route.route_class == "management":
        return "internal"
    return route.priority


def _preflight_rules(rules: list[RouteRule]) -> tuple[PreflightRule, ...]:
    """One per SDK route path, allowing the methods its routes serve."""
    by_path: dict[str, tuple[re.Pattern[str], list[str]]] = {}
    for rule in rules:
        if rule.route_class == "sdk":
            path = rule.name.split(" ", 1)[1]
            by_path.setdefault(path, (rule.pattern, []))[1].append(rule.method)
    return tuple(PreflightRule(pattern, ", ".join(sorted(methods)).encode(),
                               check_request_for("public", f"OPTIONS {path}", None))
                 for path, (pattern, methods) in by_path.items())


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by name (ASGI servers give the names in lower case; a repeated one keeps its last)."""
    return dict(scope.get("headers", ()))


class Guard:
    def __init__(self, app: ASGIApp, *, table: RouteTable, nc: Callable[[], NATS | None], timeout: float,
                 metrics: Metrics, watch: Callable[[], ConnectionWatch | None] = lambda: None) -> None:
        self.app = app
        self.table = table
        self.auth = CheckSender(nc, timeout=timeout, watch=watch)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.table.operations_paths:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = _headers(scope)
        sdk = path.startswith("/sdk/")
        if sdk and method == "OPTIONS" and b"access-control-request-method" in headers:
            preflight = self.table.preflight(path)
            if preflight is not None:
                await self._preflight(scope, headers, preflight, send)
                return
        rule, video_id = self.table.classify(method, path)
        if rule is None and self.table.unchecked(path):
            await self.app(scope, receive, send)
            return
        encode_check = rule.encode_check if rule else check_request_for("public", f"{method} (no route)", None)
        payload = encode_check(
            authorization=_text(headers.get(b"authorization")),
            internal_token=_text(headers.get(INTERNAL_HEADER)),
            peer=(scope.get("client") or ("0.0.0.0", 0))[0],
            forwarded_for=_forwarded_for(scope),
            video_id=video_id if rule and rule.route_class == "sdk" else None,
            origin=_text(headers.get(b"origin")) if sdk else None,
        )
        player = rule is not None and rule.any_origin
        checked = await self._check(payload)
        if isinstance(checked, str):
            # an SDK route with no app known: no ACAO (the page sees a network error, and retries); a player's route
            # is readable from any page whatever auth said
            await _unanswered(send, checked, [_VARY_ORIGIN] if sdk else PLAYER_REFUSAL if player else [])
            return
        reply, headers_of_limits = checked
        limit_headers = _encoded(headers_of_limits)  # on every answer, the route's and the guard's own
        if sdk:
            limit_headers += cors_headers(reply.cors_origin)
        own_headers = limit_headers  # the guard's own answers: the same, and a player route's ACAO
        if player:
            own_headers = [*limit_headers, *PLAYER_REFUSAL]
            limit_headers += PLAYER_EXPOSE  # the route sends its own ACAO
        if not reply.allowed:
            await _send_json(send, reply.status, reply.problem or problem_body(reply.status, "forbidden", ""),
                             own_headers)
            return
        if rule is None:  # no route serves it: answered here, so nothing the table does not hold ever runs
            await self._no_route(path, send, limit_headers)
            return
        scope.setdefault("state", {})["auth"] = reply
        limit = rule.body_limit
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_json(send, 413, _too_large(limit), own_headers)
            return
        if length is None and b"transfer-encoding" not in headers and scope.get("http_version") in ("1.1", "1.0"):
            # HTTP/1 framing: neither header means no body, so there is nothing to hold to the limit or to replay
            app_receive = receive
        else:
            body = await _read_body(receive, limit)
            if body is None:
                await _send_json(send, 413, _too_large(limit), own_headers)
                return
            app_receive = _replay(body, receive)

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *limit_headers]
            await send(message)

        await self.app(scope, app_receive, send_with_limits)

    async def _no_route(self, path: str, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """404, or 405 when the path is a route's with other methods: the problems FastAPI's router would give."""
        methods = self.table.methods_of(path)
        if methods:
            await _send_json(send, 405, problem_body(405, "method_not_allowed", "Method Not Allowed"),
                             [(b"allow", ", ".join(methods).encode()), *headers])
        else:
            await _send_json(send, 404, problem_body(404, "not_found", "Not Found"), headers)

    async def _check(self, payload: bytes) -> tuple[CheckDecision, dict[str, str]] | str:
        """auth's decision and limit headers, over the process's one NATS connection; else the code of the 503:
        `overloaded` when auth shed the check, `unavailable` when it does not answer or answers what cannot be
        read."""
        try:
            return await self.auth.check(payload)
        except AuthError as exc:
            if exc.error.code == OVERLOADED:
                self.metrics.inc("auth_overloaded_total", help="requests answered 503 because auth shed their check")
                return OVERLOADED
        except (TimeoutError, NatsError, PermissionRefused):
            pass
        except UnreadableReply:  # a newer auth's that broke its contract, or a broken one (logged where read)
            self.metrics.inc("auth_unreadable_replies_total", help="auth.check replies the api could not read")
        self.metrics.inc("auth_unavailable_total", help="requests answered 503 because auth did not answer")
        return UNAVAILABLE

    async def _preflight(self, scope: Scope, headers: dict[bytes, bytes], rule: PreflightRule, send: Send) -> None:
        """A CORS preflight of an SDK route: for any origin, counted on the address's budget (see CORS above)."""
        payload = rule.encode_check(
            authorization=None, internal_token=None,  # a preflight's credential, if any is sent, is never looked up
            peer=(scope.get("client") or ("0.0.0.0", 0))[0], forwarded_for=_forwarded_for(scope),
            video_id=None, origin=None,
        )
        checked = await self._check(payload)
        if isinstance(checked, str):
            await _unanswered(send, checked, [_VARY_ORIGIN])
            return
        reply, headers_of_limits = checked
        limit_headers = _encoded(headers_of_limits)
        if not reply.allowed:
            await _send_json(send, reply.status, reply.problem or problem_body(reply.status, "forbidden", ""),
                             [*limit_headers, _VARY_ORIGIN])
            return
        origin = headers.get(b"origin")
        await send({"type": "http.response.start", "status": 204, "headers": [
            *([(b"access-control-allow-origin", origin)] if origin else []),
            (b"access-control-allow-methods", rule.methods),
            (b"access-control-allow-headers", CORS_ALLOW_HEADERS),
            (b"access-control-max-age", CORS_MAX_AGE),
            _VARY_ORIGIN,
            *limit_headers,
        ]})
        await send({"type": "http.response.body", "body": b""})


OVERLOADED, UNAVAILABLE = "overloaded", "unavailable"
_UNANSWERED = {OVERLOADED: "auth is over capacity; retry after the Retry-After seconds",
               UNAVAILABLE: "auth does not answer; retry shortly"}


async def _unanswered(send: Send, code: str, headers: list[tuple[bytes, bytes]]) -> None:
    """503 for a request auth did not decide: `overloaded` (auth shed it) or `unavailable`."""
    await _send_json(send, 503, problem_body(503, code, _UNANSWERED[code]), [(b"retry-after", b"1"), *headers])


def _too_large(limit: int) -> dict[str, Any]:
    return problem_body(413, "payload_too_large", f"bodies here are at most {limit} bytes")


def _forwarded_for(scope: Scope) -> str | None:
    """Every X-Forwarded-For header, joined with commas in order (one header and several mean the same, RFC 9110)."""
    found = [v for k, v in scope.get("headers", ()) if k == b"x-forwarded-for"]
    if not found:
        return None
    return (b",".join(found) if len(found) > 1 else found[0]).decode("latin-1")


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


_HEADER_NAMES: dict[str, bytes] = {}


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """auth's limit headers as ASGI headers; the few names auth uses are lowered and encoded once."""
    encoded = []
    for name, value in headers.items():
        raw = _HEADER_NAMES.get(name)
        if raw is None:
            raw = name.lower().encode()
            if len(_HEADER_NAMES) < 64:  # auth sends a handful of names; anything else is encoded, not remembered
                _HEADER_NAMES[name] = raw
        encoded.append((raw, value.encode()))
    return encoded


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read ahead, as the route's first `receive`; later calls go to the server (a disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    raw = json.dumps(body).encode()
    challenge = [(b"www-authenticate", www_authenticate(body.get("code")).encode())] if status == 401 else []
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(raw)).encode()),
        *challenge,
        *headers,
    ]})
    await send({"type": "http.response.body", "body": raw})
