"""The event bus on FastStream: the outbox and its relay, and the idempotent consumer.

- A service writes its state change and its event in one transaction (`enqueue`).
- `OutboxRelay` publishes unsent outbox rows through the service's declared FastStream publishers
  (`EventPublishers`, one per event type, so the AsyncAPI document lists them with their schemas), with the event
  id as `Nats-Msg-Id`; it waits for every PubAck and only then marks the rows sent. Several relays may share one
  outbox (SKIP LOCKED). `weir replay` publishes its copies through `EventPublishers` too (`replay=True`).
- `EventConsumer` runs one `ConsumerSpec` as FastStream JetStream batch pull subscribers (its durable, and
  `<name>_replay` on REPLAY), whose handler takes `list[Event[M]]`: the catalog's model is the contract. The
  handler's effects and the inbox record of the event id commit in one transaction, so redeliveries and replays
  change nothing twice. A fetched batch is split into lanes by entity, each applied in one transaction (one at a
  time if that fails), and the next batch is pulled while lanes run. Failures are NAKed with a delay; after
  `consumer_max_deliver` deliveries the message is parked on `dlq.<type>`. A message whose data does not validate
  is parked at once, by the `Admission` middleware, before the batch reaches the handler.

Both count on the service's metrics (names in shared/metrics.py): each consumer's outcomes, redeliveries, handler
time and pending messages (JetStream consumer info), and the outbox's backlog and the age of its oldest row.

Both trace (shared/tracing.py, when tracing is on): `enqueue` stores the current trace context with the row and in
the envelope; the relay publishes each row under a span in that trace (`outbox relay <type>`); the consumer handles
each event in a span of the trace its message carries (`<type> process`), a replayed one in a new span linked to its
original trace. Lines logged while an event is handled name it (`event_id`, shared/logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast, get_type_hints

import asyncpg
import nats
from faststream import AckPolicy, BaseMiddleware
from faststream.message import StreamMessage
from faststream.nats import NatsBroker, NatsMessage, NatsRouter, PubAck, PullSub
from faststream.nats.publisher.usecase import LogicPublisher
from faststream.nats.subscriber.usecases import BatchPullStreamSubscriber
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from pydantic import TypeAdapter, ValidationError

from shared import db, logs, natsconn, tracing
from shared.contracts import DLQ_STREAM, REPLAY_PREFIX, REPLAY_STREAM, replay_durable, replay_filter, replay_subject
from shared.events import CATALOG, Envelope, Event, EventData, MalformedEvent, dlq_subject, event_models, event_union
from shared.messaging import no_declare
from shared.metrics import Metrics
from shared.natsconn import ConnectionWatch
from shared.settings import CommonSettings
from shared.streams import stream_for_subject

log = logging.getLogger("weir.bus")

HDR_MSG_ID = "Nats-Msg-Id"
HDR_REPROCESS = "Weir-Reprocess"
HDR_TYPE = "Weir-Type"
HDR_ERROR = "Weir-Error"
HDR_CONSUMER = "Weir-Consumer"
HDR_ORIGINAL_SUBJECT = "Weir-Original-Subject"
HDR_DELIVERIES = "Weir-Deliveries"
JSON = {"content-type": "application/json"}


async def connect(settings: CommonSettings, *, name: str, **kwargs: Any) -> NATS:
    """A plain nats-py connection, for tests and benchmarks that play a server's part; services use their broker's
    connection, and tools `shared.messaging.tool_broker`."""
    servers = [s.strip() for s in settings.nats_url.split(",") if s.strip()]
    options: dict[str, Any] = {"name": f"weir-{name}", "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5,
                               **natsconn.connect_options(settings, name)}
    nc: NATS = await nats.connect(servers=servers, **(options | kwargs))
    try:
        natsconn.require_tls(settings, nc)
    except natsconn.BusConfigError:
        await nc.close()
        raise
    return nc


REPLAY_ADDRESS = replay_subject("{consumer}", "{event_type}")  # the replay publisher's subject, in AsyncAPI terms


async def subscriptions_in_place(nc: NATS) -> None:
    """Returns once the server has every subscription this connection made so far.

    One `nc.flush()` is not enough: nats-py writes its PING straight to the socket, ahead of commands still waiting
    for its flusher task (a SUB just made), so the PONG can come back before the server has the SUB. By the time it
    does, the flusher has written the SUB, so a second PING goes after it."""
    await nc.flush()
    await nc.flush()


# --------------------------------------------------------------------------------------------- outbox


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
            "INSERT INTO outbox (id, subject, payload, traceparent) VALUES ($1, $2, $3, $4)",
            ev.id, ev.type, ev.to_bytes(), ev.traceparent,
        )
        return
    await conn.execute(
        "INSERT INTO outbox (id, subject, payload, traceparent)"
        " SELECT * FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::text[])",
        [ev.id for ev in events], [ev.type for ev in events], [ev.to_bytes() for ev in events],
        [ev.traceparent for ev in events],
    )


class Outgoing(NamedTuple):
    """One message for JetStream: its subject and body, its `Nats-Msg-Id`, and any further headers; `span`: the span
    it is published under (the relay's for an outbox row), which its publish's own spans and headers descend from."""

    subject: str
    payload: bytes
    msg_id: str
    headers: Mapping[str, str] | None = None
    span: Span | None = None


class EventPublishers:
    """The service's FastStream publishers: one per event type it publishes, declared on its broker, so its AsyncAPI
    document lists each subject with the catalog's schema (`Event[M]`); with `replay`, also the publisher of
    `replay.<consumer>.<type>` (the copies `weir replay` sends a consumer: the envelope as stored).

    Every publish is a JetStream publish: it carries a reply subject on this object's own inbox, where JetStream
    answers with the PubAck (or its refusal), and a row counts as published only once its PubAck is there. That is
    what nats-py's `publish_async` does; FastStream's stream-named publish instead awaits each PubAck as its own
    request, at three times the CPU per event (measured: 30-40 us against 95-100 us), which the relay's drain rate
    would pay. A type nobody declared is still published, through the broker, with a warning: an event in the outbox
    is never held back for want of a declaration."""

    def __init__(self, broker: NatsBroker, event_types: Iterable[str] = (), *, timeout: float,
                 replay: bool = False, watch: ConnectionWatch | None = None) -> None:
        self.broker = broker
        self.timeout = timeout
        self.watch = watch  # a subject the server refuses this identity fails its rows at once, with the reason
        self._by_type: dict[str, LogicPublisher] = {}
        self._replay: LogicPublisher | None = None
        self._warned: set[str] = set()
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        self._inbox: str | None = None
        self._next = 0
        for event_type in event_types:
            model = CATALOG[event_type]
            self._by_type[event_type] = broker.publisher(
                event_type,
                timeout=timeout,
                schema=Event[model],  # type: ignore[valid-type]
                title=event_type,
                description=f"{(model.__doc__ or '').strip()} Published from the outbox into stream "
                f"{stream_for_subject(event_type).name}, acknowledged by JetStream; `Nats-Msg-Id` is the event id.",
            )
        if replay:
            self._replay = broker.publisher(
                REPLAY_ADDRESS,
                timeout=timeout,
                schema=Envelope,
                title=REPLAY_ADDRESS,
                description=f"`weir replay`: a stored event again, as it was stored, for one consumer (its durable "
                f"name) into stream {REPLAY_STREAM}, acknowledged by JetStream. Headers: `{HDR_TYPE}` (the event "
                f"type), `{HDR_REPROCESS}` (1: run the handler again even if the inbox has the event), "
                f"`{HDR_MSG_ID}`.",
            )

    @property
    def event_types(self) -> list[str]:
        return list(self._by_type)

    async def publish(self, subject: str, payload: bytes, msg_id: str,
                      headers: Mapping[str, str] | None = None) -> PubAck:
        """One event, published once JetStream acknowledges it (raises why not, otherwise)."""
        (result,) = await self.publish_in_order([Outgoing(subject, payload, msg_id, headers)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def publish_in_order(self, rows: Sequence[Outgoing]) -> list[PubAck | BaseException]:
        """Publish the rows one after the other (so in row order on the wire), then wait for all their PubAcks
        together, up to the timeout; each result is its PubAck or why there is none."""
        inbox = await self._ack_inbox()
        loop = asyncio.get_running_loop()
        results: list[PubAck | BaseException] = []
        waiting: dict[int, tuple[str, asyncio.Future[Msg]]] = {}
        try:
            for index, row in enumerate(rows):
                self._next += 1
                token = str(self._next)
                future: asyncio.Future[Msg] = loop.create_future()
                self._acks[token] = future
                try:
                    await self._send(row, reply_to=f"{inbox}.{token}")
                except Exception as exc:
                    self._acks.pop(token, None)
                    results.append(exc)
                    continue
                waiting[index] = token, future
                if self.watch is not None:
                    self.watch.fail_waiting(row.subject, future)
                results.append(_NO_ACK_YET)
            if waiting:
                await asyncio.wait([f for _, f in waiting.values()], timeout=self.timeout)
            for index, (_, future) in waiting.items():
                results[index] = _pub_ack(future) if future.done() else TimeoutError(
                    f"no PubAck within {self.timeout} s")
        finally:
            for index, (token, future) in waiting.items():
                self._acks.pop(token, None)
                if self.watch is not None:
                    self.watch.forget(rows[index].subject, future)
        return results

    def _publisher(self, subject: str) -> LogicPublisher | None:
        publisher = self._by_type.get(subject)
        if publisher is None and subject.startswith(REPLAY_PREFIX):
            return self._replay
        return publisher

    async def _send(self, row: Outgoing, *, reply_to: str) -> None:
        if row.span is None:
            await self._send_now(row, reply_to=reply_to)
            return
        # FastStream's telemetry middleware takes the current context as the publish's parent
        token = otel_context.attach(trace.set_span_in_context(row.span))
        try:
            await self._send_now(row, reply_to=reply_to)
        finally:
            otel_context.detach(token)

    async def _send_now(self, row: Outgoing, *, reply_to: str) -> None:
        subject, payload, msg_id = row.subject, row.payload, row.msg_id
        headers = {**JSON, **(row.headers or {}), HDR_MSG_ID: msg_id}
        publisher = self._publisher(subject)
        if publisher is None:
            if subject not in self._warned:
                self._warned.add(subject)
                log.warning("publishing %s, which this service does not declare (its AsyncAPI document lacks it)",
                            subject)
            await self.broker.publish(payload, subject, headers=headers, reply_to=reply_to, correlation_id=msg_id)
            return
        # subject and correlation id given: FastStream then neither renders its address template nor makes an id
        await publisher.publish(payload, subject, headers=headers, reply_to=reply_to, correlation_id=msg_id)

    async def _ack_inbox(self) -> str:
        if self._inbox is None:
            nc = self.broker.connection
            inbox = nc.new_inbox()
            # subscribed before any publish that names it: the SUB goes to the server ahead of those PUBs
            await nc.subscribe(f"{inbox}.*", cb=self._on_ack)
            self._inbox = inbox
        return self._inbox

    async def _on_ack(self, msg: Msg) -> None:
        future = self._acks.pop(msg.subject.rsplit(".", 1)[1], None)
        if future is not None and not future.done():
            future.set_result(msg)


_NO_ACK_YET = TimeoutError("not acknowledged yet")


def _pub_ack(future: asyncio.Future[Msg]) -> PubAck | BaseException:
    """JetStream's answer to one publish: its PubAck, or the error (no stream captures the subject, a refusal)."""
    if future.exception() is not None:  # refused before any answer (natsconn.PermissionRefused)
        return cast(BaseException, future.exception())
    msg = future.result()
    if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
        return NoStreamResponseError()
    try:
        answer = json.loads(msg.data)
        if "error" in answer:
            APIError.from_error(answer["error"])  # raises the error's own class
        return api.PubAck.from_response(answer)
    except Exception as exc:
        return exc


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
    publish_timeout: float = 5.0  # unused: the publishers' own timeout applies (shared/runtime.py still passes it)
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
                "SELECT seq, id, subject, payload, traceparent FROM outbox WHERE sent_at IS NULL"
                " ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
                self.batch_size,
            )
            if not rows:
                return 0
            ids = [str(r["id"]) for r in rows]
            if self.hooks:
                await self.hooks.after_select(ids)
            results = await self._publish(rows)
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

    async def _publish(self, rows: list[asyncpg.Record]) -> list[PubAck | BaseException]:
        if not tracing.enabled():
            return await self.publishers.publish_in_order(
                [Outgoing(r["subject"], bytes(r["payload"]), str(r["id"])) for r in rows]
            )
        spans = [self._relay_span(r) for r in rows]
        try:
            results = await self.publishers.publish_in_order(
                [Outgoing(r["subject"], bytes(r["payload"]), str(r["id"]), span=span) for r, span in zip(
                    rows, spans, strict=True)]
            )
        except BaseException as exc:
            for span in spans:
                tracing.failed(span, exc)
                span.end()
            raise
        for span, result in zip(spans, results, strict=True):
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

