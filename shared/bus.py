"""The event bus: NATS connection, the outbox and its relay, and the idempotent consumer.

- A service writes its state change and its event in one transaction (`enqueue`).
- `OutboxRelay` publishes unsent outbox rows to JetStream with the event id as `Nats-Msg-Id`, waits for
  every PubAck, and only then marks the rows sent. Several relays may share one outbox (SKIP LOCKED).
- `IdempotentConsumer` pulls from a durable consumer with explicit acks; the handler's effects and the
  inbox record of the event id commit in one transaction, so redeliveries and replays change nothing twice.
  Failures are NAKed with a delay; after `max_deliver` attempts the message is parked on `dlq.<type>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from shared.events import Envelope, MalformedEvent, dlq_subject
from shared.metrics import Metrics
from shared.settings import CommonSettings

log = logging.getLogger("weir.bus")

REPLAY_STREAM = "REPLAY"
HDR_MSG_ID = "Nats-Msg-Id"
HDR_REPROCESS = "Weir-Reprocess"
HDR_TYPE = "Weir-Type"
HDR_ERROR = "Weir-Error"
HDR_CONSUMER = "Weir-Consumer"
HDR_ORIGINAL_SUBJECT = "Weir-Original-Subject"
HDR_DELIVERIES = "Weir-Deliveries"


async def connect(settings: CommonSettings, *, name: str, **kwargs: Any) -> NATS:
    servers = [s.strip() for s in settings.nats_url.split(",") if s.strip()]
    nc: NATS = await nats.connect(
        servers=servers,
        name=f"weir-{name}",
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        **kwargs,
    )
    return nc


def replay_subject(consumer: str, event_type: str) -> str:
    return f"replay.{consumer}.{event_type}"


# --------------------------------------------------------------------------------------------- outbox


async def subscriptions_in_place(nc: NATS) -> None:
    """Returns once the server has every subscription this connection made so far.

    One `nc.flush()` is not enough: nats-py writes its PING straight to the socket, ahead of commands still waiting
    for its flusher task (a SUB just made), so the PONG can come back before the server has the SUB. By the time it
    does, the flusher has written the SUB, so a second PING goes after it."""
    await nc.flush()
    await nc.flush()


async def enqueue(conn: asyncpg.Connection, *events: Envelope) -> None:
    """Write events to the outbox of the connection's schema; call inside the state change's transaction."""
    if len(events) == 1:  # the common case, one round trip
        ev = events[0]
        await conn.execute(
            "INSERT INTO outbox (id, subject, payload) VALUES ($1, $2, $3)", ev.id, ev.type, ev.to_bytes()
        )
        return
    await conn.execute(
        "INSERT INTO outbox (id, subject, payload) SELECT * FROM unnest($1::uuid[], $2::text[], $3::bytea[])",
        [ev.id for ev in events], [ev.type for ev in events], [ev.to_bytes() for ev in events],
    )


class RelayHooks(Protocol):
    """Points where tests stop a relay as if the process died there."""

    async def after_select(self, ids: list[str]) -> None: ...

    async def after_publish(self, ids: list[str]) -> None: ...


@dataclass
class OutboxRelay:
    pool: asyncpg.Pool
    js: JetStreamContext
    dsn: str
    schema: str
    batch_size: int = 500
    poll_seconds: float = 1.0
    publish_timeout: float = 5.0
    keep_sent_seconds: int = 86400
    metrics: Metrics | None = None
    hooks: RelayHooks | None = None
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
                    published = 0
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
                "SELECT seq, id, subject, payload FROM outbox WHERE sent_at IS NULL"
                " ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
                self.batch_size,
            )
            if not rows:
                return 0
            ids = [str(r["id"]) for r in rows]
            if self.hooks:
                await self.hooks.after_select(ids)
            # publish_async keeps the rows' order on the wire; each future resolves on its PubAck
            futures = [
                await self.js.publish_async(r["subject"], bytes(r["payload"]), headers={HDR_MSG_ID: str(r["id"])})
                for r in rows
            ]
            results = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), timeout=self.publish_timeout
            )
            acked = [r["seq"] for r, res in zip(rows, results, strict=True) if isinstance(res, api.PubAck)]
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
                first = next(res for res in results if not isinstance(res, api.PubAck))
                log.warning("outbox relay (%s): %d of %d not acked: %r", self.schema, failed, len(rows), first)
            return len(acked)

    async def delete_old_sent(self) -> None:
        with contextlib.suppress(Exception):
            async with self.pool.acquire() as conn:
                await conn.execute(
                    "DELETE FROM outbox WHERE sent_at < now() - make_interval(secs => $1)",
                    float(self.keep_sent_seconds),
                )

    async def pending(self) -> int:
        async with self.pool.acquire() as conn:
            n: int = await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            return n


async def wait_any(stop: asyncio.Event, wake: asyncio.Event | None, timeout: float) -> None:
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


# ------------------------------------------------------------------------------------------- consumer

Handler = Callable[[asyncpg.Connection, Envelope], Awaitable[None]]


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer of one service: its name, the stream and subjects it reads, and its handler."""

    name: str  # durable name; also the inbox key and the replay subject token (no dots)
    stream: str
    subjects: tuple[str, ...]
    handler: Handler
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ".*> "):
            raise ValueError(f"consumer name must be a plain token: {self.name!r}")


