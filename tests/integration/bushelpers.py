"""What the bus tests share: events to send, an effect table that counts applications, consumers and relays on a
FastStream broker, waiting."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import asyncpg
from faststream.nats import NatsBroker
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from shared.consumer import ConsumerSpec, EventConsumer, EventHandler
from shared.events import Envelope, Event, RecordingCompleted, VideoCreated, new_event
from shared.messaging import make_broker
from shared.outbox import OutboxRelay
from shared.publishers import EventPublishers
from shared.settings import CommonSettings
from tests.stored import stored_events

SETTLE_S = 15.0  # what a bus flow (publish, deliver, handle, ack) may take to settle on a loaded machine


def video_created() -> Envelope:
    vid = str(uuid.uuid4())
    return new_event(
        VideoCreated(video_id=vid, app_id=str(uuid.uuid4()), account_id=str(uuid.uuid4())),
        source="test",
        subject=vid,
    )


def recording_completed() -> Envelope:
    rid = str(uuid.uuid4())
    return new_event(
        RecordingCompleted(recording_id=rid, object_key=f"recordings/{rid}", size=1),
        source="test",
        subject=rid,
    )


async def create_effects(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS effects (event_id uuid NOT NULL, at timestamptz DEFAULT now())")


async def record_effect(conn: asyncpg.Connection, event: Event[VideoCreated]) -> None:
    await conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)


async def record_recording(conn: asyncpg.Connection, event: Event[RecordingCompleted]) -> None:
    await conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)


async def effect_counts(pool: asyncpg.Pool, ids: list[str]) -> dict[str, int]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_id::text AS id, count(*) AS n FROM effects WHERE event_id = ANY($1::uuid[]) GROUP BY 1", ids
        )
    counts = {i: 0 for i in ids}
    counts.update({r["id"]: r["n"] for r in rows})
    return counts


def spec(name: str, handler: EventHandler) -> ConsumerSpec:
    """A consumer of what the handler's event annotation names (its stream and subjects follow from it)."""
    return ConsumerSpec(name=name, handler=handler)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def consuming(
    settings: CommonSettings, pool: asyncpg.Pool, *specs: ConsumerSpec, from_now: bool = False
) -> AsyncIterator[list[EventConsumer]]:
    """The consumers running on a broker of their own, as a service runs them; stopped as a service stops them
    (subscribers first, then in-flight lanes drained, then the connection). `from_now`: new durables start at the
    end of their streams (what earlier tests stored is not theirs)."""
    broker = make_broker(settings, name="test-consumer")
    nc = await broker.connect()
    consumers = [EventConsumer(s, pool=pool, settings=settings) for s in specs]
    try:
        for consumer in consumers:
            consumer.register(broker)
            if from_now:
                await start_at_end(nc.jetstream(), consumer)
            await consumer.ensure_if_possible(nc.jetstream())
        await broker.start()
        for consumer in consumers:
            consumer.start()
        yield consumers
    finally:
        await asyncio.gather(*(sub.stop() for sub in broker.subscribers))
        await asyncio.gather(*(c.drain() for c in consumers))
        await broker.stop()


async def start_at_end(js: JetStreamContext, consumer: EventConsumer) -> None:
    for source in consumer.sources():
        config = consumer.consumer_config(durable=source.durable, subjects=source.subjects)
        config.deliver_policy = api.DeliverPolicy.NEW
        await js.add_consumer(source.stream, config)


@asynccontextmanager
async def relay_broker(settings: CommonSettings, event_types: Sequence[str]) -> AsyncIterator[EventPublishers]:
    """A started broker with the declared publishers of these event types, as a service's relay has them."""
    broker: NatsBroker = make_broker(settings, name="test-relay")
    await broker.connect()
    publishers = EventPublishers(broker, event_types, timeout=settings.bus_publish_timeout_seconds)
    await broker.start()
    try:
        yield publishers
    finally:
        await broker.stop()


def relay_for(pool: asyncpg.Pool, publishers: EventPublishers, schema: str, settings: CommonSettings,
              batch_size: int | None = None, legacy_copies: bool = False) -> OutboxRelay:
    return OutboxRelay(pool=pool, publishers=publishers, dsn=settings.database_url, schema=schema, poll_seconds=0.2,
                       batch_size=batch_size or settings.outbox_batch_size, legacy_copies=legacy_copies)


async def consumer_idle(js: JetStreamContext, stream: str, durable: str, *, started: bool = False) -> bool:
    """Nothing pending or unacknowledged on the durable (and, with `started`, something delivered already)."""
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:  # not created yet
        return False
    if started and not info.delivered.consumer_seq:
        return False
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def stream_copies(js: JetStreamContext, stream: str, subject: str, msg_ids: set[str]) -> dict[str, int]:
    """How many messages of `subject` in `stream` carry each of these ids (read with an ephemeral consumer)."""
    return {i: len(seqs) for i, seqs in (await stream_positions(js, stream, subject, msg_ids)).items()}


async def stream_positions(js: JetStreamContext, stream: str, subject: str, msg_ids: set[str]) -> dict[str, list[int]]:
    """The stream sequences of the messages of `subject` carrying each of these event ids."""
    positions: dict[str, list[int]] = {i: [] for i in msg_ids}
    for m, env in await stored_events(js, stream, subject):
        if env.id in positions:
            positions[env.id].append(m.metadata.sequence.stream)
    return positions


@asynccontextmanager
async def replayable_reader(js: JetStreamContext, stream: str, subject: str, prefix: str) -> AsyncIterator[str]:
    """A durable reading `subject` of `stream` from now on, and its replay durable (as a service's consumer has:
    `weir replay` delivers only to a consumer that reads its replay subject); both deleted afterwards."""
    from shared.contracts import REPLAY_STREAM, replay_durable, replay_filter

    durable = unique(prefix)
    ack = api.AckPolicy.EXPLICIT
    await js.add_consumer(stream, api.ConsumerConfig(durable_name=durable, filter_subject=subject,
                                                     deliver_policy=api.DeliverPolicy.NEW, ack_policy=ack))
    await js.add_consumer(REPLAY_STREAM, api.ConsumerConfig(durable_name=replay_durable(durable), ack_policy=ack,
                                                            filter_subject=replay_filter(durable)))
    try:
        yield durable
    finally:
        await js.delete_consumer(stream, durable)
        await js.delete_consumer(REPLAY_STREAM, replay_durable(durable))
