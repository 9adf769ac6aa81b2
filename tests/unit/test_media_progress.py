"""A media worker's encode.progress without servers: a hint sent straight to its stream (shared/publishers.py HINTS),
in the trace of its job as media's other messages are: the envelope's `traceparent` and the messages' header."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from faststream.nats import NatsBroker
from nats.js.api import PubAck

from services.media.settings import MediaSettings
from services.media.worker import Job, Worker
from shared import tracing
from shared.bus import HDR_LEGACY_COPY, HDR_MSG_ID
from shared.events import Envelope
from shared.media.protocol import Offer
from shared.publishers import HINTS, EventPublishers, Outgoing
from tests.spans import Kept, kept_in_memory

pytestmark = pytest.mark.asyncio


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kept]:
    """Tracing on for this test only, into memory (the process's global provider is left alone)."""
    yield from kept_in_memory(monkeypatch, "media")


class Stream:
    """JetStream in the test's place: every publish as nats-py is asked to make it (subject, body, headers)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, dict[str, str]]] = []

    async def publish_async(self, subject: str, payload: bytes, headers: dict[str, str] | None = None,
                            **_: Any) -> asyncio.Future[PubAck]:
        self.published.append((subject, payload, dict(headers or {})))
        acked: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        acked.set_result(PubAck(stream="ENCODE", seq=len(self.published)))
        return acked


def worker(legacy_copies: bool = False) -> tuple[Worker, Stream]:
    broker = NatsBroker()
    events = EventPublishers(broker, ("encode.progress",), timeout=1)
    stream = Stream()
    events._js = stream  # type: ignore[assignment]  # the publishes go to the test's stream
    settings = MediaSettings(events_legacy_subjects=legacy_copies)
    return Worker(settings=settings, broker=broker, events=events, pool=None, s3=None), stream


def job(account_id: str | None = "acme1") -> Job:
    return Job(offer=Offer(video_id="v1", output=360, attempt=1, job_class="developer", object_key="k",
                           account_id=account_id), started_at=datetime.now(UTC))


async def spawned_progress(w: Worker, j: Job) -> None:
    """As the job's ffmpeg reader sends it: a task of its own, started inside the job's span."""
    w._spawn(w._progress(j, 0.5))
    await asyncio.gather(*w._background)


async def test_progress_carries_its_jobs_trace_in_the_envelope_and_the_headers(kept: Kept) -> None:
    w, stream = worker(legacy_copies=True)
    with tracing.span("media job 360p", video_id="v1") as span:
        job_traceparent = tracing.traceparent_of(span.get_span_context())
        await spawned_progress(w, job())
    assert job_traceparent is not None
    assert [(subject, headers.get(HDR_LEGACY_COPY)) for subject, _, headers in stream.published] == [
        ("encode.progress.acme1", None), ("encode.progress", "1")]
    for _, payload, headers in stream.published:
        event = Envelope.from_bytes(payload)
        assert event.type == "encode.progress" and event.traceparent == job_traceparent
        assert headers["traceparent"] == job_traceparent  # as an outbox event's: the trace of the work it tells of
    assert stream.published[0][2][HDR_MSG_ID] == event.id and stream.published[1][2][HDR_MSG_ID] == f"{event.id}-legacy"


async def test_untraced_progress_carries_no_trace_context() -> None:
    w, stream = worker()
    await spawned_progress(w, job(account_id=None))  # an older encode named no account: the bare type
    ((subject, payload, headers),) = stream.published
    assert subject == "encode.progress" and "traceparent" not in headers
    assert Envelope.from_bytes(payload).traceparent is None


async def test_only_a_declared_hint_is_published_straight_to_its_stream() -> None:
    """`encode.progress` is the one hint; an event the outbox carries is refused on the hint's path."""
    assert set(HINTS) == {"encode.progress"}
    _, stream = worker()
    broker = NatsBroker()
    events = EventPublishers(broker, ("encode.progress", "encode.started"), timeout=1)
    events._js = stream  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"encode\.started\.acme1 is not a hint's subject"):
        await events.publish_hint([Outgoing("encode.progress.acme1", b"{}", "1"),
                                   Outgoing("encode.started.acme1", b"{}", "2")])
    assert stream.published == []
