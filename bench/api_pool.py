"""The api on a pool as asyncpg makes it by default in one respect, to measure what `shared.db.create_pool` changes
(bench/api.py --pool); never a way to run Weir. WEIR_BENCH_POOL=reset sends asyncpg's reset query on every release;
WEIR_BENCH_POOL=queue uses asyncpg's own queue of connections (a late asker may take one ahead of the one woken
for it) instead of FairPool's first come, first served.
    python -m bench.api_pool   (the same WEIR_* settings as python -m services.api, and WEIR_BENCH_POOL)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import asyncpg

from services.api.app import SERVICE
from shared import db
from shared.runtime import main


async def asyncpg_reset(_pool: Any, conn: asyncpg.Connection) -> None:
    await conn.execute(conn.get_reset_query())


async def pool_as_asyncpg(dsn: str, *, schema: str, max_size: int = 10, min_size: int = 1,
                          planner: Mapping[str, str] | None = None) -> asyncpg.Pool:
    kind = os.environ["WEIR_BENCH_POOL"]
    settings = {"search_path": f"{db.quote_ident(schema)}, public", "application_name": f"weir-{schema}",
                **(planner or {})}
    if kind == "queue":
        pool: asyncpg.Pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size,
                                                       server_settings=settings, reset=db._nothing_to_reset)
        return pool
    if kind == "reset":
        pool = await original(dsn, schema=schema, max_size=max_size, min_size=min_size, planner=planner)
        pool._reset = lambda conn: asyncpg_reset(pool, conn)
        return pool
    raise SystemExit(f"WEIR_BENCH_POOL must be reset or queue, not {kind!r}")


original = db.create_pool

if __name__ == "__main__":
    db.create_pool = pool_as_asyncpg
    main(SERVICE)
