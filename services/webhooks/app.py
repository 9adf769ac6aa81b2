"""Wiring of the `webhooks` service: developers' endpoints, their secrets, deliveries and attempts (SPEC 13).

- consumers: `webhooks_videos` (video and upload events), `webhooks_encode` (encoding events), `webhooks_own`
  (`webhook.disabled`): each event is kept with its app and a delivery made to each endpoint that takes it, in the
  transaction of its inbox record; the commit wakes the deliverer;
- subscribers: `webhooks.manage.<op>` (request/reply from the api, queue group `webhooks`);
- loops: the deliverer (services/webhooks/delivering.py) and the removal of what is past its keep period.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import asyncpg
from faststream.nats import NatsBroker
from faststream.nats.subscriber.usecases import LogicSubscriber

from services.webhooks import manage, store
from services.webhooks.delivering import DELIVERER_CONNECTIONS, INDEX_PLANS, Deliverer, forget_old
from services.webhooks.settings import WebhookSettings
from shared.consumer import ConsumerSpec, Position, applying_position
from shared.db import create_pool
from shared.events import (
    EncodeCompleted,
    EncodeFailed,
    EncodeProgress,
    EncodeStarted,
    Event,
    UploadCompleted,
    VideoCaptionsChanged,
    VideoCreated,
    VideoDeleted,
    VideoFailed,
    VideoReady,
    VideoRetired,
    WebhookDisabled,
)
from shared.messaging import ErrorReply, declare_reply
from shared.runtime import Runtime, ServiceDefinition
from shared.webhookcalls import (
    OPERATIONS,
    CreateEndpoint,
    DeleteEndpoint,
    DeliveryPage,
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
    manage_subject,
)

log = logging.getLogger("weir.webhooks")
QUEUE_GROUP = "webhooks"
MANAGE_CONCURRENCY = 32


def _settings(rt: Runtime) -> WebhookSettings:
    assert isinstance(rt.settings, WebhookSettings)
    return rt.settings


def _deliverer(rt: Runtime) -> Deliverer:
    return rt.parts_of(Deliverer)


def _received(event: Event[Any], app_id: str | None, video_id: str | None) -> store.Received:
    return store.Received(event.id, event.type, app_id, video_id, event.time, event.to_bytes())


def consumers(rt: Runtime) -> list[ConsumerSpec]:
    """Each handler keeps the event and makes its deliveries in the transaction of its inbox record."""

    def hold() -> timedelta:  # read when an event comes (the runtime's settings are the service's by then)
        return timedelta(seconds=_settings(rt).webhook_order_hold_seconds)

    def settle() -> timedelta:
        return timedelta(seconds=_settings(rt).webhook_order_settle_seconds)

    def gate() -> Position | None:  # where the event being applied was read (the deliverer waits for its ack floor)
        return applying_position() if _settings(rt).webhook_order_gate else None

    def wake(_applied: list[Event[Any]]) -> None:
        if isinstance(rt.parts, Deliverer):  # events may be applied before the start made it
            rt.parts.nudge()

    async def on_video(conn: asyncpg.Connection,
                       event: Event[VideoCreated] | Event[VideoDeleted] | Event[UploadCompleted] | Event[VideoRetired]
                       | Event[VideoReady] | Event[VideoFailed] | Event[VideoCaptionsChanged]) -> None:
        data = event.data
        if isinstance(data, VideoRetired):
            known = await store.video(conn, data.video_id)
            app_id = None if known is None else known.app_id
        else:
            await store.learn_video(conn, data.video_id, data.app_id, data.account_id, hold=hold(),
                                    settle=settle())
            app_id = data.app_id
        if isinstance(data, UploadCompleted):
            await store.source_arrived(conn, data.video_id)
        await store.receive(conn, _received(event, app_id, data.video_id), settle=settle(), gate=gate())

    async def on_encoding(conn: asyncpg.Connection,
                          event: Event[EncodeStarted] | Event[EncodeProgress] | Event[EncodeCompleted]
                          | Event[EncodeFailed]) -> None:
        # its video.created and upload.completed come on another stream and may be read later: until the first
        # comes its app is None (kept, delivered then), until the second its deliveries wait (domain.first_due)
        video_id = event.data.video_id
        known = await store.video(conn, video_id)
        await store.receive(conn, _received(event, None if known is None else known.app_id, video_id),
                            source_seen=known is not None and known.source_seen, hold=hold(),
                            settle=settle(), gate=gate())

    async def on_own(conn: asyncpg.Connection, event: Event[WebhookDisabled]) -> None:
        await store.receive(conn, _received(event, event.data.app_id, None), settle=settle())

    return [
        ConsumerSpec(name="webhooks_videos", handler=on_video, after_commit=wake),
        ConsumerSpec(name="webhooks_encode", handler=on_encoding, after_commit=wake),
        ConsumerSpec(name="webhooks_own", handler=on_own, after_commit=wake),
    ]


async def start(rt: Runtime) -> None:
    settings = _settings(rt)
    _, js, pool = rt.require()
    assert rt.broker is not None

    async def ack_floor(stream: str, durable: str) -> int | None:
        """The durable's ack floor: every message up to it acknowledged (None: not known now)."""
        try:
            info = await js.consumer_info(stream, durable)
        except Exception as exc:  # NATS away, the durable gone: the gate's longest wait still ends
            log.warning("ack floor of %s: %s", durable, exc)
            return None
        return None if info.ack_floor is None else info.ack_floor.stream_seq

    deliverer = Deliverer(settings, pool, rt.metrics, ack_floor=ack_floor)
    rt.parts = deliverer
    serve_management(rt.broker, manage.Management(settings, pool, deliverer.nudge))


