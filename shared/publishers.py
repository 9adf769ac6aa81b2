"""The service's event publishers: declared on its broker (so its AsyncAPI document lists each event type with the
catalog's schema, and says how it is published and which headers it carries), and sent as nats-py JetStream
publishes, each awaited for its PubAck: the one way the bus publishes to JetStream (the outbox relay, a hint such as
media's `encode.progress`, `weir replay`, a consumer parking a message)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from faststream.nats import NatsBroker
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.bus import (
    HDR_LEGACY_COPY,
    HDR_MSG_ID,
    HDR_ORIGINAL_SUBJECT,
    HDR_REPROCESS,
    HDR_TYPE,
    HDR_VERSION,
    JSON,
    REPLAY_ADDRESS,
    VERSION_HEADER,
)
from shared.contracts import (
    ACCOUNT_SUBJECTS_SINCE,
    ACCOUNT_TOKEN,
    JOB_CLASS_TOKEN,
    PUBLISHER_TOKEN,
    REPLAY_PREFIX,
    REPLAY_STREAM,
    EventContract,
    contract,
    origin_of,
)
from shared.events import CATALOG, EncodeProgress, Envelope, Event
from shared.natsconn import ConnectionWatch

log = logging.getLogger("weir.bus")

_TRACE_HEADERS = TraceContextTextMapPropagator()
_TRACEPARENT = next(f for f in sorted(_TRACE_HEADERS.fields) if f != "tracestate")  # the header it writes: traceparent
_CONTENT_TYPE = ", ".join(f"`{name}: {value}`" for name, value in JSON.items())

# How an event type reaches its stream. By default from its publisher's outbox: written in the transaction of the
# change it tells of, published by the relay once that commits and again until JetStream acknowledges it (at least
# once). The types here are hints instead, published by their publisher straight to the stream as they happen, once
# (`EventPublishers.publish_hint`, which takes no other type): each with why losing one does no harm.
HINTS: Mapping[str, str] = MappingProxyType({
    EncodeProgress.event_type: "sent while a worker encodes one output, at most every `WEIR_MEDIA_PROGRESS_SECONDS`: a "
    "lost one is followed by the next",
})

# what a subject template's tokens are (AsyncAPI's channel parameters, which FastStream's publishers cannot declare)
_TOKENS: Mapping[str, str] = MappingProxyType({
    ACCOUNT_TOKEN: "the account the event is about (its data's `account_id`); a team's rights name its accounts there",
    PUBLISHER_TOKEN: "the publisher identity's name (an outside team's, or the stack's own `publisher`)",
    JOB_CLASS_TOKEN: "the recording's job class (`developer`; `first_party` from a first-party publisher)",
})


def delivery(event_type: str) -> str:
    """How an event type is published, for its AsyncAPI description: from the outbox, or as a hint (`HINTS`)."""
    declared = contract(event_type)
    hint = HINTS.get(event_type)
    if hint is not None:
        return (f"A hint, published by its publisher straight into stream {declared.stream} as it happens, not from "
                f"an outbox ({hint}); JetStream acknowledges it, but one that is not stored is not sent again.")
    return (f"Published from its publisher's outbox into stream {declared.stream} once the change it tells of "
            "commits, and again until JetStream acknowledges it: at least once, a resend being the same event "
            f"(`{HDR_MSG_ID}`, the envelope's `id`).")


def subject_parameters(declared: EventContract) -> str:
    """What each `{token}` of the type's subject is (empty for a subject without one)."""
    if not declared.tokens:
        return ""
    return "Subject parameters: " + "; ".join(
        f"`{{{t}}}`: {_TOKENS.get(f'{{{t}}}', 'taken from the event data field of that name')}"
        for t in declared.tokens) + "."