EventHandler = Callable[[asyncpg.Connection, Any], Awaitable[None]]
"""`async def handler(conn, event: Event[M]) -> None` (or a union of `Event[...]`): its effects, in `conn`'s
transaction, which also records the event in the inbox."""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer of one service: its name and its handler, whose event annotation says what it consumes.

    The subjects are the event types the handler takes, and the stream the one that stores them."""

    name: str  # durable name; also the inbox key and the replay subject token (no dots)
    handler: EventHandler
    description: str = ""
    models: tuple[type[EventData], ...] = field(init=False)
    stream: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ".*> "):
            raise ValueError(f"consumer name must be a plain token: {self.name!r}")
        models = event_models(_event_annotation(self.handler))
        streams = {stream_for_subject(m.event_type).name for m in models}
        if len(streams) != 1:
            raise ValueError(f"consumer {self.name} reads events of several streams ({sorted(streams)}): split it")
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "stream", streams.pop())

    @property
    def subjects(self) -> tuple[str, ...]:
        return tuple(m.event_type for m in self.models)


def _event_annotation(handler: EventHandler) -> Any:
    """The annotation of the handler's event parameter (its second)."""
    target = handler.func if isinstance(handler, functools.partial) else handler
    hints = get_type_hints(target)
    params = list(inspect.signature(handler).parameters)
    if len(params) < 2 or params[1] not in hints:
        raise ValueError(f"{handler!r} must be `async def (conn, event: Event[M]) -> None`")
    return hints[params[1]]


