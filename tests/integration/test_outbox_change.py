"""A state change and its events in one SQL statement (`change_with_events`, shared/outbox.py), on real PostgreSQL:
both written or neither, outside a transaction too, the change's RETURNING rows handed back, rows the relay reads
exactly as `enqueue` writes them."""

from __future__ import annotations

import asyncpg
import pytest

from shared.db import quote_ident
from shared.outbox import bus_subject, change_with_events, enqueue
from tests.integration.bushelpers import video_created

pytestmark = pytest.mark.asyncio(loop_scope="session")

OUTBOX_ROW = "SELECT id::text, subject, payload, traceparent, bus_subject FROM outbox WHERE id = $1"


@pytest.fixture
async def state(schema_pool: tuple[str, asyncpg.Pool]) -> asyncpg.Pool:
    """The schema's pool, with a state table to change (a unique name, so a change can fail on it)."""
    schema, pool = schema_pool
    async with pool.acquire() as conn:
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {quote_ident(schema)}.state"
                           " (id uuid PRIMARY KEY, name text UNIQUE, n int NOT NULL DEFAULT 0)")
    return pool


async def test_the_change_and_its_event_together_with_its_returning_rows(state: asyncpg.Pool) -> None:
    ev = video_created()
    async with state.acquire() as conn:
        rows = await change_with_events(conn, "INSERT INTO state (id, name) VALUES ($1, $2) RETURNING id::text, name",
                                        ev.subject, "a", events=(ev,))
        assert [tuple(r) for r in rows] == [(ev.subject, "a")]
        stored = await conn.fetchrow(OUTBOX_ROW, ev.id)
    assert stored is not None
    assert bytes(stored["payload"]) == ev.to_bytes() and stored["subject"] == ev.type


async def test_written_as_enqueue_writes_them(state: asyncpg.Pool) -> None:
    """The same event through either path: the same outbox row (id, type, payload, traceparent, bus subject)."""
    one, other = video_created(), video_created()
    async with state.acquire() as conn:
        async with conn.transaction():
            await conn.execute("INSERT INTO state (id) VALUES ($1)", one.subject)
            await enqueue(conn, one)
        await change_with_events(conn, "INSERT INTO state (id) VALUES ($1)", other.subject, events=(other,))
        a, b = await conn.fetchrow(OUTBOX_ROW, one.id), await conn.fetchrow(OUTBOX_ROW, other.id)
    assert a is not None and b is not None
    for row, ev in ((a, one), (b, other)):
        assert (row["subject"], bytes(row["payload"]), row["traceparent"], row["bus_subject"]) == (
            ev.type, ev.to_bytes(), ev.traceparent, bus_subject(ev))


async def test_several_events_and_a_change_without_returning(state: asyncpg.Pool) -> None:
    first, second = video_created(), video_created()
    async with state.acquire() as conn:
        await conn.execute("INSERT INTO state (id, name) VALUES ($1, 'several')", first.subject)
        rows = await change_with_events(conn, "UPDATE state SET n = n + 1 WHERE name = $1", "several",
                                        events=(first, second))
        assert rows == []
        assert await conn.fetchval("SELECT n FROM state WHERE name = 'several'") == 1
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE id = ANY($1::uuid[])",
                                   [first.id, second.id]) == 2


async def test_neither_is_written_when_either_fails(state: asyncpg.Pool) -> None:
    """Outside a transaction: a change that fails leaves no event; an event that cannot be written (its id taken)
    leaves no change."""
    taken = video_created()
    async with state.acquire() as conn:
        await change_with_events(conn, "INSERT INTO state (id, name) VALUES ($1, 'first')", taken.subject,
                                 events=(taken,))
        refused = video_created()
        with pytest.raises(asyncpg.UniqueViolationError):  # the name is taken: the change fails
            await change_with_events(conn, "INSERT INTO state (id, name) VALUES ($1, 'first')", refused.subject,
                                     events=(refused,))
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE id = $1", refused.id) == 0
        again = video_created().model_copy(update={"id": taken.id})
        with pytest.raises(asyncpg.UniqueViolationError):  # the event's id is taken: the event fails
            await change_with_events(conn, "INSERT INTO state (id, name) VALUES ($1, 'second')", again.subject,
                                     events=(again,))
        assert await conn.fetchval("SELECT count(*) FROM state WHERE name = 'second'") == 0
