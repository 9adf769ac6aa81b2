"""The pools of `shared.db` on the real PostgreSQL: no reset query when a connection goes back, and `db.session`
for the work that keeps session state (a session advisory lock), which never outlives that work."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest

from shared import db
from shared.settings import CommonSettings
from tests.conftest import fresh_schema

LOCK = 424242  # an advisory lock key no service uses


async def _lock_is_free(database_url: str) -> bool:
    """Whether another session can take the lock now (and it lets it go again)."""
    other = await asyncpg.connect(database_url)
    try:
        taken: bool = await other.fetchval("SELECT pg_try_advisory_lock($1)", LOCK)
        if taken:
            await other.execute("SELECT pg_advisory_unlock($1)", LOCK)
        return taken
    finally:
        await other.close()


async def test_a_connection_goes_back_without_a_query_and_a_transaction_left_open_is_rolled_back(
    prepared: CommonSettings,
) -> None:
    async with fresh_schema(prepared.database_url, "bustest", max_size=1) as (_, pool):
        sent: list[str] = []
        async with pool.acquire() as conn:
            conn.add_query_logger(lambda record: sent.append(record.query))
            await conn.execute("CREATE TABLE t (n int)")
            backend = await conn.fetchval("SELECT pg_backend_pid()")
        assert sent == ["CREATE TABLE t (n int)", "SELECT pg_backend_pid()"]  # nothing on release
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == backend  # the same connection, reused
            tx = conn.transaction()
            await tx.start()
            await conn.execute("INSERT INTO t VALUES (1)")  # released with the transaction open
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM t") == 0
            assert not conn.is_in_transaction()


async def test_a_session_lock_taken_through_session_is_gone_when_the_connection_goes_back(
    prepared: CommonSettings,
) -> None:
    async with fresh_schema(prepared.database_url, "bustest", max_size=1) as (_, pool):
        async with db.session(pool) as conn:
            await conn.execute("SELECT pg_advisory_lock($1)", LOCK)
            assert not await _lock_is_free(prepared.database_url)
        # left locked on purpose (no unlock): the session's reset frees it
        assert await _lock_is_free(prepared.database_url)
        async with pool.acquire() as conn:  # the connection is back in the pool and works
            assert await conn.fetchval("SELECT 1") == 1


async def test_work_cancelled_while_it_holds_a_session_lock_closes_its_connection_and_frees_the_lock(
    prepared: CommonSettings,
) -> None:
    async with fresh_schema(prepared.database_url, "bustest", max_size=1) as (_, pool):
        holding = asyncio.Event()

        async def work() -> None:
            async with db.session(pool) as conn:
                await conn.execute("SELECT pg_advisory_lock($1)", LOCK)
                holding.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(work())
        await asyncio.wait_for(holding.wait(), 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(100):  # the server frees the lock once it sees the connection end
            if await _lock_is_free(prepared.database_url):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the lock outlived the cancelled work")
        async with pool.acquire() as conn:  # the pool makes a new connection
            assert await conn.fetchval("SELECT 1") == 1


async def test_connections_go_to_their_askers_in_the_order_they_asked(prepared: CommonSettings) -> None:
    """One connection, three tasks waiting for it in order, and a fourth that asks just as it comes back (the moment
    asyncpg's own queue lets a late asker take it ahead of the waiting ones): they get it in the order they asked."""
    async with fresh_schema(prepared.database_url, "bustest", max_size=1) as (_, pool):
        order: list[str] = []

        async def use(name: str) -> None:
            async with pool.acquire() as conn:
                order.append(name)
                await conn.fetchval("SELECT 1")

        holder = await pool.acquire()
        waiting = [asyncio.create_task(use(name)) for name in ("first", "second", "third")]
        for _ in range(5):  # each is waiting now
            await asyncio.sleep(0)
        release = asyncio.create_task(pool.release(holder))
        await asyncio.sleep(0)  # asyncpg's release runs in a task of its own (asyncio.shield), in the next turn...
        late = asyncio.create_task(use("late"))  # ...and this one right after it, before the woken waiter runs
        # (asyncpg's own queue gives this one the connection, and sends "first" to the back of the line)
        await asyncio.wait_for(asyncio.gather(release, late, *waiting), 10)
        assert order == ["first", "second", "third", "late"]


async def test_an_asker_that_gives_up_or_is_cancelled_leaves_no_turn_behind(prepared: CommonSettings) -> None:
    async with fresh_schema(prepared.database_url, "bustest", max_size=1) as (_, pool):
        holder = await pool.acquire()
        with pytest.raises(TimeoutError):
            await pool.acquire(timeout=0.2)  # the wait for a turn counts in the timeout
        cancelled = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.05)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        await pool.release(holder)
        await pool.release(holder)  # a second release of the same connection gives no second turn back
        first = await asyncio.wait_for(pool.acquire(), 5)
        with pytest.raises(TimeoutError):
            await pool.acquire(timeout=0.2)  # still one connection, one turn
        await pool.release(first)
        async with pool.acquire(timeout=5) as conn:
            assert await conn.fetchval("SELECT 1") == 1
