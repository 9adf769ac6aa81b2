"""The developer's endpoints, managed over NATS request/reply (`webhooks.manage.<op>`, from the api's routes of
SPEC 13). Each operation is a function of (service, connection, request) -> reply; `answer` runs one and turns its
refusals and failures into an `ErrorReply` at once, never leaving the caller to its timeout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import asyncpg
import uuid6
from pydantic import BaseModel

from services.webhooks import domain, signing, store
from services.webhooks.settings import WebhookSettings
from services.webhooks.ssrf import InvalidEndpointUrl, parse_endpoint_url
from shared.messaging import ErrorReply, Refused, answer_on_pool
from shared.webhookcalls import (
    AttemptView,
    CreateEndpoint,
    DeleteEndpoint,
    DeliveryPage,
    DeliveryView,
    EndpointCreated,
    EndpointDeleted,
    EndpointList,
    EndpointView,
    GetEndpoint,
    ListDeliveries,
    ListEndpoints,
    Replay,
    ReplayAccepted,
    RotateSecret,
    SecretRotated,
    UpdateEndpoint,
)

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)


Refusal = Refused  # an operation's refusal, answered as its ErrorReply


@dataclass
class Management:
    settings: WebhookSettings
    pool: asyncpg.Pool
    on_new_deliveries: Callable[[], None]  # a replay's deliveries are due now: wake the deliverer


Operation = Callable[[Management, asyncpg.Connection, Req], Awaitable[Rep]]


async def answer(m: Management, operation: Operation[Req, Rep], request: Req) -> Rep | ErrorReply:
    """Run one operation on a pooled connection; a refusal, or a failure, is answered at once."""
    return await answer_on_pool("webhooks", m.pool, operation, m, request)


def _url(m: Management, url: str) -> str:
    try:
        parse_endpoint_url(url, allow_private=m.settings.webhook_allow_private)
    except InvalidEndpointUrl as exc:
        raise Refusal(400, "invalid_url", f"{exc} ({exc.reason})") from None
    return url


def _events(events: list[str]) -> tuple[str, ...]:
    try:
        return domain.validate_subscription(events)
    except domain.InvalidSubscription as exc:
        raise Refusal(400, "invalid_events", f"events: {exc}") from None


def _view(e: store.EndpointRow) -> EndpointView:
    return EndpointView(id=e.id, url=e.url, events=list(e.events), description=e.description, enabled=e.enabled,
                        disabled_reason=e.disabled_reason, disabled_at=e.disabled_at,
                        failing_since=e.failing_since, created_at=e.created_at,
                        secret_rotated_at=e.secret_rotated_at)


async def _endpoint(conn: asyncpg.Connection, app_id: str, endpoint_id: str, *, lock: bool = False
                    ) -> store.EndpointRow:
    found = await store.endpoint(conn, app_id, endpoint_id, lock=lock)
    if found is None:
        raise Refusal(404, "not_found", "no such webhook endpoint")
    return found


async def create_endpoint(m: Management, conn: asyncpg.Connection, req: CreateEndpoint) -> EndpointCreated:
    secret = signing.new_secret(m.settings.webhook_secret_bytes)
    created = await store.create_endpoint(conn, app_id=req.app_id, account_id=req.account_id, url=_url(m, req.url),
                                          events=_events(req.events), description=req.description, secret=secret)
    return EndpointCreated(endpoint=_view(created), secret=secret)


async def list_endpoints(m: Management, conn: asyncpg.Connection, req: ListEndpoints) -> EndpointList:
    return EndpointList(endpoints=[_view(e) for e in await store.endpoints_of_app(conn, req.app_id)])


async def get_endpoint(m: Management, conn: asyncpg.Connection, req: GetEndpoint) -> EndpointView:
    return _view(await _endpoint(conn, req.app_id, req.endpoint_id))


async def update_endpoint(m: Management, conn: asyncpg.Connection, req: UpdateEndpoint) -> EndpointView:
    async with conn.transaction():
        await _endpoint(conn, req.app_id, req.endpoint_id, lock=True)
        updated = await store.update_endpoint(
            conn, req.endpoint_id, url=None if req.url is None else _url(m, req.url),
            events=None if req.events is None else _events(req.events), description=req.description,
            enabled=req.enabled)
    return _view(updated)


async def delete_endpoint(m: Management, conn: asyncpg.Connection, req: DeleteEndpoint) -> EndpointDeleted:
    async with conn.transaction():
        await _endpoint(conn, req.app_id, req.endpoint_id, lock=True)
        await store.delete_endpoint(conn, req.endpoint_id)
    return EndpointDeleted(id=req.endpoint_id)


async def rotate_secret(m: Management, conn: asyncpg.Connection, req: RotateSecret) -> SecretRotated:
    now = datetime.now(UTC)
    overlap = timedelta(seconds=m.settings.webhook_secret_overlap_seconds)
    new = signing.new_secret(m.settings.webhook_secret_bytes)
    async with conn.transaction():
        await _endpoint(conn, req.app_id, req.endpoint_id, lock=True)
        rotated = domain.rotate_secret(await store.secrets_of(conn, req.endpoint_id), new, now=now, overlap=overlap)
        await store.save_secrets(conn, req.endpoint_id, rotated, now)
    return SecretRotated(secret=new, previous_signs_until=now + overlap)


async def list_deliveries(m: Management, conn: asyncpg.Connection, req: ListDeliveries) -> DeliveryPage:
    await _endpoint(conn, req.app_id, req.endpoint_id)
    after = None
    if req.cursor:
        after = store.decode_cursor(req.cursor)
        if after is None:
            raise Refusal(400, "validation_error", "not a cursor of this delivery log")
    rows = await store.deliveries(conn, req.endpoint_id, state=req.status, after=after, limit=req.limit + 1)
    page, more = rows[: req.limit], len(rows) > req.limit
    return DeliveryPage(
        deliveries=[DeliveryView(
            id=d.id, event_id=d.event_id, event_type=d.event_type, video_id=d.video_id,
            status=d.state,
            replay_id=d.replay_id, created_at=d.created_at, next_attempt_at=d.next_attempt_at,
            attempts=[AttemptView(at=a.at, status_code=a.status_code, error=a.error, latency_ms=a.latency_ms,
                                  address=a.address) for a in d.attempts]) for d in page],
        next_cursor=store.encode_cursor(page[-1].created_at, page[-1].id) if more and page else None)


def duration(seconds: float) -> str:
    """A retention as people say it: `30 days`, `12 hours`, `90 s`."""
    for unit, size in (("days", 86400), ("hours", 3600)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:.0f} {unit}"
    return f"{seconds:.0f} s"


async def replay(m: Management, conn: asyncpg.Connection, req: Replay) -> ReplayAccepted:
    if req.until is not None and req.until < req.since:
        raise Refusal(400, "validation_error", "until is before since (until is now when not given: since is in "
                      "the future)")
    kept_since = datetime.now(UTC) - timedelta(seconds=m.settings.webhook_deliveries_keep_seconds)
    if req.since < kept_since:
        kept = duration(m.settings.webhook_deliveries_keep_seconds)
        raise Refusal(400, "validation_error", f"events are kept {kept}: since must be after {kept_since.isoformat()}")
    types = list(_events(req.types)) if req.types else None
    replay_id = str(uuid6.uuid7())
    async with conn.transaction():
        endpoint = await _endpoint(conn, req.app_id, req.endpoint_id, lock=True)
        if not endpoint.enabled:
            raise Refusal(409, "endpoint_disabled", "the endpoint is disabled: turn it on (PATCH enabled) first")
        count = await store.replay(conn, endpoint, since=req.since, until=req.until, types=types,
                                   replay_id=replay_id)
    if count:
        m.on_new_deliveries()
    return ReplayAccepted(replay_id=replay_id, count=count)