class HandlerOutcome:
    HANDLED = "handled"
    DUPLICATE = "duplicate"
    RETRY = "retry"
    PARKED = "parked"


class IdempotentConsumer:
    def __init__(
        self,
        spec: ConsumerSpec,
        *,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        settings: CommonSettings,
        metrics: Metrics | None = None,
        after_commit: Callable[[list[Envelope]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.after_commit = after_commit  # observers of what was applied (lag metrics, benchmarks)
        self.js = js
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self._inflight: set[asyncio.Task[None]] = set()
        self._lane_tail: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(settings.consumer_concurrency)

    def consumer_config(self, *, durable: str, subjects: list[str]) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            durable_name=durable,
            name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.consumer_ack_wait_seconds,
            # parking is ours (after consumer_max_deliver); the server never drops a message silently
            max_deliver=-1,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            max_ack_pending=max(1000, self.settings.consumer_concurrency * 4),
            description=self.spec.description or None,
        )

    async def ensure(self) -> None:
        """Create the durable consumers (main and replay) if missing; consumers belong to their service."""
        for stream, durable, subjects in self._sources():
            try:
                await self.js.consumer_info(stream, durable)
            except NotFoundError:
                await self.js.add_consumer(stream, self.consumer_config(durable=durable, subjects=subjects))

    def _sources(self) -> list[tuple[str, str, list[str]]]:
        return [
            (self.spec.stream, self.spec.name, list(self.spec.subjects)),
            (REPLAY_STREAM, f"{self.spec.name}_replay", [f"replay.{self.spec.name}.>"]),
        ]

    async def run(self, stop: asyncio.Event) -> None:
        await self.ensure()
        subs = []
        for stream, durable, _ in self._sources():
            subs.append(await self.js.pull_subscribe_bind(durable=durable, stream=stream))
        try:
            await asyncio.gather(*(self._pull(sub, stop) for sub in subs))
        finally:
            await self.drain()
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for in-flight handlers (SIGTERM: finish what was started, take nothing new)."""
        if self._inflight:
            await asyncio.wait(
                list(self._inflight), timeout=timeout or self.settings.shutdown_grace_seconds
            )

    async def _pull(self, sub: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(self.settings.consumer_batch, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:  # disconnected: nats-py reconnects; try again shortly
                if stop.is_set():
                    return
                log.warning("consumer %s: fetch failed: %s", self.spec.name, exc)
                await wait_any(stop, None, 0.5)
                continue
            await self._dispatch(msgs)

    async def _dispatch(self, msgs: list[Msg]) -> None:
        """Split a fetched batch into lanes by entity; each lane's part is applied in one transaction.

        Events about one entity always take the same lane, and a lane's work waits for that lane's previous
        work, so they are handled in the order they were stored; different lanes run side by side.
        """
        lanes: dict[int, list[tuple[Msg, Envelope | None]]] = {}
        for msg in msgs:
            envelope = _try_parse(msg)
            lane = hash(envelope.subject) % self.settings.consumer_lanes if envelope else 0
            lanes.setdefault(lane, []).append((msg, envelope))
        for lane, items in lanes.items():
            await self._slots.acquire()
            previous = self._lane_tail.get(lane)
            task = asyncio.create_task(self._run_lane(items, previous))
            self._lane_tail[lane] = task
            self._inflight.add(task)
            task.add_done_callback(functools.partial(self._done, lane=lane))

    def _done(self, task: asyncio.Task[None], lane: int) -> None:
        self._inflight.discard(task)
        if self._lane_tail.get(lane) is task:
            del self._lane_tail[lane]
        self._slots.release()

    async def _run_lane(
        self, items: list[tuple[Msg, Envelope | None]], previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None:
            with contextlib.suppress(BaseException):
                await previous
        try:
            if len(items) > 1 and all(env is not None and not _reprocess(msg) for msg, env in items):
                with contextlib.suppress(Exception):  # any failure: fall back to one message at a time
                    await self._apply_together([env for _, env in items if env is not None])
                    await asyncio.gather(*(msg.ack() for msg, _ in items))
                    return
            for msg, env in items:
                await self.handle(msg, env)
        except Exception:
            log.exception("consumer %s: unexpected failure", self.spec.name)

    async def _apply_together(self, envelopes: list[Envelope]) -> None:
        """Effects of several events and their inbox records in one transaction (all or nothing)."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "INSERT INTO inbox (consumer, event_id, event_type)"
                " SELECT $1, * FROM unnest($2::uuid[], $3::text[]) ON CONFLICT DO NOTHING RETURNING event_id::text",
                self.spec.name,
                [e.id for e in envelopes],
                [e.type for e in envelopes],
            )
            fresh = {r[0] for r in rows}
            applied: list[Envelope] = []
            for envelope in envelopes:
                if envelope.id in fresh:
                    fresh.discard(envelope.id)  # a copy later in the same batch is a duplicate
                    await self.spec.handler(conn, envelope)
                    applied.append(envelope)
        self._count(HandlerOutcome.HANDLED, len(applied))
        self._count(HandlerOutcome.DUPLICATE, len(envelopes) - len(applied))
        if self.after_commit and applied:
            self.after_commit(applied)

    async def handle(self, msg: Msg, envelope: Envelope | None = None) -> str:
        """Handle one delivery: effects and inbox in one transaction, then ack; NAK or park on failure."""
        reprocess = _reprocess(msg)
        deliveries = msg.metadata.num_delivered if msg.reply else 1
        try:
            if envelope is None:
                envelope = Envelope.from_bytes(msg.data)
            outcome = await self._apply(envelope, reprocess=reprocess)
        except Exception as exc:
            if deliveries >= self.settings.consumer_max_deliver:
                await self._park(msg, envelope, exc, deliveries)
                await msg.ack()
                self._count("parked")
                return HandlerOutcome.PARKED
            log.warning(
                "consumer %s: delivery %d of %s failed: %s",
                self.spec.name, deliveries, envelope.id if envelope else msg.subject, exc,
            )
            await msg.nak(delay=self.settings.consumer_nak_delay_seconds)
            self._count("retried")
            return HandlerOutcome.RETRY
        await msg.ack()
        self._count(outcome)
        return outcome

    async def _apply(self, envelope: Envelope, *, reprocess: bool) -> str:
        async with self.pool.acquire() as conn, conn.transaction():
            first = await conn.fetchval(
                "INSERT INTO inbox (consumer, event_id, event_type) VALUES ($1, $2, $3)"
                " ON CONFLICT (consumer, event_id) DO UPDATE SET times = inbox.times + 1,"
                " handled_at = now() WHERE $4 RETURNING times = 1",
                self.spec.name,
                envelope.id,
                envelope.type,
                reprocess,
            )
            if first is None:  # handled before, and no reprocess asked: nothing changes twice
                return HandlerOutcome.DUPLICATE
            await self.spec.handler(conn, envelope)
        if self.after_commit:
            self.after_commit([envelope])
        return HandlerOutcome.HANDLED

    async def _park(self, msg: Msg, envelope: Envelope | None, exc: Exception, deliveries: int) -> None:
        event_type = envelope.type if envelope else _type_from_subject(msg.subject)
        headers = {
            HDR_MSG_ID: f"dlq-{self.spec.name}-{envelope.id if envelope else msg.metadata.sequence.stream}",
            HDR_ERROR: f"{type(exc).__name__}: {exc}"[:2000],
            HDR_CONSUMER: self.spec.name,
            HDR_ORIGINAL_SUBJECT: msg.subject,
            HDR_DELIVERIES: str(deliveries),
        }
        await self.js.publish(dlq_subject(event_type), msg.data, headers=headers)
        log.error("consumer %s: parked %s on %s: %s", self.spec.name, msg.subject, dlq_subject(event_type), exc)

    def _count(self, outcome: str, n: int = 1) -> None:
        if self.metrics and n:
            self.metrics.inc(
                "consumer_messages_total", n, help="messages by consumer and outcome",
                consumer=self.spec.name, outcome=outcome,
            )


def _reprocess(msg: Msg) -> bool:
    return bool(msg.headers and msg.headers.get(HDR_REPROCESS) == "1")


def _try_parse(msg: Msg) -> Envelope | None:
    try:
        return Envelope.from_bytes(msg.data)
    except MalformedEvent:
        return None


def _type_from_subject(subject: str) -> str:
    if subject.startswith("replay."):
        return subject.split(".", 2)[2]
    return subject


__all__ = [
    "ConsumerSpec",
    "Envelope",
    "Handler",
    "HandlerOutcome",
    "IdempotentConsumer",
    "MalformedEvent",
    "OutboxRelay",
    "connect",
    "enqueue",
    "replay_subject",
]