def event_headers(*, legacy_copy: bool = False) -> str:
    """The headers every event carries (shared/headers.py names them), for its AsyncAPI description: FastStream's
    AsyncAPI messages cannot declare headers, and declare a `correlationId` that no event carries."""
    if legacy_copy:
        listed = (f"`{HDR_MSG_ID}` (the event id with `-legacy`), `{HDR_VERSION}` (the publisher's release), "
                  f"`{HDR_LEGACY_COPY}: 1`, {_CONTENT_TYPE}; the trace context is the envelope's `traceparent`")
    else:
        listed = (f"`{HDR_MSG_ID}` (the envelope's `id`), `{HDR_VERSION}` (the publisher's release), "
                  f"`{_TRACEPARENT}` (W3C trace context of the publish, when the work that made the event was traced; "
                  f"the envelope's `traceparent` is that work's), {_CONTENT_TYPE}")
    return f"Headers: {listed}. {_NO_CORRELATION}"


_NO_CORRELATION = ("No `correlation_id` header (FastStream's `correlationId` on this message does not apply to events, "
                   "only to request replies): the envelope's `id` names the event, its `subject` the entity.")


class Outgoing(NamedTuple):
    """One message for JetStream: subject, body, `Nats-Msg-Id` and further headers; `span`: the span it is published
    under (the relay's for an outbox row), whose context its headers carry."""

    subject: str
    payload: bytes
    msg_id: str
    headers: Mapping[str, str] | None = None
    span: Span | None = None


