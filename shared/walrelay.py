"""The `wal` outbox transport's relay (CommonSettings.outbox_transport): writers emit each event as a transactional
WAL message (shared/outbox.py `wal_frame`) in the statement of their change, and one relay per schema reads them,
in commit order, from a logical replication slot of its own (`pgoutput` with `messages`).

- **One reader**: a slot serves one session at a time, so the relays of a service's instances take a session
  advisory lock first; the others wait as standbys and one takes over when the reader's connection goes.
- **Nothing lost**: the relay publishes a batch (`Nats-Msg-Id` the event id) and only then advances the slot, to the
  end of the last transaction JetStream acknowledged whole; what a crash leaves unadvanced is read and sent again,
  and JetStream's de-duplication window and the consumers' inboxes absorb the copy (SPEC 7).
- **Order per entity**: the slot yields transactions in commit order, and a batch goes out in that order.
- The SQL functions are used (peek, then advance), not the replication protocol, which asyncpg does not speak: each
  peek decodes from the slot's restart point, so the relay advances often, and it polls (no NOTIFY from writers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from nats.js.api import PubAck

from shared.bus import wait_any
from shared.outbox import WAL_PREFIX, OutboxRelay, RelayHooks, read_wal_frame

log = logging.getLogger("weir.bus")

FINAL_DRAIN_SECONDS = 2.0  # a stopping relay's last read of its slot, at most
PUBLICATION = "weir_outbox"  # pgoutput needs one; it lists no table (the events come as messages, not changes)
# the WAL flushed now, and what the slot holds up to it (one round trip)
_PEEK = ("SELECT f.lsn, ARRAY(SELECT data FROM pg_logical_slot_peek_binary_changes($1, f.lsn, $2,"
         f" 'proto_version', '1', 'publication_names', '{PUBLICATION}', 'messages', 'true'))"
         " FROM (SELECT pg_current_wal_flush_lsn() AS lsn) f")
# A peek decodes from the slot's restart point, which moves only past a snapshot of running transactions in the WAL,
# logged every 15 s by default: a busy database's peeks would decode up to 15 s of WAL again each time. The relay
# logs one this often after advancing (pg_log_standby_snapshot, PostgreSQL 16), so that its restart point follows.
SNAPSHOT_EVERY_SECONDS = 0.1


def slot_name(schema: str) -> str:
    return f"weir_outbox_{schema}"


def _lock_key(schema: str) -> tuple[str, str]:
    return "weir-wal-relay", schema


@dataclass(frozen=True)
class Committed:
    """One transaction read from the slot: where it ends (the slot advances past it once it is sent) and its events
    for this schema, as outbox rows' columns, in the order they were written."""

    end_lsn: int
    events: tuple[dict[str, Any], ...]


def parse(messages: list[bytes], prefix: str) -> tuple[list[Committed], int]:
    """pgoutput's protocol messages (version 1) as whole transactions, keeping the WAL messages whose prefix is
    `prefix`; also how many messages of that prefix could not be read (a later release's frame). A transaction
    not ended in `messages` (the peek's count ended inside it) is left for the next peek."""
    done: list[Committed] = []
    current: list[dict[str, Any]] = []
    unreadable = 0
    for data in messages:
        kind = data[:1]
        if kind == b"B":
            current = []
        elif kind == b"M":
            # Int8 flags, Int64 LSN, String prefix, Int32 length, Byte[n] content
            end = data.index(b"\0", 10)
            if data[10:end].decode() != prefix:
                continue
            (length,) = struct.unpack_from(">i", data, end + 1)
            row = read_wal_frame(data[end + 5:end + 5 + length])
            if row is None:
                unreadable += 1
            else:
                current.append(row)
        elif kind == b"C":  # Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 time
            (end_lsn,) = struct.unpack_from(">q", data, 10)
            done.append(Committed(end_lsn, tuple(current)))
            current = []
    return done, unreadable


async def ensure_slot(conn: asyncpg.Connection, schema: str) -> bool:
    """The schema's slot (and the publication), made if missing; True when made now. Called before the first write
    with the `wal` transport: a message written before its slot exists is never read."""
    level = await conn.fetchval("SHOW wal_level")
    if level != "logical":
        raise RuntimeError(f"WEIR_OUTBOX_TRANSPORT=wal needs PostgreSQL at wal_level=logical (it runs at {level})")
    with contextlib.suppress(asyncpg.DuplicateObjectError):
        await conn.execute(f"CREATE PUBLICATION {PUBLICATION}")
    try:
        await conn.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot_name(schema))
    except asyncpg.DuplicateObjectError:
        return False
    return True


async def drop_slot(conn: asyncpg.Connection, schema: str) -> None:
    """The schema's slot removed (a slot nobody reads keeps WAL on disk): for a schema that goes."""
    await conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                       slot_name(schema))


