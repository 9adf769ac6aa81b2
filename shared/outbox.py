"""The outbox: a service writes its state change and its events in one transaction (`enqueue`), and `OutboxRelay`
publishes the unsent rows (through `EventPublishers`, `Nats-Msg-Id` the event id) and marks them sent once JetStream
acknowledged them. Several relays may share one outbox (SKIP LOCKED). With tracing on, each row is published under a
span in the trace of the work that wrote it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import asyncpg
from nats.js.api import PubAck
from opentelemetry.trace import Span, SpanKind

from shared import tracing
from shared.bus import HDR_LEGACY_COPY, wait_any
from shared.contracts import ContractError, contract, subject_of
from shared.db import quote_ident
from shared.events import Envelope, Event
from shared.metrics import Metrics
from shared.publishers import EventPublishers, Outgoing

log = logging.getLogger("weir.bus")

# writers count a relay awake for 30 s after it last said so (shared/migrations/004_outbox_relays.sql): it says so
# again this often while it works
AWAKE_REFRESH_SECONDS = 5.0
# how long a relay about to sleep waits for writers' open transactions (holding the outbox ROW EXCLUSIVE) before it
# stays awake instead: a writer queued behind the relay's request waits at most this long
SLEEP_LOCK_TIMEOUT_MS = 20


Transport = Literal["table", "wal"]
_RETURNING = re.compile(r"\bRETURNING\b", re.IGNORECASE)
_COLUMNS = "INSERT INTO outbox (id, subject, payload, traceparent, bus_subject)"


def _traced(events: tuple[Envelope | Event[Any], ...]) -> tuple[Envelope | Event[Any], ...]:
    """An event without a trace context gets the current span's (when tracing is on): in its envelope
    (`traceparent`) and in the row, where the relay reads it to publish the event in the same trace."""
    current = tracing.current_traceparent()
    if current is None:
        return events
    return tuple(ev if ev.traceparent else ev.model_copy(update={"traceparent": current}) for ev in events)


def _outbox_insert(events: tuple[Envelope | Event[Any], ...], first: int) -> tuple[str, list[Any]]:
    """The outbox INSERT of `events` with its parameters numbered from `first`: one row's values, or arrays."""
    n = [f"${first + i}" for i in range(5)]
    if len(events) == 1:
        ev = events[0]
        return (f"{_COLUMNS} VALUES ({n[0]}, {n[1]}, {n[2]}, {n[3]}, {n[4]})",
                [ev.id, ev.type, ev.to_bytes(), ev.traceparent, bus_subject(ev)])
    return (f"{_COLUMNS} SELECT * FROM unnest({n[0]}::uuid[], {n[1]}::text[], {n[2]}::bytea[], {n[3]}::text[],"
            f" {n[4]}::text[])",
            [[ev.id for ev in events], [ev.type for ev in events], [ev.to_bytes() for ev in events],
             [ev.traceparent for ev in events], [bus_subject(ev) for ev in events]])


# where this process's writes put their events (CommonSettings.outbox_transport; `use_transport` at start-up)
_transport: Transport = "table"


def use_transport(transport: Transport) -> None:
    """This process's writers put their events where `transport` says from now on (a service's runtime calls it
    once, after migrating, before any write; a process that never does writes rows)."""
    global _transport
    _transport = transport


def _events_sql(events: tuple[Envelope | Event[Any], ...], first: int) -> tuple[str, list[Any]]:
    """The statement that writes `events` (parameters numbered from `first`): the outbox rows' INSERT, or with the
    `wal` transport a SELECT emitting one transactional WAL message per event (shared/walrelay.py reads them)."""
    if _transport == "table":
        return _outbox_insert(events, first)
    return (f"SELECT pg_logical_emit_message(true, '{WAL_PREFIX}' || current_schema(), m)"
            f" FROM unnest(${first}::bytea[]) m", [[wal_frame(ev) for ev in events]])


