"""The `wal` outbox transport (shared/walrelay.py) against real PostgreSQL (wal_level=logical) and JetStream: events
written as WAL messages in their change's statement reach the stream once each, in commit order, streamed over the
replication protocol; a relay that dies before confirming its slot sends again and the copy is absorbed; one relay of
several reads the slot and another takes over; rows an earlier release writes to the outbox table still go out; a
frame of a later release is skipped; the slot's confirmed point follows what went out, past WAL of no event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NATS

from shared import outbox
from shared.authclient import create_account_with_app
from shared.bus import HDR_MSG_ID
from shared.db import SCHEMAS
from shared.events import Envelope, VideoCreated, VideoDeleted, new_event
from shared.outbox import WAL_PREFIX, change_with_events, enqueue
from shared.settings import CommonSettings
from shared.walrelay import SlotStream, WalRelay, drop_slot, ensure_slot, slot_name
from tests.conftest import fresh_schema
from tests.integration.apihelpers import Client, create, run_services
from tests.integration.authhelpers import fresh_address
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
from tests.integration.test_outbox import run_crashing_relay
from tests.stored import stored_events
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

TYPES = ["video.created", "video.deleted"]
API = SCHEMAS["api"]


@pytest.fixture
async def wal_schema(prepared: CommonSettings) -> AsyncIterator[tuple[str, asyncpg.Pool]]:
    """A fresh schema with its slot; dropped after the test (a slot nobody reads keeps WAL)."""
    async with fresh_schema(prepared.database_url, "bustest") as (schema, pool):
        async with pool.acquire() as conn:
            assert await ensure_slot(conn, schema)
            assert not await ensure_slot(conn, schema)  # made once; a second start finds it
        try:
            yield schema, pool
        finally:
            async with pool.acquire() as conn:
                await wait_for(lambda: conn.fetchval("SELECT active_pid IS NULL FROM pg_replication_slots"
                                                     " WHERE slot_name = $1", slot_name(schema)), SETTLE_S,
                               "the slot let go")
                await drop_slot(conn, schema)


@pytest.fixture
def wal_writes() -> Iterator[None]:
    """This process's writes put their events in the WAL for the test (as a service with the setting does)."""
    outbox.use_transport("wal")
    try:
        yield
    finally:
        outbox.use_transport("table")


@contextlib.asynccontextmanager
async def running(relay: WalRelay) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, SETTLE_S)


def wal_relay(pool: asyncpg.Pool, publishers: object, schema: str, settings: CommonSettings) -> WalRelay:
    table = relay_for(pool, publishers, schema, settings)  # type: ignore[arg-type]
    return WalRelay(dsn=settings.database_url, schema=schema, table=table, standby_seconds=0.1)


async def caught_up(relay: WalRelay, settings: CommonSettings) -> int:
    """The events a fresh session of `relay` streams and sends up to the WAL flushed now (the slot then confirmed
    past them, as at any reader's stop)."""
    stream = await SlotStream.open(settings.database_url, relay.slot)
    conn = await asyncpg.connect(settings.database_url)
    try:
        return await relay.catch_up(stream, conn, SETTLE_S)
    finally:
        await stream.close()
        await conn.close()


async def confirmed_at(pool: asyncpg.Pool, schema: str) -> int:
    async with pool.acquire() as conn:
        return int(await conn.fetchval("SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots"
                                       " WHERE slot_name = $1", slot_name(schema)))


async def wal_flushed(pool: asyncpg.Pool) -> None:
    """What was committed so far is flushed: a slot yields only flushed WAL, and the suite's PostgreSQL commits
    without waiting for the flush (synchronous_commit=off: its WAL writer flushes within a few hundred ms)."""
    async with pool.acquire() as conn:
        written = await conn.fetchval("SELECT pg_current_wal_insert_lsn()")
        await wait_for(lambda: conn.fetchval("SELECT pg_current_wal_flush_lsn() >= $1", written), SETTLE_S,
                       "the WAL flushed")