class HandlerOutcome:
    HANDLED = "handled"
    DUPLICATE = "duplicate"
    RETRY = "retry"
    PARKED = "parked"
    INVALID = "invalid"


class Source(NamedTuple):
    """One durable a consumer reads: its main stream, or REPLAY."""

    stream: str
    durable: str
    subjects: list[str]


class Admission(BaseMiddleware):
    """Each message of a fetched batch is validated as the consumer's `Event[...]` (JSON mode) before the handler
    sees the batch; one that fails is parked on `dlq.<type>` with the validation error at once and acknowledged,
    and the rest of the batch goes on (FastStream would otherwise fail the whole `list[...]`)."""

    def __init__(self, msg: Any, /, *, context: Any, consumer: EventConsumer) -> None:
        super().__init__(msg, context=context)
        self.consumer = consumer

    async def consume_scope(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        return await self.consumer.admit(call_next, msg)


class PromptBatchPullSubscriber(BatchPullStreamSubscriber):
    """FastStream 0.7.8's batch pull subscriber with its fetch loop as it was before 0.7.8 (and as the hand-built
    consumer had it): each batch is what one fetch returns. Two things in 0.7.8's loop do not fit a consumer that
    keeps order and latency:
    - it fetches again until the batch is full or `PullSub.timeout` has passed, so a lone event waits the timeout
      (measured: p50 = 0.56 s with a 1 s timeout), and a short timeout means polling all the time when idle;
    - nats-py ends some fetches with a bare `asyncio.TimeoutError` (when its deadline passes between its two pull
      requests), which that loop does not catch: the task dies and restarts, and the messages it had collected so
      far stay unacknowledged until the ack wait, while later events of the same entities go ahead of them.
    nats-py's fetch already returns as soon as messages are there; a fetch that finds none waits `timeout` on the
    server. And a service whose stream is not there yet (before `weir streams apply`) still starts: the subscriber
    binds once it can. Everything else (middlewares, decoding, validation, AsyncAPI) is FastStream's own.
    """

    __slots__ = ()

    async def _create_subscription(self) -> None:
        if not self.subscription:
            self.add_task(self._consume_pull)

    async def _bind(self) -> bool:
        """Bind to the durable (made by `EventConsumer.ensure`, or here with the same config if it is missing)."""
        failure = ""
        while self.running:
            try:
                self.subscription = await self.jetstream.pull_subscribe(
                    subject=self.subject.broker_address, config=self.config, **self.extra_options)
            except Exception as exc:  # the stream is missing, or the server away: the rest of the service runs
                if repr(exc) != failure:
                    failure = repr(exc)
                    log.warning("consumer %s cannot bind yet (%s); trying every %s s",
                                self.config.durable_name, failure, self.pull_sub.timeout)
                await asyncio.sleep(self.pull_sub.timeout or 1.0)
                continue
            if failure:
                log.warning("consumer %s bound", self.config.durable_name)
            return True
        return False

    async def _consume_pull(self) -> None:
        if not self.subscription and not await self._bind():
            return
        assert self.subscription
        while self.running:
            try:
                messages = await self.subscription.fetch(batch=self.pull_sub.batch_size,
                                                         timeout=self.pull_sub.timeout)
            except TimeoutError:  # nats-py's TimeoutError is an asyncio.TimeoutError too: nothing came
                continue
            except Exception as exc:  # disconnected, the durable gone...: nothing was taken; try again shortly
                if self.running:
                    log.warning("pull on %s: %r; trying again", self.config.durable_name, exc)
                    await asyncio.sleep(self.pull_sub.timeout or 1.0)
                continue
            if messages and self.running:
                await self.consume(messages)


async def _admitted_events(msg: StreamMessage[Any]) -> Any:
    """The batch's decoder: `Admission` already validated each message into its event."""
    return msg.body


class EventConsumer:
    """Runs one `ConsumerSpec` on a service's broker (see the module docstring)."""

    def __init__(
        self,
        spec: ConsumerSpec,
        *,
        pool: asyncpg.Pool,
        settings: CommonSettings,
        metrics: Metrics | None = None,
        after_commit: Callable[[list[Event[Any]]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.after_commit = after_commit  # observers of what was applied (lag metrics, benchmarks)
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.event_type: Any = event_union(spec.models)
        self._adapter: TypeAdapter[Any] = TypeAdapter(self.event_type)
        self.broker: NatsBroker | None = None
        self._dlq: dict[str, LogicPublisher] = {}
        self._inflight: set[asyncio.Task[None]] = set()
        self._lane_tail: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(settings.consumer_concurrency)
        if metrics is not None:  # every outcome's series from the start, so that rates are right from the first
            for outcome in (HandlerOutcome.HANDLED, HandlerOutcome.DUPLICATE, HandlerOutcome.RETRY,
                            HandlerOutcome.PARKED, HandlerOutcome.INVALID):
                metrics.inc("consumer_messages_total", 0, consumer=spec.name, outcome=outcome)
            metrics.inc("consumer_redelivered_total", 0, consumer=spec.name)

    # --- wiring

    def sources(self) -> list[Source]:
        return [
            Source(self.spec.stream, self.spec.name, list(self.spec.subjects)),
            Source(REPLAY_STREAM, replay_durable(self.spec.name), [replay_filter(self.spec.name)]),
        ]

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

    def register(self, broker: NatsBroker, *, inbox: str | None = None) -> None:
        """Declare the subscribers (main and replay) and the dead-letter publishers on the broker (before it starts).

        The subscribers bind to the durables `ensure` made; they never declare a stream. `inbox`: the identity's
        reply inbox prefix (shared/natsconn.py), where their pulls' messages come; FastStream's pull subscriber does
        not take the broker's own (`_INBOX.` unless told)."""
        pull_inbox = f"{inbox}.".encode() if inbox else api.INBOX_PREFIX
        self.broker = broker
        router = NatsRouter(middlewares=(functools.partial(Admission, consumer=self),))
        for event_type in self.spec.subjects:
            self._dlq[event_type] = router.publisher(
                dlq_subject(event_type), stream=no_declare(DLQ_STREAM),
                timeout=self.settings.bus_publish_timeout_seconds, title=f"{self.spec.name}:{dlq_subject(event_type)}",
                description=f"{event_type} events {self.spec.name} could not handle: the message as received, "
                f"the error in `{HDR_ERROR}`, deliveries in `{HDR_DELIVERIES}`",
            )
        for source in self.sources():
            subscriber = router.subscriber(
                # one subject, or the filter subjects: a channel each in the document
                source.subjects[0] if len(source.subjects) == 1 else "",
                stream=no_declare(source.stream),
                durable=source.durable,
                config=self.consumer_config(durable=source.durable, subjects=source.subjects),
                pull_sub=PullSub(batch_size=self.settings.consumer_batch,
                                 timeout=self.settings.consumer_fetch_wait_seconds, batch=True),
                ack_policy=AckPolicy.MANUAL,  # acked per message, after its lane's commit
                decoder=_admitted_events,
                title=source.durable,
                inbox_prefix=pull_inbox,
                description=(self.spec.description or f"durable consumer {self.spec.name}")
                + ". Each message is one event; the handler takes them in batches.",
            )
            assert type(subscriber) is BatchPullStreamSubscriber, type(subscriber)
            subscriber.__class__ = PromptBatchPullSubscriber  # see its docstring: FastStream's own, one loop changed
            subscriber(self._intake(source.durable))
        broker.include_router(router)

    def _intake(self, durable: str) -> Callable[..., Awaitable[None]]:
        async def intake(events: list[Any], message: NatsMessage) -> None:
            await self.dispatch(cast(list[Msg], message.raw_message), events)

        intake.__name__ = intake.__qualname__ = durable
        # the handler's signature is the contract: FastStream validates and documents `list[Event[...]]`
        intake.__annotations__ = {"events": list.__class_getitem__(self.event_type), "message": NatsMessage,
                                  "return": None}
        return intake

    async def ensure(self, js: JetStreamContext) -> None:
        """Create the durable consumers (main and replay) if missing; consumers belong to their service."""
        for source in self.sources():
            try:
                await js.consumer_info(source.stream, source.durable)
            except NotFoundError:
                await js.add_consumer(source.stream,
                                      self.consumer_config(durable=source.durable, subjects=source.subjects))

    async def ensure_if_possible(self, js: JetStreamContext) -> bool:
        """`ensure`, but a service whose streams are not applied yet still starts: its subscribers bind later."""
        try:
            await self.ensure(js)
        except Exception as exc:
            log.warning("consumer %s: its durables cannot be made now (%r); its subscribers bind when they can",
                        self.spec.name, exc)
            return False
        return True

    async def refresh_metrics(self, js: JetStreamContext) -> None:
        """Pending and ack-pending messages of each durable, from JetStream's consumer info (a durable not made yet
        is skipped: its service started before `weir streams apply`)."""
        if self.metrics is None:
            return
        for source in self.sources():
            try:
                info = await js.consumer_info(source.stream, source.durable)
            except NotFoundError:
                continue
            self.metrics.set("consumer_pending", info.num_pending or 0, consumer=self.spec.name,
                             durable=source.durable)
            self.metrics.set("consumer_ack_pending", info.num_ack_pending or 0, consumer=self.spec.name,
                             durable=source.durable)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for in-flight lanes (SIGTERM: finish what was started, take nothing new)."""
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=timeout or self.settings.shutdown_grace_seconds)

    # --- admission: what reaches the handler

    async def admit(self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]) -> Any:
        raws: list[Msg] = msg.raw_message
        kept: list[Msg] = []
        events: list[Any] = []
        if self.metrics:
            again = sum(1 for raw in raws if raw.metadata.num_delivered > 1)
            if again:
                self.metrics.inc("consumer_redelivered_total", again, consumer=self.spec.name)
        for raw in raws:
            try:
                events.append(self._adapter.validate_json(raw.data))
            except ValidationError as exc:
                await self._refuse(raw, exc)
                continue
            kept.append(raw)
        if len(kept) != len(raws):
            msg.raw_message = kept
            msg.batch_headers = [m.headers or {} for m in kept]
        msg.body = events
        msg.clear_cache()
        if not events:
            return None
        return await call_next(msg)

    async def _refuse(self, msg: Msg, exc: ValidationError) -> None:
        """Data that does not fit the model never will: parked at once, not retried (SPEC 9)."""
        error = f"{MalformedEvent.__name__}: {_summary(exc)}"
        deliveries = msg.metadata.num_delivered
        try:
            await self._park(msg, _type_from_subject(msg.subject), error, deliveries, event_id=None)
            await msg.ack()
        except Exception as park_failed:  # the DLQ cannot take it now: it comes back and is parked then
            log.warning("consumer %s: parking an invalid %s failed: %s", self.spec.name, msg.subject, park_failed)
            await msg.nak(delay=self.settings.consumer_nak_delay_seconds)
            return
        self._count(HandlerOutcome.INVALID)

    # --- lanes

    async def dispatch(self, msgs: list[Msg], events: list[Any]) -> None:
        """Split a fetched batch into lanes by entity; each lane's part is applied in one transaction.

        Events about one entity always take the same lane, and a lane's work waits for that lane's previous
        work, so they are handled in the order they were stored; different lanes run side by side. Returns once
        the lanes are under way (at most `consumer_concurrency` of them), so the next batch is pulled meanwhile.
        """
        lanes: dict[int, list[tuple[Msg, Event[Any]]]] = {}
        for msg, event in zip(msgs, events, strict=True):
            lanes.setdefault(hash(event.subject) % self.settings.consumer_lanes, []).append((msg, event))
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

    async def _run_lane(self, items: list[tuple[Msg, Event[Any]]], previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its own failures are its own (it logs them); only its order matters
        try:
            if len(items) > 1 and not any(_reprocess(msg) for msg, _ in items):
                try:
                    await self._apply_together(items)
                except Exception as exc:
                    log.info("consumer %s: %d events failed together (%s: %s); applying them one at a time",
                             self.spec.name, len(items), type(exc).__name__, exc)
                else:
                    await asyncio.gather(*(msg.ack() for msg, _ in items))
                    return
            for msg, event in items:
                await self.handle(msg, event)
        except Exception:
            log.exception("consumer %s: unexpected failure (the lane's messages come back after the ack wait)",
                          self.spec.name)

    async def _apply_together(self, items: list[tuple[Msg, Event[Any]]]) -> None:
        """Effects of several events and their inbox records in one transaction (all or nothing)."""
        events = [event for _, event in items]
        with self._timed():
            applied = await self._apply_all(items)
        self._count(HandlerOutcome.HANDLED, len(applied))
        self._count(HandlerOutcome.DUPLICATE, len(events) - len(applied))
        if self.after_commit and applied:
            self.after_commit(applied)

    async def _apply_all(self, items: list[tuple[Msg, Event[Any]]]) -> list[Event[Any]]:
        events = [event for _, event in items]
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "INSERT INTO inbox (consumer, event_id, event_type)"
                " SELECT $1, * FROM unnest($2::uuid[], $3::text[]) ON CONFLICT DO NOTHING RETURNING event_id::text",
                self.spec.name,
                [e.id for e in events],
                [e.type for e in events],
            )
            fresh = {r[0] for r in rows}
            applied: list[Event[Any]] = []
            for msg, event in items:
                if event.id in fresh:
                    fresh.discard(event.id)  # a copy later in the same batch is a duplicate
                    with logs.EventContext(event.id), self._span(msg, event):
                        await self.spec.handler(conn, event)
                    applied.append(event)
        return applied

    async def handle(self, msg: Msg, event: Event[Any]) -> str:
        """Handle one delivery: effects and inbox in one transaction, then ack; NAK or park on failure."""
        with logs.EventContext(event.id), self._span(msg, event) as span:
            deliveries = msg.metadata.num_delivered
            try:
                outcome = await self._apply(event, reprocess=_reprocess(msg))
            except Exception as exc:
                tracing.failed(span, exc)
                # the database away is waited out (delivered again and again, never parked): it says nothing about
                # the event, and parking would lose what the handler would have done once the database is back
                if deliveries >= self.settings.consumer_max_deliver and not db.database_away(exc):
                    await self._park(msg, event.type, f"{type(exc).__name__}: {exc}", deliveries, event_id=event.id)
                    await msg.ack()
                    self._count(HandlerOutcome.PARKED)
                    span.set_attribute("weir.outcome", HandlerOutcome.PARKED)
                    return HandlerOutcome.PARKED
                log.warning("consumer %s: delivery %d of %s failed: %s", self.spec.name, deliveries, event.id, exc)
                await msg.nak(delay=self.settings.consumer_nak_delay_seconds)
                self._count(HandlerOutcome.RETRY)
                span.set_attribute("weir.outcome", HandlerOutcome.RETRY)
                return HandlerOutcome.RETRY
            await msg.ack()
            self._count(outcome)
            span.set_attribute("weir.outcome", outcome)
            return outcome

    def _span(self, msg: Msg, event: Event[Any]) -> contextlib.AbstractContextManager[Span]:
        """The span of one delivery's handling (shared/tracing.py): in the trace the message carries; a replayed
        event's links to its original trace."""
        if not tracing.enabled():
            return _NO_SPAN
        replayed = msg.subject.startswith(REPLAY_PREFIX)
        return tracing.handling_span(
            f"{event.type} process", headers=msg.headers, envelope_traceparent=event.traceparent, replayed=replayed,
            video_id=tracing.video_id_of(event.type, event.subject),
            attributes={tracing.EVENT_ID: event.id, "messaging.system": "nats",
                        "messaging.consumer.group.name": self.spec.name, "messaging.destination.name": msg.subject,
                        "messaging.message.id": event.id, "weir.deliveries": msg.metadata.num_delivered,
                        "weir.replayed": replayed},
        )

    async def _apply(self, event: Event[Any], *, reprocess: bool) -> str:
        with self._timed():
            return await self._apply_one(event, reprocess=reprocess)

    async def _apply_one(self, event: Event[Any], *, reprocess: bool) -> str:
        async with self.pool.acquire() as conn, conn.transaction():
            first = await conn.fetchval(
                "INSERT INTO inbox (consumer, event_id, event_type) VALUES ($1, $2, $3)"
                " ON CONFLICT (consumer, event_id) DO UPDATE SET times = inbox.times + 1,"
                " handled_at = now() WHERE $4 RETURNING times = 1",
                self.spec.name,
                event.id,
                event.type,
                reprocess,
            )
            if first is None:  # handled before, and no reprocess asked: nothing changes twice
                return HandlerOutcome.DUPLICATE
            await self.spec.handler(conn, event)
        if self.after_commit:
            self.after_commit([event])
        return HandlerOutcome.HANDLED

    async def _park(self, msg: Msg, event_type: str, error: str, deliveries: int, *, event_id: str | None) -> None:
        """The message as received on `dlq.<type>`, with why and how often in its headers (JetStream-acked)."""
        meta = msg.metadata
        headers = {
            HDR_MSG_ID: f"dlq-{self.spec.name}-{event_id or f'{meta.stream}-{meta.sequence.stream}'}",
            HDR_ERROR: error[:2000],
            HDR_CONSUMER: self.spec.name,
            HDR_ORIGINAL_SUBJECT: msg.subject,
            HDR_DELIVERIES: str(deliveries),
        }
        subject = dlq_subject(event_type)
        publisher = self._dlq.get(event_type)
        if publisher is not None:
            await publisher.publish(msg.data, headers=headers)
        else:  # a type the handler does not take (an older durable's wider filter): parked all the same
            assert self.broker is not None, "register the consumer on a broker first"
            await self.broker.publish(msg.data, subject, headers=headers, stream=DLQ_STREAM,
                                      timeout=self.settings.bus_publish_timeout_seconds)
        log.error("consumer %s: parked %s on %s: %s", self.spec.name, msg.subject, subject, error[:300])

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """The handler transaction's duration, whether it commits or fails."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.metrics:
                self.metrics.observe("consumer_handler_seconds", time.perf_counter() - started,
                                     consumer=self.spec.name)

    def _count(self, outcome: str, n: int = 1) -> None:
        if self.metrics and n:
            self.metrics.inc(
                "consumer_messages_total", n, help="messages by consumer and outcome",
                consumer=self.spec.name, outcome=outcome,
            )


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)  # tracing off: reusable, as nullcontext is


def _reprocess(msg: Msg) -> bool:
    return bool(msg.headers and msg.headers.get(HDR_REPROCESS) == "1")


def _type_from_subject(subject: str) -> str:
    if subject.startswith(REPLAY_PREFIX):
        return subject.split(".", 2)[2]
    return subject


def _summary(error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in item["loc"]) or "(the whole message)"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


__all__ = [
    "ConsumerSpec",
    "Envelope",
    "Event",
    "EventConsumer",
    "EventHandler",
    "EventPublishers",
    "HandlerOutcome",
    "MalformedEvent",
    "OutboxRelay",
    "Outgoing",
    "connect",
    "enqueue",
    "replay_subject",
]