@dataclass
class WalRelay:
    """Reads the schema's slot and publishes through `table`'s publishers (its spans, legacy copies and metrics),
    while `table` goes on draining the outbox table beside it (rows of writers of an earlier release)."""

    dsn: str
    schema: str
    table: OutboxRelay
    batch_size: int = 500
    recheck_seconds: float = 0.005  # found events: look again after this long (the next ones gather meanwhile)
    idle_poll_seconds: float = 0.02  # found nothing: look again after this long
    standby_seconds: float = 1.0  # another relay reads the slot: try to take over this often
    hooks: RelayHooks | None = None
    leading: asyncio.Event = field(default_factory=asyncio.Event)  # set while this relay reads the slot
    read_any: bool = False  # the last peek read something (this schema's or not): look again soon
    published: int = 0  # events this relay published and advanced past
    _unreadable: int = 0
    _advanced: int | None = None  # where this relay last advanced the slot to
    _snapshot_at: float = 0.0  # when it last logged a snapshot (monotonic)
    _snapshots: bool = True  # the server lets it

    @property
    def slot(self) -> str:
        return slot_name(self.schema)

    async def run(self, stop: asyncio.Event) -> None:
        """Publish the slot's events and the table's rows until `stop` is set."""
        table = asyncio.create_task(self.table.run(stop), name="outbox-relay-table")
        try:
            while not stop.is_set():
                try:
                    await self._lead(stop)
                except Exception as exc:  # the database or the bus away: the slot keeps what was not advanced
                    log.warning("outbox wal relay (%s): %s", self.schema, exc)
                    await wait_any(stop, None, self.standby_seconds)
        finally:
            self.leading.clear()
            await table

    async def _lead(self, stop: asyncio.Event) -> None:
        conn: asyncpg.Connection = await asyncpg.connect(self.dsn)
        try:
            while not stop.is_set():
                if await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1), hashtext($2))",
                                       *_lock_key(self.schema)):
                    break
                await wait_any(stop, None, self.standby_seconds)
            else:
                return
            self.leading.set()
            while not stop.is_set():
                await self.drain_once(conn)
                await wait_any(stop, None, self.recheck_seconds if self.read_any else self.idle_poll_seconds)
            # stopping: the service's writers have stopped, so what they wrote last goes out now, not at a restart
            await asyncio.wait_for(self.drain_once(conn), FINAL_DRAIN_SECONDS)
        finally:
            self.leading.clear()
            with contextlib.suppress(Exception):
                await conn.close()  # the advisory lock goes with the session

    async def drain_once(self, conn: asyncpg.Connection) -> int:
        """Read up to a batch of the slot's transactions, publish their events in order and advance the slot past
        the last transaction JetStream took whole; returns how many events were published.

        The peek reads up to the WAL flushed when it began: when it read all of that (not stopped by the batch) and
        every event went, the slot advances to there, past other schemas' and tables' WAL too, which a later peek
        would otherwise decode again."""
        limit = self.batch_size * 3  # a transaction of one event is three messages: begin, the event, commit
        flushed, read = await conn.fetchrow(_PEEK, self.slot, limit)  # asyncpg: an LSN is an int
        messages = [bytes(m) for m in read]
        self.read_any = bool(messages)
        transactions, unreadable = parse(messages, WAL_PREFIX + self.schema)
        if unreadable:
            self._unreadable += unreadable
            log.error("outbox wal relay (%s): %d events in a frame this release cannot read, skipped (%d so far)",
                      self.schema, unreadable, self._unreadable)
        rows = [row for t in transactions for row in t.events]
        results = await self._publish(rows)
        acked = iter(isinstance(r, PubAck) for r in results)
        upto: int | None = None
        published = 0
        for t in transactions:  # past each transaction whose events all went, up to the first with a failure
            if not all(next(acked) for _ in t.events):
                break
            upto, published = t.end_lsn, published + len(t.events)
        if published == len(rows) and len(messages) < limit and flushed != self._advanced:
            upto = flushed  # read to the end: nothing before it is left
        if upto is not None:
            await conn.execute("SELECT pg_replication_slot_advance($1, $2::pg_lsn)", self.slot, upto)
            self._advanced = upto
            if published:  # (not on an idle read: the snapshot's own WAL would make the next one read again)
                await self._log_snapshot(conn)
        self._count(rows, results, published)
        self.published += published
        return published

    async def _log_snapshot(self, conn: asyncpg.Connection) -> None:
        """A snapshot of running transactions in the WAL (SNAPSHOT_EVERY_SECONDS says why), at most that often; a
        server that refuses it (an earlier PostgreSQL, a role without the right) is not asked again."""
        now = time.monotonic()
        if self._snapshots is False or now - self._snapshot_at < SNAPSHOT_EVERY_SECONDS:
            return
        self._snapshot_at = now
        try:
            await conn.execute("SELECT pg_log_standby_snapshot()")
        except (asyncpg.UndefinedFunctionError, asyncpg.InsufficientPrivilegeError) as exc:
            self._snapshots = False
            log.warning("outbox wal relay (%s): %s; each read decodes up to 15 s of WAL again", self.schema, exc)

    async def _publish(self, rows: list[dict[str, Any]]) -> list[PubAck | BaseException]:
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        if self.hooks:
            await self.hooks.after_select(ids)
        results = await self.table.publish_rows(rows)
        if self.hooks:
            await self.hooks.after_publish(ids)
        return results

    def _count(self, rows: list[dict[str, Any]], results: list[PubAck | BaseException], published: int) -> None:
        metrics = self.table.metrics
        if metrics and rows:
            metrics.inc("outbox_published_total", published, "events published from the outbox")
            if published < len(rows):
                metrics.inc("outbox_publish_failures_total", len(rows) - published, "outbox publishes not acked")
        if published < len(rows):
            first = next((r for r in results if not isinstance(r, PubAck)), None)
            log.warning("outbox wal relay (%s): %d of %d not acked: %r", self.schema, len(rows) - published,
                        len(rows), first)

    async def lag_bytes(self) -> int | None:
        """WAL bytes the slot has not been advanced past (None when it does not exist)."""
        async with self.table.pool.acquire() as conn:
            lag = await conn.fetchval(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots"
                " WHERE slot_name = $1", self.slot)
        return None if lag is None else int(lag)

    async def refresh_metrics(self) -> None:
        await self.table.refresh_metrics()
        lag = await self.lag_bytes()
        if self.table.metrics is not None and lag is not None:
            self.table.metrics.set("outbox_wal_slot_lag_bytes", lag)


__all__ = ["WalRelay", "drop_slot", "ensure_slot", "parse", "slot_name"]
