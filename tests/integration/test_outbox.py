"""The outbox and its relay (FastStream publishers) against real PostgreSQL and JetStream: no event lost, none
applied twice, the outbox's order kept."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime

import asyncpg
import pytest
import uuid6
from nats.aio.client import Client as NATS
from nats.js.errors import NoStreamResponseError

from shared.bus import HDR_LEGACY_COPY, HDR_MSG_ID
from shared.events import Envelope, VideoCreated, VideoDeleted, new_event
from shared.outbox import enqueue
from shared.settings import CommonSettings
from tests.integration.bushelpers import (
    SETTLE_S,
    consumer_idle,
    consuming,
    create_effects,
    effect_counts,
    record_effect,
    relay_broker,
    relay_for,
    spec,
    stream_copies,
    stream_positions,
    unique,
    video_created,
)
from tests.waiting import wait_for


async def run_crashing_relay(settings: CommonSettings, schema: str, point: str, transport: str = "table") -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.relay_proc",
        settings.database_url, settings.nats_url, schema, point, transport,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        # the suite's own identity (the relay publishes every type): its settings read these
        env={**os.environ, "WEIR_NATS_NKEY_SEED_DIR": settings.nats_nkey_seed_dir,
             "WEIR_NATS_IDENTITY": settings.nats_identity},
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    # its backend ends its transaction (and lets go of the rows it locked) only once it reads the closed socket
    conn = await asyncpg.connect(settings.database_url)
    try:
        await wait_for(lambda: conn.fetchval(
            "SELECT count(*) = 0 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
            " WHERE c.relname = 'outbox' AND c.relnamespace = $1::regnamespace AND l.pid <> pg_backend_pid()",
            schema), 10, "the killed relay's backend gone")
    finally:
        await conn.close()


async def test_relay_killed_before_publishing_still_delivers_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    event = video_created()
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, event)

    await run_crashing_relay(prepared, schema, "after_select")  # committed, selected, never published
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {event.id}))[event.id] == 0

    stop = asyncio.Event()
    async with relay_broker(prepared, ["video.created"]) as publishers, \
            consuming(prepared, pool, spec(unique("c"), record_effect)):
        relay = asyncio.create_task(relay_for(pool, publishers, schema, prepared).run(stop))
        try:
            await wait_for(lambda: _applied(pool, [event.id], 1), SETTLE_S, "the event applied once")
        finally:
            stop.set()
            await relay
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {event.id}))[event.id] == 1
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
    assert set((await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", set(ids))).values()) == {1}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL") == len(events)

    # the next relay publishes them again; JetStream drops the copies by Nats-Msg-Id
    async with relay_broker(prepared, ["video.created"]) as publishers:
        assert await relay_for(pool, publishers, schema, prepared).drain_once() == len(events)
    assert set((await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", set(ids))).values()) == {1}

    async with consuming(prepared, pool, spec(unique("c"), record_effect)):
        await wait_for(lambda: _applied(pool, ids, 1), SETTLE_S, "every event applied once")
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
    name = unique("c")
    async with consuming(prepared, pool, spec(name, record_effect)):
        await wait_for(lambda: consumer_idle(js, "VIDEOS", name, started=True), SETTLE_S, "the consumer idle")
    assert (await effect_counts(pool, [event.id]))[event.id] == 1


async def test_two_relays_on_one_outbox_publish_each_event_once(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    schema, pool = schema_pool
    await create_effects(pool)
    events = [video_created() for _ in range(prepared.outbox_batch_size * 2 + 37)]
    ids = [e.id for e in events]
    published: list[int] = [0, 0]
    async with relay_broker(prepared, ["video.created"]) as first, relay_broker(prepared, ["video.created"]) as second:
        relays = [relay_for(pool, publishers, schema, prepared, batch_size=50) for publishers in (first, second)]

        async def drain(i: int) -> None:
            while (n := await relays[i].drain_once()) > 0:
                published[i] += n

        for chunk in range(0, len(events), 100):  # written in several transactions while both relays run
            async with pool.acquire() as conn, conn.transaction():
                await enqueue(conn, *events[chunk : chunk + 100])
        await asyncio.gather(drain(0), drain(1))
    assert sum(published) == len(events)  # no row published by both
    assert all(p > 0 for p in published), published  # and both took part
    copies = await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", set(ids))
    assert set(copies.values()) == {1}


async def test_relay_keeps_the_outbox_order_in_the_stream_and_sends_the_event_id(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """A batch's publishes are in flight together (their PubAcks awaited at the end): the stream stores them in the
    outbox's order, each with its event id as Nats-Msg-Id, so events about one entity reach consumers in the order
    they were written."""
    schema, pool = schema_pool
    entities = [str(uuid.uuid4()) for _ in range(5)]
    events: list[Envelope] = []
    for round_ in range(60):  # created then deleted, entity by entity, interleaved: two types, one stream
        entity = entities[round_ % len(entities)]
        data = (VideoCreated if round_ % 2 == 0 else VideoDeleted)(video_id=entity, app_id=entity, account_id=entity)
        events.append(new_event(data, source="test", subject=entity))
    for chunk in range(0, len(events), 7):
        async with pool.acquire() as conn, conn.transaction():
            await enqueue(conn, *events[chunk : chunk + 7])
    async with relay_broker(prepared, ["video.created", "video.deleted"]) as publishers:
        relay = relay_for(pool, publishers, schema, prepared)
        relay.legacy_copies = True  # WEIR_EVENTS_LEGACY_SUBJECTS: each event's copy follows it, in order too
        assert await relay.drain_once() == len(events)
    js = nc.jetstream()
    ids = {e.id for e in events}
    positions = await stream_positions(js, "VIDEOS", "video.*.*", ids)  # on each account's subject
    assert all(len(seqs) == 1 for seqs in positions.values()), positions
    stored = [positions[e.id][0] for e in events]
    assert stored == sorted(stored)  # the outbox's order, seq by seq
    copies = await stream_positions(js, "VIDEOS", "video.*", ids)  # and a copy on the bare type, for 1.0.0
    assert [copies[e.id] for e in events] == [[seq + 1] for seq in stored]  # each right after its event
    for seq, event in zip(stored, events, strict=True):
        msg = await js.get_msg("VIDEOS", seq)
        assert (msg.headers or {}).get(HDR_MSG_ID) == event.id
        assert msg.subject == f"{event.type}.{event.data['account_id']}"
        copy = await js.get_msg("VIDEOS", seq + 1)
        assert copy.subject == event.type and (copy.headers or {}).get(HDR_MSG_ID) == f"{event.id}-legacy"
        assert (copy.headers or {}).get(HDR_LEGACY_COPY) == "1" and copy.data == msg.data


async def test_a_row_jetstream_does_not_acknowledge_stays_unsent(
    schema_pool: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings
) -> None:
    """No stream stores the subject, so no PubAck comes: that row stays in the outbox for the next attempt, and the
    rest of its batch is marked sent."""
    schema, pool = schema_pool
    stored = video_created()
    unstored = Envelope(id=str(uuid6.uuid7()), type="nothing.stores.this", source="test", time=datetime.now(UTC),
                        subject="x", dataschemaversion=1, data={})
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, stored, unstored)
    async with relay_broker(prepared, ["video.created"]) as publishers:
        assert await relay_for(pool, publishers, schema, prepared).drain_once() == 1
        # one event at a time (media's progress): its PubAck, or the reason there is none
        single = video_created()
        ack = await publishers.publish(single.type, single.to_bytes(), single.id)
        assert ack.stream == "VIDEOS" and not ack.duplicate
        with pytest.raises(NoStreamResponseError):
            await publishers.publish(unstored.type, unstored.to_bytes(), str(uuid6.uuid7()))
    async with pool.acquire() as conn:
        unsent = await conn.fetch("SELECT id::text FROM outbox WHERE sent_at IS NULL")
    assert [r[0] for r in unsent] == [unstored.id]
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {stored.id}))[stored.id] == 1


async def _applied(pool: asyncpg.Pool, ids: list[str], times: int) -> bool:
    return set((await effect_counts(pool, ids)).values()) == {times}