async def outbox_rows(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM outbox"))


async def test_events_written_in_the_wal_reach_the_stream_once_each_in_commit_order(
        wal_schema: tuple[str, asyncpg.Pool], wal_writes: None, nc: NATS, prepared: CommonSettings) -> None:
    """Every way a service writes events: `enqueue` in a transaction, `change_with_events` with RETURNING, without
    it, and one whose statement changed no row (its event is written all the same, as with the table)."""
    schema, pool = wal_schema
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE state (id text PRIMARY KEY, n int NOT NULL DEFAULT 0)")
    entities = [video_created().subject for _ in range(4)]
    events: list[Envelope] = []

    def event(i: int) -> Envelope:
        entity = entities[i % len(entities)]
        data = (VideoCreated if i % 2 == 0 else VideoDeleted)(video_id=entity, app_id=entity, account_id=entity)
        made = new_event(data, source="test", subject=entity)
        events.append(made)
        return made

    async with pool.acquire() as conn:
        for i in range(0, 24, 3):
            async with conn.transaction():
                await enqueue(conn, event(i), event(i + 1))
            rows = await change_with_events(conn, "INSERT INTO state (id) VALUES ($1) RETURNING id", f"s{i}",
                                            events=(event(i + 2),))
            assert [r["id"] for r in rows] == [f"s{i}"]
        await change_with_events(conn, "UPDATE state SET n = n + 1", events=(event(24),))
        assert await change_with_events(conn, "UPDATE state SET n = 1 WHERE id = $1 RETURNING id", "none",
                                        events=(event(25),)) == []
    assert await outbox_rows(pool) == 0  # nothing in the table: the WAL holds them
    async with relay_broker(prepared, TYPES) as publishers:
        relay = wal_relay(pool, publishers, schema, prepared)
        async with running(relay):
            js = nc.jetstream()
            ids = {e.id for e in events}
            positions = await wait_for(lambda: stream_positions(js, "VIDEOS", "video.*.*", ids), SETTLE_S,
                                       "every event in the stream", until=lambda p: all(p.values()))
    assert all(len(seqs) == 1 for seqs in positions.values()), positions
    stored = [positions[e.id][0] for e in events]
    assert stored == sorted(stored)  # the order they were committed in
    msg = await js.get_msg("VIDEOS", stored[0])
    assert (msg.headers or {}).get(HDR_MSG_ID) == events[0].id and msg.data == events[0].to_bytes()
    async with pool.acquire() as conn:  # and the slot was advanced past them
        lag = await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), confirmed_flush_lsn)"
                                  " FROM pg_replication_slots WHERE slot_name = $1", slot_name(schema))
    assert lag is not None


@pytest.mark.parametrize("point", ["after_select", "after_publish"])
async def test_a_relay_killed_before_advancing_its_slot_sends_again_and_the_event_is_applied_once(
        point: str, wal_schema: tuple[str, asyncpg.Pool], wal_writes: None, nc: NATS,
        prepared: CommonSettings) -> None:
    schema, pool = wal_schema
    await create_effects(pool)
    event = video_created()
    async with pool.acquire() as conn:
        await change_with_events(conn, "SELECT 1", events=(event,))  # any statement carries its events
    await wal_flushed(pool)
    await run_crashing_relay(prepared, schema, point, "wal")  # read from the slot, then died at `point`
    js = nc.jetstream()
    before = (await stream_copies(js, "VIDEOS", "video.created.*", {event.id}))[event.id]
    assert before == (1 if point == "after_publish" else 0)
    async with relay_broker(prepared, TYPES) as publishers:
        relay = wal_relay(pool, publishers, schema, prepared)
        assert await caught_up(relay, prepared) == 1  # the slot was not confirmed past it: the event is read again
        assert await caught_up(relay, prepared) == 0  # and now it was
    assert (await stream_copies(js, "VIDEOS", "video.created.*", {event.id}))[event.id] == 1  # the copy absorbed
    name = unique("c")
    async with consuming(prepared, pool, spec(name, record_effect)):
        await wait_for(lambda: consumer_idle(js, "VIDEOS", name, started=True), SETTLE_S, "the consumer idle")
    assert (await effect_counts(pool, [event.id]))[event.id] == 1


