"""The service's event publishers: declared on its broker (so its AsyncAPI document lists each event type with the
catalog's schema), and sent as nats-py JetStream publishes, each awaited for its PubAck: the one way the bus
publishes to JetStream (the outbox relay, `weir replay`, a consumer parking a message)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from faststream.nats import NatsBroker
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.bus import HDR_MSG_ID, HDR_REPROCESS, HDR_TYPE, HDR_VERSION, JSON, REPLAY_ADDRESS, VERSION_HEADER
from shared.contracts import REPLAY_PREFIX, REPLAY_STREAM, contract, origin_of
from shared.events import CATALOG, Envelope, Event
from shared.natsconn import ConnectionWatch

log = logging.getLogger("weir.bus")

_TRACE_HEADERS = TraceContextTextMapPropagator()


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
            broker.publisher(
                contract(event_type).template,
                timeout=timeout,
                schema=Event[model],  # type: ignore[valid-type]
                title=event_type,
                description=f"{(model.__doc__ or '').strip()} Published from the outbox into stream "
                f"{contract(event_type).stream}, acknowledged by JetStream; `Nats-Msg-Id` is the event id, "
                f"`{HDR_VERSION}` the publisher's release.",
            )
            self._declared.add(event_type)
        self.replay = replay
        if replay:
            broker.publisher(
                REPLAY_ADDRESS,
                timeout=timeout,
                schema=Envelope,
                title=REPLAY_ADDRESS,
                description=f"`weir replay`: a stored event again, as it was stored, for one consumer (its durable "
                f"name) into stream {REPLAY_STREAM}, acknowledged by JetStream. Headers: `{HDR_TYPE}` (the event "
                f"type), `{HDR_REPROCESS}` (1: run the handler again even if the inbox has the event), "
                f"`{HDR_MSG_ID}`, `{HDR_VERSION}`.",
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


__all__ = ["EventPublishers", "Outgoing", "publish_acked"]
