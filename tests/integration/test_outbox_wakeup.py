"""When a commit wakes the relay (shared/migrations/004_outbox_relays.sql, shared/outbox.py), on real PostgreSQL and
JetStream: a writer notifies only while no relay says it is awake or one sleeps (a notifying commit takes the
notification queue's database-wide lock), and no row is left to the poll when a writer that read "awake" commits
while the relay goes to sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from shared.db import quote_ident
from shared.outbox import OutboxRelay, change_with_events, enqueue
from shared.settings import CommonSettings
from tests.integration.bushelpers import relay_broker, video_created
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

POLL_S = 30.0  # the relays' poll here: a row found before it was found without it
FOUND_WITHIN_S = 5.0


Write = Callable[[asyncpg.Connection], Awaitable[None]]


async def this_release(conn: asyncpg.Connection) -> None:
    async with conn.transaction():
        await enqueue(conn, video_created())


async def one_statement(conn: asyncpg.Connection) -> None:
    ev = video_created()
    await change_with_events(conn, "UPDATE outbox_relays SET seen = seen WHERE false", events=(ev,))


async def an_earlier_release(conn: asyncpg.Connection) -> None:
    """An outbox row as a writer of a release before 004 wrote it: a bare INSERT (the table's trigger decides)."""
    ev = video_created()
    await conn.execute("INSERT INTO outbox (id, subject, payload) VALUES ($1, $2, $3)", ev.id, ev.type, ev.to_bytes())


WRITERS = {"enqueue": this_release, "change_with_events": one_statement, "an earlier release": an_earlier_release}


async def notified_by(settings: CommonSettings, schema: str, pool: asyncpg.Pool, write: Write) -> bool:
    """Whether one writer's commit of an outbox row sent the relay's NOTIFY (a listener of the schema's channel)."""
    got = asyncio.Event()
    listener = await asyncpg.connect(settings.database_url)
    try:
        await listener.add_listener(f"weir_outbox_{schema}", lambda *_: got.set())
        async with pool.acquire() as conn:
            await write(conn)
        try:
            await asyncio.wait_for(got.wait(), 1.0)
        except TimeoutError:
            return False
        return True
    finally:
        await listener.close()


@pytest.mark.parametrize("writer", WRITERS)
async def test_a_writer_notifies_only_while_no_relay_is_awake_or_one_sleeps(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings, writer: str
) -> None:
    schema, pool = schema_pool
    relays = f"{quote_ident(schema)}.outbox_relays"

    async def notified() -> bool:
        return await notified_by(prepared, schema, pool, WRITERS[writer])

    async with pool.acquire() as conn:
        await conn.execute(f"DELETE FROM {relays}")
        assert await notified()  # no relay says anything: one of an older release may run
        await conn.execute(f"INSERT INTO {relays} (relay, sleeping) VALUES ('a', false)")
        assert not await notified()  # an awake relay looks again without being told
        await conn.execute(f"UPDATE {relays} SET seen = now() - interval '31 seconds'")
        assert await notified()  # it has not said so for too long: it may be gone
        await conn.execute(f"UPDATE {relays} SET seen = now()")
        await conn.execute(f"INSERT INTO {relays} (relay, sleeping) VALUES ('b', true)")
        assert await notified()  # another one sleeps


class PauseFirstDrain:
    """Holds the relay's first drain after its select, until `go` is set."""

    def __init__(self) -> None:
        self.selected = asyncio.Event()
        self.go = asyncio.Event()

    async def after_select(self, ids: list[str]) -> None:
        if not self.selected.is_set():
            self.selected.set()
            await self.go.wait()

    async def after_publish(self, ids: list[str]) -> None:
        return None


async def sent(pool: asyncpg.Pool, event_id: str) -> bool:
    async with pool.acquire() as conn:
        return bool(await conn.fetchval("SELECT sent_at IS NOT NULL FROM outbox WHERE id = $1", event_id))


async def test_a_row_committed_while_the_relay_goes_to_sleep_is_published_without_the_poll(
    schema_pool: tuple[str, asyncpg.Pool], prepared: CommonSettings
) -> None:
    """The race the relay's SHARE lock on the outbox closes: a writer reads "awake" (so it will not notify) while the
    relay works, and commits only after the relay found nothing more and went to sleep. With a poll of 30 s, the row
    must go at once."""
    schema, pool = schema_pool
    first, late = video_created(), video_created()
    async with pool.acquire() as conn, conn.transaction():
        await enqueue(conn, first)
    pause = PauseFirstDrain()
    stop = asyncio.Event()
    async with relay_broker(prepared, ["video.created"]) as publishers:
        relay = OutboxRelay(pool=pool, publishers=publishers, dsn=prepared.database_url, schema=schema,
                            poll_seconds=POLL_S, hooks=pause)
        task = asyncio.create_task(relay.run(stop))
        try:
            await asyncio.wait_for(pause.selected.wait(), 10)  # the relay is awake, busy with the first row
            got = asyncio.Event()
            listener = await asyncpg.connect(prepared.database_url)
            await listener.add_listener(f"weir_outbox_{schema}", lambda *_: got.set())
            writer = await pool.acquire()
            tx = writer.transaction()
            await tx.start()
            await enqueue(writer, late)  # reads "awake": this commit will not notify; holds ROW EXCLUSIVE
            pause.go.set()
            await wait_for(lambda: sent(pool, first.id), 10, "the first row published")
            await asyncio.sleep(0.3)  # the relay found nothing more meanwhile and tries to sleep
            assert not await sent(pool, late.id)
            await tx.commit()
            committed = time.monotonic()
            await pool.release(writer)
            await wait_for(lambda: sent(pool, late.id), FOUND_WITHIN_S, "the late row published without the poll")
            took = time.monotonic() - committed
            assert not got.is_set(), "the writer notified: the race was not the one meant"
            await listener.close()
            print(f"\nthe late row published {took * 1000:.0f} ms after its commit (poll {POLL_S:g} s)")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    async with pool.acquire() as conn:  # a relay that stops takes its row with it
        assert await conn.fetchval("SELECT count(*) FROM outbox_relays") == 0