async def test_one_relay_of_two_reads_the_slot_and_the_other_takes_over_when_it_stops(
        wal_schema: tuple[str, asyncpg.Pool], wal_writes: None, nc: NATS, prepared: CommonSettings) -> None:
    schema, pool = wal_schema
    js = nc.jetstream()

    async def write(n: int) -> set[str]:
        made = [video_created() for _ in range(n)]
        async with pool.acquire() as conn:
            for e in made:
                await change_with_events(conn, "SELECT 1", events=(e,))
        return {e.id for e in made}

    async def sent_once(ids: set[str]) -> None:
        copies = await wait_for(lambda: stream_copies(js, "VIDEOS", "video.created.*", ids), SETTLE_S,
                                "the events in the stream", until=lambda c: all(c.values()))
        assert set(copies.values()) == {1}, copies

    async with relay_broker(prepared, TYPES) as one, relay_broker(prepared, TYPES) as other:
        first, second = wal_relay(pool, one, schema, prepared), wal_relay(pool, other, schema, prepared)
        async with running(first) as stop_first, running(second) as stop_second:
            await wait_for(lambda: first.leading.is_set() or second.leading.is_set(), SETTLE_S, "a reader")
            leader, standby = (first, second) if first.leading.is_set() else (second, first)
            await sent_once(await write(30))
            assert not standby.leading.is_set()  # never both
            (stop_first if leader is first else stop_second).set()  # the reader's instance stops
            await wait_for(lambda: standby.leading.is_set(), SETTLE_S, "the standby reading the slot")
            await sent_once(await write(30))


async def test_rows_an_earlier_release_writes_to_the_outbox_table_go_out_beside_the_slot(
        wal_schema: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings) -> None:
    """During a rollout an instance of the release before writes outbox rows: the relay drains them too."""
    schema, pool = wal_schema
    row = video_created()
    async with pool.acquire() as conn:
        await change_with_events(conn, "SELECT 1", events=(row,))  # the table transport (this process's default)
    assert await outbox_rows(pool) == 1
    async with relay_broker(prepared, TYPES) as publishers, running(wal_relay(pool, publishers, schema, prepared)):
        await wait_for(lambda: stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {row.id}), SETTLE_S,
                       "the row's event in the stream", until=lambda c: c[row.id] == 1)


async def test_a_frame_of_a_later_release_is_skipped_and_what_follows_still_goes(
        wal_schema: tuple[str, asyncpg.Pool], wal_writes: None, nc: NATS, prepared: CommonSettings,
        caplog: pytest.LogCaptureFixture) -> None:
    schema, pool = wal_schema
    after = video_created()
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_logical_emit_message(true, $1, $2::bytea)", WAL_PREFIX + schema,
                           b"weir9\0something else")
        await change_with_events(conn, "SELECT 1", events=(after,))
    await wal_flushed(pool)
    async with relay_broker(prepared, TYPES) as publishers:
        relay = wal_relay(pool, publishers, schema, prepared)
        assert await caught_up(relay, prepared) == 1
        assert await caught_up(relay, prepared) == 0
    assert "cannot read" in caplog.text
    assert (await stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {after.id}))[after.id] == 1