def serve_management(broker: NatsBroker, m: manage.Management) -> None:
    """`webhooks.manage.<op>`: one subscriber per operation (queue group `webhooks`), its reply in the document."""

    def operation(name: str, description: str) -> LogicSubscriber[Any]:
        subject = manage_subject(name)
        declare_reply(broker, subject, OPERATIONS[name][1] | ErrorReply)
        return broker.subscriber(subject, queue=QUEUE_GROUP, max_workers=MANAGE_CONCURRENCY, title=subject,
                                 description=description)

    @operation("endpoint.create", "a new endpoint of the app; its signing secret, shown once")
    async def create(request: CreateEndpoint) -> EndpointCreated | ErrorReply:
        return await manage.answer(m, manage.create_endpoint, request)

    @operation("endpoint.list", "the app's endpoints")
    async def list_(request: ListEndpoints) -> EndpointList | ErrorReply:
        return await manage.answer(m, manage.list_endpoints, request)

    @operation("endpoint.get", "one endpoint of the app")
    async def get(request: GetEndpoint) -> EndpointView | ErrorReply:
        return await manage.answer(m, manage.get_endpoint, request)

    @operation("endpoint.update", "change an endpoint; enabled: true turns a disabled one back on")
    async def update(request: UpdateEndpoint) -> EndpointView | ErrorReply:
        return await manage.answer(m, manage.update_endpoint, request)

    @operation("endpoint.delete", "delete an endpoint with its deliveries")
    async def delete(request: DeleteEndpoint) -> EndpointDeleted | ErrorReply:
        return await manage.answer(m, manage.delete_endpoint, request)

    @operation("secret.rotate", "a new signing secret; the previous one signs beside it for the overlap")
    async def rotate(request: RotateSecret) -> SecretRotated | ErrorReply:
        return await manage.answer(m, manage.rotate_secret, request)

    @operation("deliveries.list", "the endpoint's delivery log, newest first, with each attempt")
    async def deliveries(request: ListDeliveries) -> DeliveryPage | ErrorReply:
        return await manage.answer(m, manage.list_deliveries, request)

    @operation("replay", "send a slice of the app's events to the endpoint again (the same webhook-ids)")
    async def replay(request: Replay) -> ReplayAccepted | ErrorReply:
        return await manage.answer(m, manage.replay, request)


async def delivering(rt: Runtime, stop_event: Any) -> None:
    """The deliverer, on a pool of its own that plans by index (delivering.INDEX_PLANS says why)."""
    settings = _settings(rt)
    deliverer = _deliverer(rt)
    pool = await create_pool(settings.database_url, schema=SERVICE.schema, max_size=DELIVERER_CONNECTIONS,
                             planner=INDEX_PLANS)
    deliverer.pool = pool
    try:
        await deliverer.run(stop_event)
    finally:
        await pool.close()


async def forgetting(rt: Runtime, stop_event: Any) -> None:
    _, _, pool = rt.require()
    await forget_old(_settings(rt), pool, stop_event)


SERVICE = ServiceDefinition(
    name="webhooks",
    settings_cls=WebhookSettings,
    consumers=consumers,
    on_start=start,
    background=(delivering, forgetting),
    description="developers' endpoints: Weir's events delivered to them, signed, retried and logged",
)