async def enqueue(conn: asyncpg.Connection, *events: Envelope | Event[Any]) -> None:
    """Write events to the outbox of the connection's schema; call inside the state change's transaction (or use
    `change_with_events`, which saves the round trip when the change is one statement)."""
    sql, args = _events_sql(_traced(events), 1)
    await conn.execute(sql, *args)


async def change_with_events(conn: asyncpg.Connection, statement: str, *args: Any,
                             events: tuple[Envelope | Event[Any], ...]) -> list[asyncpg.Record]:
    """Run one data-modifying `statement` (INSERT, UPDATE or DELETE with `$1`..`$n` for `args`) and write `events`
    to the outbox in the same SQL statement (a data-modifying WITH): atomic even outside a transaction, and one
    round trip instead of two. Returns the statement's rows (its RETURNING; none without one). The events are
    written whatever rows the statement changed, as `enqueue` after it would."""
    sql, outbox_args = _events_sql(_traced(events), len(args) + 1)
    returning = _RETURNING.search(statement)
    if _transport == "wal":  # a SELECT in a WITH runs only when read: a gating condition reads it before any row
        query = (f"WITH change AS ({statement}), sent AS ({sql}) SELECT * FROM change"
                 f" WHERE (SELECT count(*) FROM sent) >= 0") if returning else (
                 f"WITH change AS ({statement}) SELECT count(*) FROM ({sql}) sent")
    else:
        query = (f"WITH change AS ({statement}), sent AS ({sql}) SELECT * FROM change" if returning
                 else f"WITH change AS ({statement}) {sql}")
    if returning:
        rows: list[asyncpg.Record] = await conn.fetch(query, *args, *outbox_args)
        return rows
    await conn.execute(query, *args, *outbox_args)
    return []


WAL_PREFIX = "weir.outbox."  # a WAL message's prefix: this, then the schema whose outbox it belongs to
_WAL_FRAME = b"weir1"  # the frame's version: a reader skips (and logs) a frame of a version it does not know


def wal_frame(ev: Envelope | Event[Any]) -> bytes:
    """An event as a WAL message's content: what an outbox row holds, NUL-separated (id, type, bus subject,
    traceparent; the last two empty when none), then the envelope's JSON (which holds no NUL byte)."""
    return b"\0".join((_WAL_FRAME, ev.id.encode(), ev.type.encode(), (bus_subject(ev) or "").encode(),
                       (ev.traceparent or "").encode(), ev.to_bytes()))


def read_wal_frame(content: bytes) -> dict[str, Any] | None:
    """A WAL message's event as an outbox row's columns (what the relay publishes), or None for a frame this
    release cannot read (a later version's: the reader leaves it and says so)."""
    parts = content.split(b"\0", 5)
    if len(parts) != 6 or parts[0] != _WAL_FRAME:
        return None
    _, event_id, subject, bus, traceparent, payload = parts
    return {"id": event_id.decode(), "subject": subject.decode(), "bus_subject": bus.decode() or None,
            "traceparent": traceparent.decode() or None, "payload": payload}


def bus_subject(ev: Envelope | Event[Any]) -> str | None:
    """The subject an event goes on when it is not its bare type (its account's: SPEC 12); None: the type only."""
    data = ev.data.model_dump() if isinstance(ev, Event) else ev.data
    try:
        subject = subject_of(ev.type, data if isinstance(data, dict) else {})
    except ContractError:  # a type no contract has: on its type, where JetStream says whether anything keeps it
        return None
    return None if subject == ev.type else subject


def _has_legacy(event_type: str) -> bool:
    try:
        return contract(event_type).legacy
    except ContractError:
        return False


def _stored_bus_subject(row: Mapping[str, Any]) -> str | None:
    """A row's bus subject; for a row an older release wrote (no bus_subject), worked out from its payload."""
    if row["bus_subject"] is not None:
        return str(row["bus_subject"])
    try:
        data = json.loads(bytes(row["payload"])).get("data")
        subject = subject_of(row["subject"], data if isinstance(data, dict) else {})
    except (ValueError, AttributeError, ContractError):
        return None
    return None if subject == row["subject"] else subject


