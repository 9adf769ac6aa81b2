"""The asyncpg pool and the migration runner.

Each service owns one PostgreSQL schema. Its migrations are numbered `.sql` files in
`services/<name>/migrations/`, run with `search_path` set to that schema, after the bus's own
migrations (outbox and inbox, `shared/migrations/`), which every schema gets.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Generator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

BUS_MIGRATIONS = Path(__file__).parent / "migrations"
SERVICES_DIR = Path(__file__).parent.parent / "services"

# service -> its schema; api and sweep are two processes of one domain (videos): the sweep reads the
# video table under row locks, and keeps only its ledger in a schema of its own.
SCHEMAS: dict[str, str] = {
    "auth": "auth",
    "api": "videos",
    "sweep": "sweep",
    "encode": "encode",
    "media": "media",
    "webhooks": "webhooks",
}

_MIGRATION_NAME = re.compile(r"^(\d{3,})_[a-z0-9_]+\.sql$")
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class Migration:
    source: str  # "bus" or the service name
    version: int
    name: str
    sql: str


def _read(directory: Path, source: str) -> list[Migration]:
    found: list[Migration] = []
    if not directory.is_dir():
        return found
    for path in sorted(directory.iterdir()):
        m = _MIGRATION_NAME.match(path.name)
        if m:
            found.append(Migration(source, int(m.group(1)), path.stem, path.read_text()))
    versions = [mig.version for mig in found]
    if len(versions) != len(set(versions)):
        raise ValueError(f"duplicate migration numbers in {directory}")
    return found


def migrations_for(service: str) -> list[Migration]:
    return _read(BUS_MIGRATIONS, "bus") + _read(SERVICES_DIR / service / "migrations", service)


def quote_ident(name: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"not a plain identifier: {name!r}")
    return f'"{name}"'


async def migrate(conn: asyncpg.Connection, service: str, *, schema: str | None = None) -> list[str]:
    """Apply the service's pending migrations; safe to run from several processes at once.

    `schema` overrides the service's own (tests give each case a fresh schema).
    """
    schema = schema or SCHEMAS[service]
    q = quote_ident(schema)
    applied_now: list[str] = []
    async with conn.transaction():
        # one migrator per schema at a time; the others wait, then find nothing to do
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"weir-migrate-{schema}")
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {q}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {q}.schema_migrations ("
            " source text NOT NULL, version int NOT NULL, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (source, version))"
        )
        done = {
            (r["source"], r["version"])
            for r in await conn.fetch(f"SELECT source, version FROM {q}.schema_migrations")
        }
        await conn.execute(f"SET LOCAL search_path TO {q}, public")
        for mig in migrations_for(service):
            if (mig.source, mig.version) in done:
                continue
            await conn.execute(mig.sql)
            await conn.execute(
                f"INSERT INTO {q}.schema_migrations (source, version, name) VALUES ($1, $2, $3)",
                mig.source,
                mig.version,
                mig.name,
            )
            applied_now.append(f"{schema}: {mig.source}/{mig.name}")
    return applied_now


async def create_pool(dsn: str, *, schema: str, max_size: int = 10, min_size: int = 1,
                      planner: Mapping[str, str] | None = None) -> asyncpg.Pool:
    """A pool whose connections resolve unqualified names in the service's own schema.

    Connections go back without asyncpg's reset query (a round trip per release): pooled work keeps no session state
    beyond its transactions (asyncpg still rolls back one left open); work that does takes `session`, which resets.
    `planner`: PostgreSQL planner settings for every connection of the pool (e.g. `enable_seqscan`), for a loop whose
    few queries are written for one plan (services/webhooks/delivering.py says why)."""
    pool = FairPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        max_queries=50_000,  # asyncpg's defaults for these three
        max_inactive_connection_lifetime=300.0,
        loop=None,
        connection_class=asyncpg.Connection,
        record_class=asyncpg.Record,
        server_settings={"search_path": f"{quote_ident(schema)}, public", "application_name": f"weir-{schema}",
                         **(planner or {})},
        reset=_nothing_to_reset,
    )
    await pool
    return pool


class FairPool(asyncpg.Pool):  # type: ignore[misc]
    """asyncpg's pool, handing connections out in the order they were asked for.

    asyncpg's own queue lets a task that asks just as a connection comes back take it ahead of the one woken for it
    (a long tail under load). Here `acquire` first takes a turn from a first-come-first-served semaphore with as many
    permits as connections; `release` gives it back, so a task past it always finds a connection free."""

    def __init__(self, *args: Any, max_size: int, **kwargs: Any) -> None:
        super().__init__(*args, max_size=max_size, **kwargs)
        self._turns = asyncio.Semaphore(max_size)
        self._lent: set[int] = set()  # the connections handed out (by id) whose turn is not yet given back

    def acquire(self, *, timeout: float | None = None) -> _FairAcquire:
        return _FairAcquire(self, timeout)

    async def acquire_in_turn(self, timeout: float | None) -> Any:
        async with asyncio.timeout(timeout):  # the wait for a turn counts in acquire's timeout
            await self._turns.acquire()
        try:
            connection = await super().acquire(timeout=timeout)
        except BaseException:
            self._turns.release()
            raise
        self._lent.add(id(connection))
        return connection

    async def release(self, connection: Any, *, timeout: float | None = None) -> None:
        try:
            await super().release(connection, timeout=timeout)
        finally:
            if id(connection) in self._lent:  # a second release of the same connection gives nothing back
                self._lent.discard(id(connection))
                self._turns.release()


class _FairAcquire:
    """What `FairPool.acquire()` returns: awaited, or used with `async with` (as asyncpg's own)."""

    def __init__(self, pool: FairPool, timeout: float | None) -> None:
        self.pool = pool
        self.timeout = timeout
        self.connection: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self.pool.acquire_in_turn(self.timeout).__await__()

    async def __aenter__(self) -> Any:
        self.connection = await self.pool.acquire_in_turn(self.timeout)
        return self.connection

    async def __aexit__(self, *_: object) -> None:
        connection, self.connection = self.connection, None
        await self.pool.release(connection)


async def _nothing_to_reset(_conn: asyncpg.Connection) -> None:
    """The pool's reset of a released connection: nothing beyond what asyncpg does itself (an open transaction
    rolled back, listeners removed). Connections that keep session state come from `session`."""


@asynccontextmanager
async def session(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """A pooled connection for work that keeps session state beyond a transaction (a session advisory lock held
    across calls to storage, a sweep run's lock). It goes back reset with asyncpg's reset query, or is closed when
    that cannot be done (cancelled, connection lost): the server then ends the session and frees its locks, so no
    lock outlives its work on a connection the pool hands to someone else."""
    async with pool.acquire() as conn:
        try:
            yield conn
        finally:
            try:
                await conn.execute(conn.get_reset_query())
            except BaseException:
                conn.terminate()
                raise


# The database away: refused, shutting down or starting, or a connection lost in the middle of work (asyncpg then says
# so as an InterfaceError or an InternalClientError on the lost connection). Such a failure says nothing about the
# work itself: a request answers 503, a consumer's delivery is retried until the database is back, never parked.
DATABASE_AWAY: tuple[type[Exception], ...] = (
    ConnectionError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError,
)


def database_away(exc: BaseException) -> bool:
    """The failure is the database (or the way to it) being away, not the work: worth waiting out."""
    if isinstance(exc, DATABASE_AWAY):
        return True
    # asyncpg's connect reports every address it tried as one plain OSError ("Multiple exceptions: ...")
    return type(exc) is OSError
