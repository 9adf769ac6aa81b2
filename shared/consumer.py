"""Durable event consumers. A `ConsumerSpec` names a consumer and its handler, whose event annotation says what it
consumes; `EventConsumer` runs it on JetStream's pull protocol (`shared.pull.DurablePull`: its durable, and
`<name>_replay` on REPLAY), and declares it as FastStream subscribers for the AsyncAPI document. An event's effects
and its inbox record commit in one transaction, so redeliveries and replays change nothing twice; events about one
entity are applied in the order they were stored. Failures are NAKed with a delay and parked on `dlq.<type>` after
`consumer_max_deliver` deliveries; data that does not validate is parked at once."""

# No `from __future__ import annotations`: each consumer's declared handler is annotated with its own event type,
# which FastStream reads from the function (it documents the contract).
import asyncio
import collections
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, get_type_hints

import asyncpg
from faststream import AckPolicy
from faststream.nats import NatsBroker, PullSub
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.trace import Span
from pydantic import TypeAdapter, ValidationError

from shared import db, logs, tracing
from shared.bus import (
    HDR_CONSUMER,
    HDR_DELIVERIES,
    HDR_ERROR,
    HDR_LEGACY_COPY,
    HDR_MSG_ID,
    HDR_ORIGINAL_SUBJECT,
    HDR_REPROCESS,
    HDR_VERSION,
    sender_version,
)
from shared.contracts import (
    CONSUMERS,
    DLQ_STREAM,
    REPLAY_PREFIX,
    REPLAY_STREAM,
    consumed_by,
    contract,
    event_subjects,
    origin_of,
    replay_durable,
    replay_filter,
)
from shared.events import Event, EventData, MalformedEvent, dlq_subject, event_models, event_union
from shared.events.envelope import validation_summary
from shared.messaging import no_declare
from shared.metrics import Metrics
from shared.publishers import publish_acked
from shared.pull import DurablePull, Source
from shared.settings import CommonSettings
from shared.streams import stream_for_type

log = logging.getLogger("weir.bus")

EventHandler = Callable[..., Awaitable[None]]
"""`async def handler(conn, event: Event[M]) -> None` (or a union of `Event[...]`): its effects, in `conn`'s
transaction, which also records the event in the inbox. A third parameter, if any, gets the subject the event was
published on (a replayed copy's original one): the one part of a message its publisher's NATS rights vouch for."""


class Refused(Exception):
    """Raised by a handler: the event is wrong and always will be (not retried): parked at once, with this reason,
    and told to the consumer's `on_park` (its publisher's feedback). `code`: stable, for programs."""

    def __init__(self, reason: str, code: str = "refused") -> None:
        super().__init__(reason)
        self.code = code


class NotYet(Exception):
    """Raised by a handler: the event cannot be decided yet (it waits for another event to be read); delivered
    again after `retry_in` seconds and never parked for its number of deliveries: the handler bounds the wait."""

    def __init__(self, reason: str, retry_in: float) -> None:
        super().__init__(reason)
        self.retry_in = retry_in


