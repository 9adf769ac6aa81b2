"""Streams, consumers and the DLQ, from JetStream's stream and consumer info on the CLI's own connection (`operator`);
the DLQ's counts by event type are the DLQ stream's per-subject counts (`dlq.<type>`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.contracts import DLQ_PREFIX, DLQ_STREAM, DLQ_SUBJECTS  # parked messages live on dlq.<type>
from shared.settings import CommonSettings
from shared.streams import STREAMS
from weir.status.model import ConsumerState, StreamState, Unavailable, reason_of


def dlq_counts(subjects: Mapping[str, int] | None) -> dict[str, int]:
    """The DLQ stream's per-subject counts as counts by event type (`dlq.upload.completed` -> `upload.completed`)."""
    counts: dict[str, int] = {}
    for subject, n in (subjects or {}).items():
        if subject.startswith(DLQ_PREFIX) and n:
            event_type = subject[len(DLQ_PREFIX):]
            counts[event_type] = counts.get(event_type, 0) + int(n)
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class BusParts:
    streams: dict[str, StreamState | Unavailable] | Unavailable
    consumers: dict[str, list[ConsumerState] | Unavailable] | Unavailable
    dlq: dict[str, int] | Unavailable

    @classmethod
    def down(cls, reason: str) -> BusParts:
        gone = Unavailable(f"NATS: {reason}")
        return cls(gone, gone, gone)


async def read_bus(settings: CommonSettings, timeout: float) -> BusParts:
    """Streams, consumers and DLQ counts over JetStream's API, as `operator` (its rights: STREAM.INFO, CONSUMER.LIST).
    The declared streams are read one by one: the operator may not list the server's streams."""
    from nats.js.errors import NotFoundError

    from shared.messaging import tool_broker

    try:
        async with asyncio.timeout(timeout * 2), tool_broker(settings, "status", fail_fast=True) as broker:
            js = broker.connection.jetstream(timeout=timeout)
            streams: dict[str, StreamState | Unavailable] = {}
            consumers: dict[str, list[ConsumerState] | Unavailable] = {}
            dlq: dict[str, int] | Unavailable = Unavailable(f"stream {DLQ_STREAM} was not read")
            for spec in STREAMS:
                try:
                    info = await js.stream_info(spec.name)
                except NotFoundError:
                    streams[spec.name] = consumers[spec.name] = Unavailable("stream not found")
                    continue
                except Exception as exc:
                    streams[spec.name] = consumers[spec.name] = Unavailable(reason_of(exc))
                    continue
                streams[spec.name] = StreamState(spec.name, info.state.messages, info.state.bytes,
                                                 info.state.consumer_count)
                consumers[spec.name] = await _consumers(js, spec.name)
            try:
                dlq = dlq_counts((await js.stream_info(DLQ_STREAM, subjects_filter=DLQ_SUBJECTS)).state.subjects)
            except Exception as exc:
                dlq = Unavailable(f"stream {DLQ_STREAM}: {reason_of(exc)}")
            return BusParts(streams, consumers, dlq)
    except Exception as exc:  # no server answers, this identity is refused, or it took too long
        return BusParts.down(reason_of(exc) if not isinstance(exc, TimeoutError) else f"no answer in {timeout * 2:g} s")


async def _consumers(js: Any, stream: str) -> list[ConsumerState] | Unavailable:
    page = 256  # JetStream's page of a consumer listing
    found: list[ConsumerState] = []
    try:
        while True:
            infos = await js.consumers_info(stream, offset=len(found) or None)
            found += [ConsumerState(stream, i.name, i.num_pending or 0, i.num_ack_pending or 0,
                                    i.num_redelivered or 0, i.num_waiting or 0) for i in infos]
            if len(infos) < page:
                return sorted(found, key=lambda c: c.name)
    except Exception as exc:
        return Unavailable(reason_of(exc))