class EventPublishers:
    """One declared publisher per event type the service publishes (with `replay`, also `replay.<consumer>.<type>`,
    the copies `weir replay` sends a consumer). Every publish is a JetStream publish whose PubAck is awaited
    (`publish_async`: the rows go out in order, their PubAcks are awaited together). A type nobody declared is
    published all the same, with a warning: an event in the outbox is never held back for want of a declaration."""

    def __init__(self, broker: NatsBroker, event_types: Iterable[str] = (), *, timeout: float,
                 replay: bool = False, watch: ConnectionWatch | None = None) -> None:
        self.broker = broker
        self.timeout = timeout
        self.watch = watch  # a subject the server refuses this identity fails its rows at once, with the reason
        self._declared: set[str] = set()
        self._warned: set[str] = set()
        self._js: JetStreamContext | None = None
        for event_type in event_types:
            model = CATALOG[event_type]
            declared = contract(event_type)
            how = delivery(event_type)
            broker.publisher(
                declared.template,
                timeout=timeout,
                schema=Event[model],  # type: ignore[valid-type]
                title=event_type,
                description=" ".join(part for part in (
                    " ".join((model.__doc__ or "").split()), how, subject_parameters(declared), event_headers())
                    if part),
            )
            if declared.legacy and declared.template != event_type:
                broker.publisher(
                    event_type,
                    timeout=timeout,
                    schema=Event[model],  # type: ignore[valid-type]
                    title=f"{event_type}:copy",
                    description=f"The same event on its bare type, for consumers of releases before "
                    f"{ACCOUNT_SUBJECTS_SINCE} (while `WEIR_EVENTS_LEGACY_SUBJECTS` is on), published with it. {how} "
                    f"{event_headers(legacy_copy=True)}",
                )
            self._declared.add(event_type)
        self.replay = replay
        if replay:
            broker.publisher(
                REPLAY_ADDRESS,
                timeout=timeout,
                schema=Envelope,
                title=REPLAY_ADDRESS,
                description=f"`weir replay`: a stored event again, as it was stored, for one consumer into stream "
                f"{REPLAY_STREAM}, acknowledged by JetStream. Subject parameters: `{{consumer}}`: the consumer's "
                "durable name; `{event_type}`: the event's type. "
                f"Headers: `{HDR_TYPE}` (the event type), `{HDR_REPROCESS}` (1: run the handler again even if the "
                f"inbox has the event), `{HDR_ORIGINAL_SUBJECT}` (the subject it was stored on), `{HDR_MSG_ID}` (one "
                f"per replay, consumer and stored message), `{HDR_VERSION}` (the release that published the event), "
                f"`{_TRACEPARENT}` (the replay's trace, when traced), {_CONTENT_TYPE}. {_NO_CORRELATION}",
            )

    @property
    def event_types(self) -> list[str]:
        return sorted(self._declared)

    async def publish(self, subject: str, payload: bytes, msg_id: str,
                      headers: Mapping[str, str] | None = None) -> PubAck:
        """One event, published once JetStream acknowledges it (raises why not, otherwise)."""
        (result,) = await self.publish_in_order([Outgoing(subject, payload, msg_id, headers)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def publish_hint(self, rows: Sequence[Outgoing]) -> list[PubAck | BaseException]:
        """A hint's messages (its subject's and a legacy copy's), straight to the stream as `publish_in_order` sends
        them; ValueError for a subject whose type `HINTS` does not declare: an event the outbox carries is never sent
        this way, and the AsyncAPI document says which is which."""
        for row in rows:
            found = origin_of(row.subject)
            if found is None or found[0] not in HINTS:
                raise ValueError(f"{row.subject} is not a hint's subject (shared/publishers.py HINTS): its event "
                                 "goes through the outbox")
        return await self.publish_in_order(rows)

    async def publish_in_order(self, rows: Sequence[Outgoing]) -> list[PubAck | BaseException]:
        """Publish the rows one after the other (so in row order on the wire), then wait for all their PubAcks
        together, up to the timeout; each result is its PubAck or why there is none."""
        if self._js is None:
            self._js = self.broker.connection.jetstream()
        js = self._js
        results: list[PubAck | BaseException] = []
        waiting: dict[int, asyncio.Future[PubAck]] = {}
        try:
            for index, row in enumerate(rows):
                try:
                    future = await js.publish_async(row.subject, row.payload, headers=self._headers(row))
                except Exception as exc:
                    results.append(exc)
                    continue
                waiting[index] = future
                if self.watch is not None:
                    self.watch.fail_waiting(row.subject, future)
                results.append(_NO_ACK_YET)
            if waiting:
                await asyncio.wait(list(waiting.values()), timeout=self.timeout)
            for index, future in waiting.items():
                if not future.done():
                    future.cancel()  # nats-py forgets it and frees its slot
                    results[index] = TimeoutError(f"no PubAck within {self.timeout} s")
                elif (error := future.exception()) is not None:
                    results[index] = error
                else:
                    results[index] = future.result()
        finally:
            if self.watch is not None:
                for index, future in waiting.items():
                    self.watch.forget(rows[index].subject, future)
        return results

    def _headers(self, row: Outgoing) -> dict[str, str]:
        # the sender's release unless the row names one (a replayed event keeps the one it was stored with)
        headers = {**JSON, **VERSION_HEADER, **(row.headers or {}), HDR_MSG_ID: row.msg_id}
        if row.span is not None:
            _TRACE_HEADERS.inject(headers, context=trace.set_span_in_context(row.span))
        found = origin_of(row.subject)
        declared = found is not None and found[0] in self._declared
        if not declared and not (self.replay and row.subject.startswith(REPLAY_PREFIX)) \
                and row.subject not in self._warned and len(self._warned) < 1000:
            self._warned.add(row.subject)
            log.warning("publishing %s, which this service does not declare (its AsyncAPI document lacks it)",
                        row.subject)
        return headers


_NO_ACK_YET = TimeoutError("not acknowledged yet")


async def publish_acked(js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], *,
                        timeout: float, stream: str | None = None) -> PubAck:
    """One JetStream publish, returned once acknowledged (raises why not: a refusal, no stream, the timeout)."""
    future = await js.publish_async(subject, payload, headers=headers, stream=stream)
    return await asyncio.wait_for(future, timeout)  # on timeout the future is cancelled: nats-py forgets it


__all__ = ["HINTS", "EventPublishers", "Outgoing", "delivery", "event_headers", "publish_acked",
           "subject_parameters"]
