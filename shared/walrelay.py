"""The `wal` outbox transport's relay (CommonSettings.outbox_transport): writers emit each event as a transactional
WAL message (shared/outbox.py `wal_frame`) in the statement of their change, and one relay per schema reads them,
in commit order, from a logical replication slot of its own (`pgoutput` with `messages`).

- **Streamed**: the relay reads the slot over PostgreSQL's replication protocol, so each change is decoded once and
  sent as it commits. asyncpg does not speak that protocol; psycopg2's `LogicalReplicationConnection` does, and is
  used here only, behind `SlotStream` (bench/RESULTS.md, 2026-12-07 06:50: a lone event is handled 3-4 ms after
  its commit, not 18).
- **One reader**: a slot serves one session at a time, so the relays of a service's instances take a session
  advisory lock first; the others wait as standbys and one takes over when the reader's connection goes.
- **Nothing lost**: the relay publishes a transaction's events (`Nats-Msg-Id` the event id) and only then confirms
  the slot past it; what a crash leaves unconfirmed is streamed again at the next start, and JetStream's
  de-duplication window and the consumers' inboxes absorb the copy (SPEC 7).
- **Order per entity**: the slot yields transactions in commit order; a failed publish is retried, in that order,
  before anything after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import asyncpg
import psycopg2
import psycopg2.errors
import psycopg2.extras
from nats.js.api import PubAck

from shared.bus import wait_any
from shared.outbox import WAL_PREFIX, OutboxRelay, RelayHooks, read_wal_frame

log = logging.getLogger("weir.bus")

FINAL_DRAIN_SECONDS = 2.0  # a stopping relay's last read of its slot, at most
PUBLICATION = "weir_outbox"  # pgoutput needs one; it lists no table (the events come as messages, not changes)
OPTIONS = {"proto_version": "1", "publication_names": PUBLICATION, "messages": "true"}
POSITION_EVERY_SECONDS = 1.0  # an idle relay asks the server where its WAL is this often, so the slot moves past
# other schemas' and tables' WAL, which sends the relay nothing
CONNECT_TIMEOUT_SECONDS = 10  # a database that does not answer: the relay says so and tries again
STATUS_INTERVAL_SECONDS = 1  # how often psycopg2 tells the server what was confirmed (a crash resends at most this)


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


class Parsed(NamedTuple):
    transactions: list[Committed]
    consumed: int  # how many of the messages the transactions took: the rest begin one not ended yet
    unreadable: int  # messages of the prefix that could not be read (a later release's frame)


def parse(messages: list[bytes], prefix: str) -> Parsed:
    """pgoutput's protocol messages (version 1) as whole transactions, keeping the WAL messages whose prefix is
    `prefix`. A transaction not ended in `messages` is left (past `consumed`) for when the rest has come."""
    done: list[Committed] = []
    current: list[dict[str, Any]] = []
    unreadable = consumed = 0
    for index, data in enumerate(messages):
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
            current, consumed = [], index + 1
    return Parsed(done, consumed, unreadable)


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


class SlotStream:
    """The slot read over the replication protocol, on the event loop: psycopg2's replication cursor (it answers
    the server's keepalives and reports what was confirmed every STATUS_INTERVAL_SECONDS), its socket watched by the
    loop. Only connecting and starting block, in a thread."""

    def __init__(self, conn: Any, cursor: Any) -> None:
        self._conn, self._cursor = conn, cursor
        self._fd: int = cursor.fileno()
        self._more = False  # the last read stopped at its limit: more may be in the driver's buffer already
        self.confirmed = 0  # the LSN the slot is confirmed to
        self._asked_at = 0.0

    @classmethod
    async def open(cls, dsn: str, slot: str, *, wait_seconds: float = 5.0) -> SlotStream:
        """Stream the slot from where it was confirmed; while the session of its last reader is still going away
        (the slot still active), try again for up to `wait_seconds`."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                return await cls._open(dsn, slot)
            except psycopg2.errors.ObjectInUse:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    @classmethod
    async def _open(cls, dsn: str, slot: str) -> SlotStream:
        def start() -> tuple[Any, Any]:
            conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                    connect_timeout=CONNECT_TIMEOUT_SECONDS)
            try:
                cursor = conn.cursor()
                cursor.start_replication(slot_name=slot, decode=False, options=OPTIONS,
                                         status_interval=STATUS_INTERVAL_SECONDS)
            except BaseException:
                conn.close()
                raise
            return conn, cursor

        return cls(*await asyncio.to_thread(start))

    def read(self, limit: int) -> list[bytes]:
        """Up to `limit` messages that have come, without waiting."""
        out: list[bytes] = []
        while len(out) < limit:
            message = self._cursor.read_message()
            if message is None:
                break
            out.append(bytes(message.payload))
        self._more = len(out) == limit
        return out

    async def wait(self, stop: asyncio.Event, timeout: float) -> None:
        """Until something comes, `stop` is set, or `timeout` passes. The socket is watched only meanwhile: the loop
        watches it level-triggered, so watched while the relay publishes it would wake the loop at every turn."""
        if self._more:
            return
        readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._fd, readable.set)
        try:
            await wait_any(stop, readable, timeout)
        finally:
            loop.remove_reader(self._fd)

    @property
    def position(self) -> int:
        """How far the server has streamed (its last message or keepalive)."""
        return int(self._cursor.wal_end)

    def confirm(self, lsn: int) -> None:
        """Everything up to `lsn` went out: the slot may let it go (told with the next status report)."""
        self.confirmed = max(self.confirmed, lsn)
        self._cursor.send_feedback(flush_lsn=self.confirmed)

    def ask_position(self, every: float = 0.0) -> None:
        """Ask the server for a keepalive (its position, `position` once read), at most every `every` seconds.
        psycopg2 confirms that position too when everything streamed before it was confirmed."""
        now = time.monotonic()
        if now - self._asked_at >= every:
            self._asked_at = now
            self._cursor.send_feedback(reply=True)

    async def close(self) -> None:
        try:  # what went out, before the session goes (if it is gone already, the next reader sends some again)
            self._cursor.send_feedback(flush_lsn=self.confirmed, force=True)
        except psycopg2.Error as exc:
            log.info("outbox wal relay: the last confirmation was not sent: %s", exc)
        finally:
            self._conn.close()


