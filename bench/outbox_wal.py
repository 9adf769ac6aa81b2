"""What a write's event costs the writer as an outbox row against as a message in the WAL (issue 34's next step).

    python -m bench.outbox_wal [--rounds 5] [--writes 4000]

One process, 8 connections, single-statement writes, rounds alternating in order: the write alone (a state row),
the write with its event as an outbox row (`change_with_events`, a relay marked awake so no NOTIFY), and the write
with its event emitted as a logical-decoding message (`pg_logical_emit_message`, transactional) in the same statement.
Run at wal_level replica and logical (PostgreSQL restarted between), each twice. Only the writers' side: a relay
reading the messages (a replication slot) is not built; see bench/RESULTS.md for what that design would have to keep.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import asyncpg

from bench.bus import _event, _setup, servers_and_stack
from shared import db
from shared.outbox import change_with_events
from shared.settings import CommonSettings

CONNECTIONS = 8
MODES = ("plain", "outbox", "wal")


async def _writes(pool: asyncpg.Pool, mode: str, n: int) -> float:
    """n writes of `mode` by CONNECTIONS writers side by side; returns writes per second."""
    remaining = n

    async def writer() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            ev = _event()
            async with pool.acquire() as c:
                if mode == "plain":
                    await c.execute("INSERT INTO state (id) VALUES ($1)", ev.subject)
                elif mode == "outbox":
                    await change_with_events(c, "INSERT INTO state (id) VALUES ($1)", ev.subject, events=(ev,))
                else:
                    await c.execute("WITH change AS (INSERT INTO state (id) VALUES ($1)) "
                                    "SELECT pg_logical_emit_message(true, 'weir_outbox', $2::bytea)",
                                    ev.subject, ev.model_dump_json().encode())

    t0 = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(CONNECTIONS)))
    return n / (time.perf_counter() - t0)


async def _round_robin(settings: CommonSettings, rounds: int, n: int) -> dict[str, float]:
    schema, _ = await _setup(settings)
    pool = await db.create_pool(settings.database_url, schema=schema, max_size=CONNECTIONS)
    try:
        async with pool.acquire() as c:  # a relay awake: writers skip NOTIFY, as under load
            await c.execute("INSERT INTO outbox_relays (relay, sleeping) VALUES ('bench', false)")
        for mode in MODES:  # warm up
            await _writes(pool, mode, n // 8)
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                rates[mode].append(await _writes(pool, mode, n))
                async with pool.acquire() as c:
                    await c.execute("UPDATE outbox_relays SET seen = now()")
        return {m: statistics.median(v) for m, v in rates.items()}
    finally:
        await pool.close()


async def _wal_level(settings: CommonSettings, level: str) -> None:
    c = await asyncpg.connect(settings.database_url)
    try:
        await c.execute(f"ALTER SYSTEM SET wal_level = {level}")
    finally:
        await c.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--writes", type=int, default=4000)
    args = parser.parse_args()
    with servers_and_stack() as (settings, stack):
        if stack is None:
            raise SystemExit("needs the embedded servers (it restarts PostgreSQL to change wal_level)")
        print(f"{'wal_level':<10} {'plain/s':>9} {'outbox/s':>9} {'wal/s':>9} {'outbox/plain':>13} {'wal/plain':>10}")
        for level in ("replica", "logical", "replica", "logical"):
            asyncio.run(_wal_level(settings, level))
            stack.stop_server("postgres")
            stack.start_server("postgres")
            m = asyncio.run(_round_robin(settings, args.rounds, args.writes))
            print(f"{level:<10} {m['plain']:>9.0f} {m['outbox']:>9.0f} {m['wal']:>9.0f} "
                  f"{m['outbox'] / m['plain']:>13.3f} {m['wal'] / m['plain']:>10.3f}")


if __name__ == "__main__":
    main()