OnPark = Callable[[str, "str | None", str, str], Awaitable[None]]
"""`on_park(original subject, event id or None, reason, code)`: after a message was parked (code `malformed` for
one that does not validate, `failing` for one whose handler kept failing, else the handler's `Refused.code`)."""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer of one service: its name and its handler, whose event annotation says what it consumes
    (the subjects are those event types; the stream, the one that stores them)."""

    name: str  # durable name; also the inbox key and the replay subject token (no dots)
    handler: EventHandler
    description: str = ""
    on_park: OnPark | None = None
    after_commit: Callable[[list[Event[Any]]], None] | None = None  # told what each transaction applied, after it
    models: tuple[type[EventData], ...] = field(init=False)
    stream: str = field(init=False)
    wants_origin: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ".*> "):
            raise ValueError(f"consumer name must be a plain token: {self.name!r}")
        models = event_models(_event_annotation(self.handler))
        streams = {stream_for_type(m.event_type).name for m in models}
        if len(streams) != 1:
            raise ValueError(f"consumer {self.name} reads events of several streams ({sorted(streams)}): split it")
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "stream", streams.pop())
        object.__setattr__(self, "wants_origin", len(inspect.signature(self.handler).parameters) >= 3)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(m.event_type for m in self.models)

    @property
    def subjects(self) -> tuple[str, ...]:
        """Its durable's filter: each type's account subject and, while the contract keeps it, the bare type."""
        return event_subjects(self.types)


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


class EventConsumer:
    """Runs one `ConsumerSpec` on a service's broker.

    Each delivery joins the lane of its entity (`consumer_lanes`); a lane applies what it has queued together, in
    one transaction (one at a time if that fails), so events about one entity keep their order and different
    entities run side by side. The pull goes on while lanes work, up to `consumer_concurrency` batches queued.
    `register` declares it, `ensure` makes its durables, `start` runs its pulls, `drain` stops them."""

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
        self.after_commit = after_commit or spec.after_commit  # observers of what was applied (a wake, lag, benches)
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.event_type: Any = event_union(spec.models)
        self._adapter: TypeAdapter[Any] = TypeAdapter(self.event_type)
        self.broker: NatsBroker | None = None
        self._inbox: bytes | None = None
        self._durables_made = False
        self._started = False
        self._pulls: list[DurablePull] = []
        self._binding: asyncio.Task[None] | None = None
        self._js: JetStreamContext | None = None
        self._queued: list[collections.deque[tuple[Msg, Event[Any]]]] = [
            collections.deque() for _ in range(settings.consumer_lanes)]
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._room = asyncio.Semaphore(settings.consumer_concurrency * settings.consumer_batch)
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
        return durable_config(durable, subjects, self.settings, self.spec.description)

    def register(self, broker: NatsBroker, *, inbox: str | None = None, document_only: bool = False,
                 document: NatsBroker | None = None) -> None:
        """Run the consumer on the broker's connection (`start`), and declare it for the AsyncAPI document: its
        dead-letter publishers and a subscriber per durable (main and replay), on `document` (none: not documented).
        `document_only`: the broker is a document's, nothing runs. `inbox`: the identity's reply inbox prefix,
        where its pulls' messages come (the connection's when None)."""
        if document_only:
            document = broker
        else:
            self.broker = broker
            self._inbox = f"{inbox}.".encode() if inbox else None
        if document is not None:
            self.declare(document)

    def declare(self, document: NatsBroker) -> None:
        """The consumer as FastStream declares it, for the AsyncAPI document only: its subscribers never run."""
        for event_type in self.spec.types:
            document.publisher(  # `_park` publishes
                dlq_subject(event_type), stream=no_declare(DLQ_STREAM),
                timeout=self.settings.bus_publish_timeout_seconds, title=f"{self.spec.name}:{dlq_subject(event_type)}",
                description=f"{event_type} events {self.spec.name} could not handle: the message as received, "
                f"the error in `{HDR_ERROR}`, deliveries in `{HDR_DELIVERIES}`",
            )
        for source in self.sources():
            subscriber = document.subscriber(
                # one subject, or the filter subjects: a channel each in the document
                source.subjects[0] if len(source.subjects) == 1 else "",
                stream=no_declare(source.stream),
                durable=source.durable,
                config=self.consumer_config(durable=source.durable, subjects=source.subjects),
                pull_sub=PullSub(batch_size=self.settings.consumer_batch,
                                 timeout=self.settings.consumer_fetch_wait_seconds),
                ack_policy=AckPolicy.MANUAL,  # acked per message, after its lane's commit
                title=source.durable,
                description=(self.spec.description or f"durable consumer {self.spec.name}")
                + ". Each message is one event.",
            )
            subscriber(self._documented(source.durable))

    def _documented(self, durable: str) -> Callable[..., Awaitable[None]]:
        event_type = self.event_type

        # the handler's signature is the contract FastStream documents; `DurablePull` runs the consumer
        async def documented(event: event_type) -> None:  # type: ignore[valid-type]
            raise RuntimeError(f"{durable} is declared for the document only")

        documented.__name__ = documented.__qualname__ = durable
        return documented

    def start(self) -> None:
        """Run the pulls (main and replay) once the durables exist (`ensure`, now or when they can be made)."""
        self._started = True
        self._start_pulls()

    def _start_pulls(self) -> None:
        if self._pulls or not (self._started and self._durables_made):
            return
        assert self.broker is not None, "register the consumer on a broker first"
        for source in self.sources():
            pull = DurablePull(self.broker.connection, source, inbox=self._inbox, batch=self.settings.consumer_batch,
                               wait=self.settings.consumer_fetch_wait_seconds, deliver=self.intake)
            pull.start()
            self._pulls.append(pull)

    def _jetstream(self) -> JetStreamContext:
        if self._js is None:
            assert self.broker is not None, "register the consumer on a broker first"
            self._js = self.broker.connection.jetstream()
        return self._js

    async def ensure(self, js: JetStreamContext) -> None:
        """Create the durable consumers (main and replay) if missing; consumers belong to their service."""
        for source in self.sources():
            await make_or_widen(js, source.stream, self.consumer_config(durable=source.durable,
                                                                         subjects=source.subjects))
        self._durables_made = True
        self._start_pulls()

    async def ensure_if_possible(self, js: JetStreamContext) -> bool:
        """`ensure`, but a service whose streams are not applied yet still starts: its pulls begin later."""
        try:
            await self.ensure(js)
        except Exception as exc:
            log.warning("consumer %s: its durables cannot be made now (%r); its pulls begin when they can",
                        self.spec.name, exc)
            self._binding = asyncio.create_task(self._bind_later(js), name=f"bind-{self.spec.name}")
            return False
        return True

    async def _bind_later(self, js: JetStreamContext) -> None:
        while True:
            await asyncio.sleep(self.settings.consumer_fetch_wait_seconds)
            try:
                await self.ensure(js)
            except Exception:
                continue
            break
        log.warning("consumer %s bound", self.spec.name)

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
        """Stop the pulls and wait for the lanes to finish what they took (SIGTERM: finish what was started, take
        nothing new)."""
        if self._binding is not None:
            self._binding.cancel()
        grace = timeout or self.settings.shutdown_grace_seconds
        await asyncio.gather(*(pull.stop(grace) for pull in self._pulls))
        if self._workers:
            await asyncio.wait(list(self._workers.values()),
                               timeout=timeout or self.settings.shutdown_grace_seconds)

    # --- intake: what reaches the lanes

    async def intake(self, messages: list[Msg]) -> None:
        """A fetch's messages, in order: each read as the catalog reads it (strict JSON, RFC 3339 datetimes) and
        queued on its lane; one that does not validate is parked at once and the rest go on."""
        for msg in messages:
            if msg.headers and msg.headers.get(HDR_LEGACY_COPY) == "1":
                # the same event is on its account subject, which this durable reads too: only older releases,
                # whose durables read the bare type alone, need this copy
                await msg.ack()
                self._count(HandlerOutcome.DUPLICATE)
                continue
            try:
                event = self._adapter.validate_json(msg.data)
            except ValidationError as exc:
                await self.refuse(msg, exc)
                continue
            await self.accept(msg, event)

    async def accept(self, msg: Msg, event: Event[Any]) -> None:
        """Queue one delivery on its entity's lane; returns once there is room, so the pull goes on meanwhile."""
        if self.metrics and msg.metadata.num_delivered > 1:
            self.metrics.inc("consumer_redelivered_total", 1, consumer=self.spec.name)
        lane = hash(event.subject) % self.settings.consumer_lanes
        self._queued[lane].append((msg, event))  # before any await: the order of deliveries is the order queued
        worker = self._workers.get(lane)
        if worker is None or worker.done():
            self._workers[lane] = asyncio.create_task(self._work_lane(lane))
        await self._room.acquire()

    async def refuse(self, msg: Msg, exc: ValidationError) -> None:
        """Data that does not fit the model never will: parked at once, not retried (SPEC 9)."""
        error = f"{MalformedEvent.__name__}: {validation_summary(exc, '(the whole message)')}"
        deliveries = msg.metadata.num_delivered
        try:
            await self._park(msg, _type_from_subject(msg.subject), error, deliveries, event_id=None)
            if self.spec.on_park is not None:
                await self.spec.on_park(origin(msg), _event_id_of(msg.data), error, "malformed")
            await msg.ack()
        except Exception as park_failed:  # the DLQ cannot take it now: it comes back and is parked then
            log.warning("consumer %s: parking an invalid %s failed: %s", self.spec.name, msg.subject, park_failed)
            await msg.nak(delay=self.settings.consumer_nak_delay_seconds)
            return
        self._count(HandlerOutcome.INVALID)

    # --- lanes

    async def _work_lane(self, lane: int) -> None:
        """Apply the lane's queue, what is there at each turn together (up to a batch), until it is empty."""
        queued = self._queued[lane]
        while queued:
            items = [queued.popleft() for _ in range(min(len(queued), self.settings.consumer_batch))]
            try:
                await self._run_lane(items)
            finally:
                for _ in items:
                    self._room.release()

    async def _run_lane(self, items: list[tuple[Msg, Event[Any]]]) -> None:
        try:
            if len(items) > 1 and not any(_reprocess(msg) for msg, _ in items):
                try:
                    applied = await self._apply_together(items)
                except Exception as exc:
                    log.info("consumer %s: %d events failed together (%s: %s); applying them one at a time",
                             self.spec.name, len(items), type(exc).__name__, exc)
                else:
                    await asyncio.gather(*(msg.ack() for msg, _ in items))
                    self._committed(applied)
                    return
            for msg, event in items:
                await self.handle(msg, event)
        except Exception:
            log.exception("consumer %s: unexpected failure (the lane's messages come back after the ack wait)",
                          self.spec.name)

    async def _apply_together(self, items: list[tuple[Msg, Event[Any]]]) -> list[Event[Any]]:
        """Effects of several events and their inbox records in one transaction (all or nothing)."""
        events = [event for _, event in items]
        with self._timed():
            applied = await self._apply_all(items)
        self._count(HandlerOutcome.HANDLED, len(applied))
        self._count(HandlerOutcome.DUPLICATE, len(events) - len(applied))
        return applied

    def _committed(self, applied: list[Event[Any]]) -> None:
        """Tells the observers what was applied, once committed and acknowledged (written to the connection before
        anything they do on it: a durable's ack floor they read then counts these)."""
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
                        await self._call(conn, msg, event)
                    applied.append(event)
        return applied

    async def handle(self, msg: Msg, event: Event[Any]) -> str:
        """Handle one delivery: effects and inbox in one transaction, then ack; NAK or park on failure."""
        with logs.EventContext(event.id), self._span(msg, event) as span:
            deliveries = msg.metadata.num_delivered
            try:
                outcome = await self._apply(msg, event, reprocess=_reprocess(msg))
            except Exception as exc:
                tracing.failed(span, exc)
                # the database away is waited out (delivered again and again, never parked): it says nothing about
                # the event, and parking would lose what the handler would have done once the database is back
                if isinstance(exc, NotYet):
                    await msg.nak(delay=exc.retry_in)
                    self._count(HandlerOutcome.RETRY)
                    span.set_attribute("weir.outcome", HandlerOutcome.RETRY)
                    return HandlerOutcome.RETRY
                refused = isinstance(exc, Refused)
                if refused or (deliveries >= self.settings.consumer_max_deliver and not db.database_away(exc)):
                    reason = str(exc) if refused else f"{type(exc).__name__}: {exc}"
                    await self._park(msg, event.type, reason, deliveries, event_id=event.id)
                    if self.spec.on_park is not None:
                        await self.spec.on_park(origin(msg), event.id, reason,
                                                exc.code if isinstance(exc, Refused) else "failing")
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
            if outcome == HandlerOutcome.HANDLED:
                self._committed([event])
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

    async def _apply(self, msg: Msg, event: Event[Any], *, reprocess: bool) -> str:
        with self._timed():
            return await self._apply_one(msg, event, reprocess=reprocess)

    async def _call(self, conn: asyncpg.Connection, msg: Msg, event: Event[Any]) -> None:
        token = _applying.set(msg)
        try:
            if self.spec.wants_origin:
                await self.spec.handler(conn, event, origin(msg))
            else:
                await self.spec.handler(conn, event)
        finally:
            _applying.reset(token)

    async def _apply_one(self, msg: Msg, event: Event[Any], *, reprocess: bool) -> str:
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
            await self._call(conn, msg, event)
        return HandlerOutcome.HANDLED

    async def _park(self, msg: Msg, event_type: str, error: str, deliveries: int, *, event_id: str | None) -> None:
        """The message as received on `dlq.<type>`, with why and how often in its headers (JetStream-acked)."""
        meta = msg.metadata
        headers = {
            HDR_MSG_ID: f"dlq-{self.spec.name}-{event_id or f'{meta.stream}-{meta.sequence.stream}'}",
            HDR_ERROR: error[:2000],
            HDR_CONSUMER: self.spec.name,
            # where its publisher published it (a replayed copy's original one): `weir dlq redrive` sends it back
            # with it, and with the release that wrote it
            HDR_ORIGINAL_SUBJECT: origin(msg),
            HDR_DELIVERIES: str(deliveries),
            HDR_VERSION: sender_version(msg.headers),
        }
        subject = dlq_subject(event_type)  # also for a type the handler does not take (an older, wider filter)
        await publish_acked(self._jetstream(), subject, msg.data, headers, stream=DLQ_STREAM,
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


def durable_config(durable: str, subjects: list[str], settings: CommonSettings,
                   description: str = "") -> api.ConsumerConfig:
    """A service's durable as its consumer makes it (and `weir streams apply`, for one not made yet)."""
    return api.ConsumerConfig(
        durable_name=durable,
        name=durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=settings.consumer_ack_wait_seconds,
        # parking is ours (after consumer_max_deliver); the server never drops a message silently
        max_deliver=-1,
        filter_subjects=subjects if len(subjects) > 1 else None,
        filter_subject=subjects[0] if len(subjects) == 1 else None,
        max_ack_pending=max(1000, settings.consumer_concurrency * 4),
        description=description or None,
    )


async def make_or_widen(js: JetStreamContext, stream: str, config: api.ConsumerConfig) -> str:
    """Make the durable if missing; else widen its filter to `config`'s subjects, never narrowing it (an instance of
    the release before may still read it): a durable of 1.0.0, on the bare types, then also reads the account
    subjects (SPEC 11), whichever release's instance pulls from it. Returns what was done ("" for nothing)."""
    durable = str(config.durable_name)
    wanted = config.filter_subjects or ([config.filter_subject] if config.filter_subject else [])
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        await js.add_consumer(stream, config)
        return f"created durable {durable}"
    held = info.config.filter_subjects or ([info.config.filter_subject] if info.config.filter_subject else [])
    if not held or not set(wanted) - set(held):
        return ""
    wider = list(held) + [s for s in wanted if s not in held]
    kept = info.config  # as it is (the server refuses changes to most of it), with the wider filter
    kept.filter_subject, kept.filter_subjects = None, wider
    await js.add_consumer(stream, kept)
    log.warning("durable %s on %s now reads %s (was %s)", durable, stream, wider, held)
    return f"widened durable {durable}"


async def apply_service_durables(js: JetStreamContext, settings: CommonSettings) -> list[str]:
    """Every declared service durable made, or widened to what this release reads (`weir streams apply`, `weir up`):
    before any of the release's services starts, so that its publishers' account subjects reach the consumers of
    the release before, which read through these same durables."""
    done: list[str] = []
    for c in CONSUMERS:
        types = consumed_by(c.name)
        what = await make_or_widen(js, contract(types[0]).stream,
                                   durable_config(c.name, list(event_subjects(types)), settings, c.description))
        if what:
            done.append(what)
    return done


_applying: contextvars.ContextVar[Msg | None] = contextvars.ContextVar("weir_consumer_applying", default=None)


class Position(NamedTuple):
    """Where the event a handler applies sits: its stream, the durable that read it, its stream sequence."""

    stream: str
    durable: str
    seq: int


def applying_position() -> Position | None:
    """The position of the event the running handler applies (read in the handler); None outside one, and for a
    replayed copy (its REPLAY sequence says nothing of the stream's order)."""
    msg = _applying.get()
    if msg is None or msg.subject.startswith(REPLAY_PREFIX):
        return None
    md = msg.metadata
    return Position(md.stream, md.consumer, md.sequence.stream)


def origin(msg: Msg) -> str:
    """The subject the event was published on: a replayed copy's original one (replay copies it, and only the
    operator may publish on replay subjects), else the message's own."""
    if msg.subject.startswith(REPLAY_PREFIX):
        original = (msg.headers or {}).get(HDR_ORIGINAL_SUBJECT)
        return original or _type_from_subject(msg.subject)
    return msg.subject


def _event_id_of(data: bytes) -> str | None:
    """The envelope's id of a message that did not validate, when it has a readable one."""
    try:
        found = json.loads(data).get("id")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and len(found) <= 64 else None


def _type_from_subject(subject: str) -> str:
    if subject.startswith(REPLAY_PREFIX):
        return subject.split(".", 2)[2]
    found = origin_of(subject)
    return found[0] if found is not None else subject


__all__ = ["ConsumerSpec", "DurablePull", "EventConsumer", "EventHandler", "HandlerOutcome", "NotYet", "Refused"]