@dataclass
class WalRelay:
    """Reads the schema's slot and publishes through `table`'s publishers (its spans, legacy copies and metrics),
    while `table` goes on draining the outbox table beside it (rows of writers of an earlier release)."""

    dsn: str
    schema: str
    table: OutboxRelay
    batch_size: int = 500
    recheck_seconds: float = 0.005  # published less than a batch: read again after this long (the next gather)
    standby_seconds: float = 1.0  # another relay reads the slot, or publishing failed: try again this often
    hooks: RelayHooks | None = None
    leading: asyncio.Event = field(default_factory=asyncio.Event)  # set while this relay reads the slot
    published: int = 0  # events this relay published and confirmed past
    _pending: list[bytes] = field(default_factory=list)  # streamed, not yet confirmed: retried first
    _unreadable: int = 0

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
                except Exception as exc:  # the database or the bus away: the slot keeps what was not confirmed
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
            stream = await SlotStream.open(self.dsn, self.slot)
            self._pending = []  # streamed again from what the slot confirmed
            self.leading.set()
            try:
                while not stop.is_set():
                    published = await self.drain_once(stream)
                    if published < 0:
                        await wait_any(stop, None, self.standby_seconds)  # publishing failed: not at once again
                        continue
                    if 0 < published < self.batch_size:
                        # as the table's relay: the events that come meanwhile go out in one batch (one round of
                        # acks), not one by one as each commit is streamed
                        await wait_any(stop, None, self.recheck_seconds)
                    if not self._pending:
                        stream.ask_position(POSITION_EVERY_SECONDS)
                    await stream.wait(stop, POSITION_EVERY_SECONDS)
                # stopping: the service's writers have stopped, so what they wrote last goes out now
                await self.catch_up(stream, conn, FINAL_DRAIN_SECONDS)
            finally:
                self.leading.clear()
                await stream.close()
        finally:
            with contextlib.suppress(Exception):
                await conn.close()  # the advisory lock goes with the session

    async def catch_up(self, stream: SlotStream, conn: asyncpg.Connection, within: float) -> int:
        """Publish what the slot holds up to the WAL flushed now (or what `within` seconds allow); how many went."""
        target = await conn.fetchval("SELECT pg_current_wal_flush_lsn()")  # asyncpg: an LSN is an int
        deadline = time.monotonic() + within
        sent = 0
        while True:
            sent += max(await self.drain_once(stream), 0)
            if not self._pending and max(stream.position, stream.confirmed) >= target:
                return sent
            left = deadline - time.monotonic()
            if left <= 0:
                return sent
            stream.ask_position(0.05)
            await stream.wait(asyncio.Event(), min(left, 0.05))

    async def drain_once(self, stream: SlotStream) -> int:
        """Publish the events of the whole transactions streamed so far, in order, and confirm the slot past the
        last one JetStream took whole; how many events were published, -1 when one was not (it is tried again,
        before anything after it)."""
        self._pending += stream.read(self.batch_size * 3)  # a transaction of one event: begin, the event, commit
        transactions, consumed, unreadable = parse(self._pending, WAL_PREFIX + self.schema)
        if unreadable:
            self._unreadable += unreadable
            log.error("outbox wal relay (%s): %d events in a frame this release cannot read, skipped (%d so far)",
                      self.schema, unreadable, self._unreadable)
        rows = [row for t in transactions for row in t.events]
        results = await self._publish(rows)
        acked = iter(isinstance(r, PubAck) for r in results)
        upto: int | None = None
        published = whole = 0
        for t in transactions:  # past each transaction whose events all went, up to the first with a failure
            if not all(next(acked) for _ in t.events):
                break
            upto, published, whole = t.end_lsn, published + len(t.events), whole + 1
        if whole == len(transactions):
            del self._pending[:consumed]
        else:  # from the first transaction with a failure on: kept, to go first next time
            self._pending = self._pending[_start_of(self._pending, whole):]
        if upto is not None:
            stream.confirm(upto)
        if not self._pending and stream.position > stream.confirmed:
            # everything streamed went out, and the server is further on (WAL that sends this relay nothing: other
            # tables', other schemas' messages in other transactions): the slot may let that go too
            stream.confirm(stream.position)
        self._count(rows, results, published)
        self.published += published
        return -1 if published < len(rows) else published

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


def _start_of(messages: list[bytes], n: int) -> int:
    """Where the (n+1)-th transaction begins in `messages` (the index after the n-th commit)."""
    for index, data in enumerate(messages):
        if n == 0:
            return index
        if data[:1] == b"C":
            n -= 1
    return len(messages)


__all__ = ["SlotStream", "WalRelay", "drop_slot", "ensure_slot", "parse", "slot_name"]
