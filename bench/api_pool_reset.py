"""The api with asyncpg's own pool reset (a `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;` sent
on every connection's release) instead of `shared.db.create_pool`'s none: what leaving it out buys, measured by
bench/api.py --pool-reset in the same rounds. Never a way to run Weir.

python -m bench.api_pool_reset   (the same WEIR_* settings as python -m services.api)
"""

from __future__ import annotations

import asyncpg

from services.api.app import SERVICE
from shared import db
from shared.runtime import main


async def pool_with_reset(dsn: str, *, schema: str, max_size: int = 10, min_size: int = 1) -> asyncpg.Pool:
    pool: asyncpg.Pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size,
        server_settings={"search_path": f"{db.quote_ident(schema)}, public", "application_name": f"weir-{schema}"},
    )
    return pool


if __name__ == "__main__":
    db.create_pool = pool_with_reset
    main(SERVICE)