async def test_the_slot_is_confirmed_past_wal_that_holds_no_event_of_its_schema(
        wal_schema: tuple[str, asyncpg.Pool], nc: NATS, prepared: CommonSettings) -> None:
    """Other tables' and schemas' writes send the relay nothing or nothing of its own: the slot moves past them
    all the same (else it would keep their WAL on disk)."""
    schema, pool = wal_schema
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE other (n int)")
        await conn.execute("INSERT INTO other SELECT generate_series(1, 1000)")
        await conn.execute("SELECT pg_logical_emit_message(true, 'weir.outbox.someone_else', 'x'::bytea)")
        await conn.execute("INSERT INTO other SELECT generate_series(1, 1000)")  # the last: sends nothing
    await wal_flushed(pool)
    async with pool.acquire() as conn:
        flushed = int(await conn.fetchval("SELECT pg_current_wal_flush_lsn() - '0/0'"))
    was = await confirmed_at(pool, schema)
    async with relay_broker(prepared, TYPES) as publishers:
        assert await caught_up(wal_relay(pool, publishers, schema, prepared), prepared) == 0
    now = await wait_for(lambda: confirmed_at(pool, schema), SETTLE_S, "the slot confirmed past the writes",
                         until=lambda at: at >= flushed)
    assert now > was


async def test_the_api_with_the_wal_transport_sends_a_created_videos_event(
        stack_env: dict[str, str], prepared: CommonSettings, nc: NATS, tmp_path: Path) -> None:
    """Two api instances at WEIR_OUTBOX_TRANSPORT=wal (as a deployment sets it): the video's event goes out once,
    read by whichever instance holds the slot, and never as a row of the outbox table."""
    try:
        with run_services(stack_env, tmp_path, names=("auth", "api", "api"), outbox_transport="wal") as services:
            account = await create_account_with_app(nc, "wal")
            client = Client(services, account[1].secret_key, fresh_address())
            try:
                video = await create(client)
            finally:
                await client.http.aclose()
            copies = await wait_for(
                lambda: stream_messages_of(nc, video["id"]), SETTLE_S, "video.created in the stream",
                until=lambda found: "video.created" in found)
            assert copies.count("video.created") == 1, copies
            conn = await asyncpg.connect(prepared.database_url)
            try:
                in_table = await conn.fetchval(  # rows of earlier tests stay there, sent, until pruned
                    f"SELECT count(*) FROM {API}.outbox WHERE position(convert_to($1, 'UTF8') IN payload) > 0",
                    video["id"])
                assert in_table == 0
                assert await conn.fetchval("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
                                           slot_name(API)) == 1
            finally:
                await conn.close()
    finally:
        conn = await asyncpg.connect(prepared.database_url)
        try:  # the suite's other api runs use the table: the slot would keep WAL for nothing
            await drop_slot(conn, API)
        finally:
            await conn.close()


async def stream_messages_of(nc: NATS, video_id: str) -> list[str]:
    """The types of the VIDEOS stream's events about `video_id`."""
    return [env.type for _, env in await stored_events(nc.jetstream(), "VIDEOS", "video.>") if env.subject == video_id]


async def test_a_running_relay_confirms_its_slot_as_events_go_out(
        wal_schema: tuple[str, asyncpg.Pool], wal_writes: None, nc: NATS, prepared: CommonSettings) -> None:
    """While it runs (not only when it stops): a crash then sends again only what went out in the last status
    interval, and the slot keeps no more WAL than that."""
    schema, pool = wal_schema
    made = [video_created() for _ in range(20)]
    async with relay_broker(prepared, TYPES) as publishers:
        relay = wal_relay(pool, publishers, schema, prepared)
        async with running(relay):
            await wait_for(lambda: relay.leading.is_set(), SETTLE_S, "the relay reading")
            async with pool.acquire() as conn:
                for e in made:
                    await change_with_events(conn, "SELECT 1", events=(e,))
                written = int(await conn.fetchval("SELECT pg_current_wal_insert_lsn() - '0/0'"))
            await wait_for(lambda: stream_copies(nc.jetstream(), "VIDEOS", "video.created.*", {e.id for e in made}),
                           SETTLE_S, "the events in the stream", until=lambda c: all(c.values()))
            await wait_for(lambda: confirmed_at(pool, schema), SETTLE_S, "the slot confirmed past them",
                           until=lambda at: at >= written)