class RelayHooks(Protocol):
    """Points where tests stop a relay as if the process died there."""

    async def after_select(self, ids: list[str]) -> None: ...

    async def after_publish(self, ids: list[str]) -> None: ...


@dataclass
class OutboxRelay:
    """Publishes the outbox of one schema through `publishers` (declared on the service's broker, or on a tool's:
    `weir sweep run` sends what its run wrote)."""

    pool: asyncpg.Pool
    dsn: str
    schema: str
    publishers: EventPublishers
    batch_size: int = 500
    poll_seconds: float = 1.0
    linger_seconds: float = 0.05  # found nothing for this long: sleep (writers notify again)
    recheck_seconds: float = 0.005  # awake and caught up: look again after this long
    keep_sent_seconds: int = 86400
    metrics: Metrics | None = None
    hooks: RelayHooks | None = None
    legacy_copies: bool = False  # CommonSettings.events_legacy_subjects
    relay_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _seen: float = 0.0  # when this relay last said it is awake (monotonic)
    _unacked: int = 0  # rows of the last drain that JetStream did not acknowledge

    @property
    def channel(self) -> str:
        return f"weir_outbox_{self.schema}"

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until `stop` is set. While rows keep coming the relay drains again at once and says it is awake
        (writers then skip NOTIFY: shared/migrations/004_outbox_relays.sql); once a drain finds nothing it says it
        sleeps and waits for a NOTIFY, with a poll as the fallback."""
        listener: asyncpg.Connection | None = None
        last_cleanup = 0.0
        quiet_since: float | None = None  # since when drains have found nothing
        try:
            while not stop.is_set():
                if listener is None or listener.is_closed():
                    listener = await self._listen()
                self._wake.clear()
                try:
                    published = await self.drain_once()
                except Exception as exc:  # storage or bus trouble: keep the rows, try again later
                    log.warning("outbox relay (%s): %s", self.schema, exc)
                    await wait_any(stop, None, self.poll_seconds)
                    continue
                if time.monotonic() - last_cleanup > 60:
                    last_cleanup = time.monotonic()
                    await self.delete_old_sent()
                if published:
                    quiet_since = None
                    await self._awake(listener)
                    if published < self.batch_size:  # caught up: let the next rows gather a moment
                        await wait_any(stop, None, self.recheck_seconds)
                    continue  # writers do not wake an awake relay
                if self._unacked:  # rows JetStream did not take: again after the poll, not in a tight loop
                    await wait_any(stop, None, self.poll_seconds)
                    continue
                now = time.monotonic()
                quiet_since = now if quiet_since is None else quiet_since
                if now - quiet_since < self.linger_seconds:
                    # quiet a moment only (between two commits of a steady load): look again shortly, still awake,
                    # rather than go to sleep and make the writers notify
                    await wait_any(stop, None, self.recheck_seconds)
                    continue
                quiet_since = None
                listener = await self._sleep(listener, stop)
        finally:
            if listener is not None and not listener.is_closed():
                with contextlib.suppress(Exception):
                    await listener.execute(f"DELETE FROM {self._q}.outbox_relays WHERE relay = $1", self.relay_id)
                await listener.close()

    @property
    def _q(self) -> str:
        return quote_ident(self.schema)

    async def _listen(self) -> asyncpg.Connection | None:
        """The relay's own connection: LISTEN, and the relay's row in `outbox_relays` (awake)."""
        try:
            conn: asyncpg.Connection = await asyncpg.connect(self.dsn)
            await conn.add_listener(self.channel, lambda *_: self._wake.set())
            await conn.execute(
                f"INSERT INTO {self._q}.outbox_relays (relay, sleeping) VALUES ($1, false)"
                " ON CONFLICT (relay) DO UPDATE SET sleeping = false, seen = now()", self.relay_id)
            self._seen = time.monotonic()
            return conn
        except Exception as exc:
            log.warning("outbox relay (%s): LISTEN failed, polling: %s", self.schema, exc)
            return None

    async def _awake(self, listener: asyncpg.Connection | None) -> None:
        """Say again now and then that this relay is awake (writers count an awake relay for 30 s after it says so)."""
        if listener is None or time.monotonic() - self._seen < AWAKE_REFRESH_SECONDS:
            return
        try:
            await self._say(listener, sleeping=False)
        except Exception as exc:  # writers then notify again (the row goes stale): slower, never lost
            log.warning("outbox relay (%s): %s", self.schema, exc)

    async def _say(self, listener: asyncpg.Connection, *, sleeping: bool) -> None:
        """The relay's row in `outbox_relays`: asleep or awake, as of now."""
        await listener.execute(f"UPDATE {self._q}.outbox_relays SET sleeping = $2, seen = now() WHERE relay = $1",
                               self.relay_id, sleeping)
        self._seen = time.monotonic()

    async def _sleep(self, listener: asyncpg.Connection | None, stop: asyncio.Event) -> asyncpg.Connection | None:
        """Wait for a NOTIFY or the poll. First say so, then take the outbox in SHARE mode a moment (it waits for
        the writers' ROW EXCLUSIVE: shared/migrations/004_outbox_relays.sql): every writer that read "awake" has then
        ended, so a last look for rows sees what it wrote. A writer's transaction still open past
        `SLEEP_LOCK_TIMEOUT_MS` keeps the relay awake instead (it looks again after a short pause).
        Returns the listener, or None when it failed (then the next turn makes a new one)."""
        if listener is None:
            await wait_any(stop, self._wake, self.poll_seconds)
            return None
        try:
            await self._say(listener, sleeping=True)
            try:
                async with listener.transaction():
                    await listener.execute(f"SET LOCAL lock_timeout = '{SLEEP_LOCK_TIMEOUT_MS}ms'")
                    await listener.execute(f"LOCK TABLE {self._q}.outbox IN SHARE MODE")
                    pending = await listener.fetchval(
                        f"SELECT EXISTS (SELECT 1 FROM {self._q}.outbox WHERE sent_at IS NULL)")
            except asyncpg.LockNotAvailableError:
                pending = None  # a writer's transaction is still open: stay awake
            if pending is False:
                await wait_any(stop, self._wake, self.poll_seconds)
            elif pending is None:
                await wait_any(stop, self._wake, SLEEP_LOCK_TIMEOUT_MS / 1000)
            await self._say(listener, sleeping=False)
            return listener
        except Exception as exc:  # the relay's row may say "sleeping": writers notify meanwhile (safe)
            log.warning("outbox relay (%s): %s", self.schema, exc)
            with contextlib.suppress(Exception):
                await listener.close()
            await wait_any(stop, self._wake, self.poll_seconds)
            return None

    async def drain_once(self) -> int:
        """Publish one batch of unsent rows; returns how many were published and marked sent."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT seq, id, subject, payload, traceparent, bus_subject FROM outbox WHERE sent_at IS NULL"
                " ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
                self.batch_size,
            )
            self._unacked = 0
            if not rows:
                return 0
            ids = [str(r["id"]) for r in rows]
            if self.hooks:
                await self.hooks.after_select(ids)
            results = await self.publish_rows(rows)
            acked = [r["seq"] for r, res in zip(rows, results, strict=True) if isinstance(res, PubAck)]
            if self.hooks:
                await self.hooks.after_publish(ids)
            if acked:
                # not waiting for the WAL flush: a mark lost in a crash only sends the rows again, which JetStream's
                # Nats-Msg-Id window and the consumers' inboxes absorb (SPEC 7), and the relay's next batch goes
                # out a flush sooner
                await conn.execute("SET LOCAL synchronous_commit = off")
                await conn.execute("UPDATE outbox SET sent_at = now() WHERE seq = ANY($1::bigint[])", acked)
            failed = self._unacked = len(rows) - len(acked)
            if self.metrics:
                self.metrics.inc("outbox_published_total", len(acked), "events published from the outbox")
                if failed:
                    self.metrics.inc("outbox_publish_failures_total", failed, "outbox publishes not acked")
            if failed:
                first = next(res for res in results if not isinstance(res, PubAck))
                log.warning("outbox relay (%s): %d of %d not acked: %r", self.schema, failed, len(rows), first)
            return len(acked)

    async def publish_rows(self, rows: list[Any]) -> list[PubAck | BaseException]:
        """Each row's PubAck (or why none): of its account subject's publish, and of its legacy copy's too when
        there is one (the row is sent once both are acknowledged)."""
        spans = [self._relay_span(r) for r in rows] if tracing.enabled() else [None] * len(rows)
        out: list[Outgoing] = []
        owner: list[int] = []  # the row of each message
        for index, (r, span) in enumerate(zip(rows, spans, strict=True)):
            payload, event_id = bytes(r["payload"]), str(r["id"])
            account = _stored_bus_subject(r)
            out.append(Outgoing(account or r["subject"], payload, event_id, span=span))
            owner.append(index)
            if account is not None and self.legacy_copies and _has_legacy(r["subject"]):
                out.append(Outgoing(r["subject"], payload, f"{event_id}-legacy", {HDR_LEGACY_COPY: "1"}, span=span))
                owner.append(index)
        try:
            published = await self.publishers.publish_in_order(out)
        except BaseException as exc:
            for span in spans:
                if span is not None:
                    tracing.failed(span, exc)
                    span.end()
            raise
        merged: list[PubAck | BaseException | None] = [None] * len(rows)
        for index, result in zip(owner, published, strict=True):
            if not isinstance(merged[index], BaseException):  # a row's failure stays its answer
                merged[index] = result
        results = [r for r in merged if r is not None]
        for span, result in zip(spans, results, strict=True):
            if span is not None:
                if isinstance(result, BaseException):
                    tracing.failed(span, result)
                span.end()
        return results

    def _relay_span(self, row: Mapping[str, Any]) -> Span:
        """The span of one row's publish, until JetStream acknowledged it: in the trace of the work that wrote the row
        (its traceparent; a new trace when that work was not traced)."""
        subject, event_id = row["subject"], str(row["id"])
        try:  # the envelope's subject (the entity): parsed only when tracing is on
            entity = json.loads(bytes(row["payload"])).get("subject")
        except (ValueError, AttributeError):
            entity = None
        return tracing.start_span(
            f"outbox relay {subject}", context=tracing.context_of(row["traceparent"]) or tracing.ROOT,
            video_id=tracing.video_id_of(subject, entity) if isinstance(entity, str) else None,
            attributes={tracing.EVENT_ID: event_id, "messaging.destination.name": subject,
                        "messaging.message.id": event_id, "weir.outbox.schema": self.schema},
            kind=SpanKind.PRODUCER,
        )

    async def delete_old_sent(self) -> None:
        try:
            async with self.pool.acquire() as conn:
                await conn.execute(
                    "DELETE FROM outbox WHERE sent_at < now() - make_interval(secs => $1)",
                    float(self.keep_sent_seconds),
                )
                # a relay that died asleep leaves its row, and writers notify for nothing until it goes
                await conn.execute("DELETE FROM outbox_relays WHERE seen < now() - make_interval(secs => $1)",
                                   max(600.0, 10 * self.poll_seconds))
        except Exception as exc:  # the rows stay until the next cleanup; nothing depends on them
            log.warning("outbox relay (%s): deleting sent rows failed: %s", self.schema, exc)

    async def pending(self) -> int:
        async with self.pool.acquire() as conn:
            n: int = await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            return n

    async def backlog(self) -> tuple[int, float]:
        """Unsent rows, and the age in seconds of the oldest of them (0 when there are none)."""
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT count(*) AS unsent, COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS age"
                " FROM outbox WHERE sent_at IS NULL")
        assert row is not None
        return int(row["unsent"]), max(0.0, float(row["age"]))

    async def refresh_metrics(self) -> None:
        if self.metrics is None:
            return
        unsent, age = await self.backlog()
        self.metrics.set("outbox_unsent", unsent)
        self.metrics.set("outbox_oldest_unsent_age_seconds", age)


__all__ = ["OutboxRelay", "RelayHooks", "change_with_events", "enqueue", "use_transport"]
