"""The outbox and its relay against real PostgreSQL and JetStream: no event lost, none applied twice."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import asyncpg
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from shared.bus import IdempotentConsumer, OutboxRelay, enqueue
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    create_effects,
    effect_counts,
    eventually,
    record_effect,
    spec,
    stream_copies,
    unique,
    video_created,
)


def relay_for(pool: asyncpg.Pool, nc: NATS, schema: str, settings: CommonSettings) -> OutboxRelay:
    return OutboxRelay(pool=pool, js=nc.jetstream(), dsn=settings.database_url, schema=schema, poll_seconds=0.2)


async def run_crashing_relay(settings: CommonSettings, schema: str, point: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.relay_proc",
        settings.database_url, settings.nats_url, schema, point,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == -signal.SIGKILL, err.decode()


async def test_relay_killed_before_publishing_still_delivers_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    event = video_created()
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, event)

    await run_crashing_relay(prepared, schema, "after_select")  # committed, selected, never published
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created", {event.id}))[event.id] == 0

    consumer = IdempotentConsumer(spec(unique("c"), record_effect), js=nc.jetstream(), pool=pool, settings=prepared)
    stop = asyncio.Event()
    relay = relay_for(pool, nc, schema, prepared)
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(consumer.run(stop))]
    try:
        await eventually(lambda: _applied(pool, [event.id], 1))
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created", {event.id}))[event.id] == 1
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0


async def test_relay_killed_after_puback_before_marking_applies_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    events = [video_created() for _ in range(5)]
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, *events)
    ids = [e.id for e in events]

    await run_crashing_relay(prepared, schema, "after_publish")  # JetStream has them; rows still unsent
    assert set((await stream_copies(nc.jetstream(), "VIDEOS", "video.created", set(ids))).values()) == {1}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL") == len(events)

    # the next relay publishes them again; JetStream drops the copies by Nats-Msg-Id
    assert await relay_for(pool, nc, schema, prepared).drain_once() == len(events)
    assert set((await stream_copies(nc.jetstream(), "VIDEOS", "video.created", set(ids))).values()) == {1}

    consumer = IdempotentConsumer(spec(unique("c"), record_effect), js=nc.jetstream(), pool=pool, settings=prepared)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await eventually(lambda: _applied(pool, ids, 1))
    finally:
        stop.set()
        await task
    assert set((await effect_counts(pool, ids)).values()) == {1}


async def test_same_event_published_twice_past_dedupe_is_applied_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """Beyond JetStream's duplicate window the copies are stored twice; the consumer's inbox still applies once."""
    _, pool = schema_pool
    await create_effects(pool)
    event = video_created()
    js = nc.jetstream()
    for attempt in range(2):  # distinct msg ids defeat the stream's de-duplication on purpose
        await js.publish("video.created", event.to_bytes(), headers={"Nats-Msg-Id": f"{event.id}-{attempt}"})
    consumer = IdempotentConsumer(spec(unique("c"), record_effect), js=js, pool=pool, settings=prepared)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await eventually(lambda: _consumer_idle(consumer))
    finally:
        stop.set()
        await task
    assert (await effect_counts(pool, [event.id]))[event.id] == 1


async def test_two_relays_on_one_outbox_publish_each_event_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    events = [video_created() for _ in range(prepared.outbox_batch_size * 2 + 37)]
    ids = [e.id for e in events]
    relays = [
        OutboxRelay(pool=pool, js=nc.jetstream(), dsn=prepared.database_url, schema=schema, batch_size=50)
        for _ in range(2)
    ]
    published: list[int] = [0, 0]

    async def drain(i: int) -> None:
        while (n := await relays[i].drain_once()) > 0:
            published[i] += n

    for chunk in range(0, len(events), 100):  # written in several transactions while both relays run
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, *events[chunk : chunk + 100])
    await asyncio.gather(drain(0), drain(1))
    assert sum(published) == len(events)  # no row published by both
    assert all(p > 0 for p in published), published  # and both took part
    copies = await stream_copies(nc.jetstream(), "VIDEOS", "video.created", set(ids))
    assert set(copies.values()) == {1}


async def _applied(pool: asyncpg.Pool, ids: list[str], times: int) -> bool:
    return set((await effect_counts(pool, ids)).values()) == {times}


async def _consumer_idle(consumer: IdempotentConsumer) -> bool:
    try:
        info = await consumer.js.consumer_info(consumer.spec.stream, consumer.spec.name)
    except NotFoundError:  # not created yet
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.consumer_seq > 0
