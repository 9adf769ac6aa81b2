"""The outbox: a service writes its state change and its events in one transaction (`enqueue`), and `OutboxRelay`
publishes the unsent rows (through `EventPublishers`, `Nats-Msg-Id` the event id) and marks them sent once JetStream
acknowledged them. Several relays may share one outbox (SKIP LOCKED). With tracing on, each row is published under a
span in the trace of the work that wrote it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
from nats.js.api import PubAck
from opentelemetry.trace import Span, SpanKind

from shared import tracing
from shared.bus import HDR_LEGACY_COPY, wait_any
from shared.contracts import ContractError, contract, subject_of
from shared.events import Envelope, Event
from shared.metrics import Metrics
from shared.publishers import EventPublishers, Outgoing

log = logging.getLogger("weir.bus")


async def enqueue(conn: asyncpg.Connection, *events: Envelope | Event[Any]) -> None:
    """Write events to the outbox of the connection's schema; call inside the state change's transaction.

    An event without a trace context gets the current span's (when tracing is on): in its envelope (`traceparent`)
    and in the row, where the relay reads it to publish the event in the same trace (shared/tracing.py)."""
    current = tracing.current_traceparent()
    if current is not None:
        events = tuple(ev if ev.traceparent else ev.model_copy(update={"traceparent": current}) for ev in events)
    if len(events) == 1:  # the common case, one round trip
        ev = events[0]
        await conn.execute(
            "INSERT INTO outbox (id, subject, payload, traceparent, bus_subject) VALUES ($1, $2, $3, $4, $5)",
            ev.id, ev.type, ev.to_bytes(), ev.traceparent, bus_subject(ev),
        )
        return
    await conn.execute(
        "INSERT INTO outbox (id, subject, payload, traceparent, bus_subject)"
        " SELECT * FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::text[], $5::text[])",
        [ev.id for ev in events], [ev.type for ev in events], [ev.to_bytes() for ev in events],
        [ev.traceparent for ev in events], [bus_subject(ev) for ev in events],
    )


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


def _stored_bus_subject(row: asyncpg.Record) -> str | None:
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
    keep_sent_seconds: int = 86400
    metrics: Metrics | None = None
    hooks: RelayHooks | None = None
    legacy_copies: bool = False  # CommonSettings.events_legacy_subjects
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def channel(self) -> str:
        return f"weir_outbox_{self.schema}"

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until `stop` is set: woken by NOTIFY at each commit, with a poll as the fallback."""
        listener: asyncpg.Connection | None = None
        last_cleanup = 0.0
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
                if published < self.batch_size:
                    await wait_any(stop, self._wake, self.poll_seconds)
        finally:
            if listener is not None and not listener.is_closed():
                await listener.close()

    async def _listen(self) -> asyncpg.Connection | None:
        try:
            conn: asyncpg.Connection = await asyncpg.connect(self.dsn)
            await conn.add_listener(self.channel, lambda *_: self._wake.set())
            return conn
        except Exception as exc:
            log.warning("outbox relay (%s): LISTEN failed, polling: %s", self.schema, exc)
            return None

    async def drain_once(self) -> int:
        """Publish one batch of unsent rows; returns how many were published and marked sent."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT seq, id, subject, payload, traceparent, bus_subject FROM outbox WHERE sent_at IS NULL"
                " ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
                self.batch_size,
            )
            if not rows:
                return 0
            ids = [str(r["id"]) for r in rows]
            if self.hooks:
                await self.hooks.after_select(ids)
            results = await self._publish(rows)
            acked = [r["seq"] for r, res in zip(rows, results, strict=True) if isinstance(res, PubAck)]
            if self.hooks:
                await self.hooks.after_publish(ids)
            if acked:
                await conn.execute("UPDATE outbox SET sent_at = now() WHERE seq = ANY($1::bigint[])", acked)
            failed = len(rows) - len(acked)
            if self.metrics:
                self.metrics.inc("outbox_published_total", len(acked), "events published from the outbox")
                if failed:
                    self.metrics.inc("outbox_publish_failures_total", failed, "outbox publishes not acked")
            if failed:
                first = next(res for res in results if not isinstance(res, PubAck))
                log.warning("outbox relay (%s): %d of %d not acked: %r", self.schema, failed, len(rows), first)
            return len(acked)

    async def _publish(self, rows: list[asyncpg.Record]) -> list[PubAck | BaseException]:
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
                out.append(Outgoing(r["subject"], payload, f"{event_id}-legacy", {HDR_LEGACY_COPY: "1"}))
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

    def _relay_span(self, row: asyncpg.Record) -> Span:
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


__all__ = ["OutboxRelay", "RelayHooks", "enqueue"]
