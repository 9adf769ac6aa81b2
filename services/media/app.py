"""Wiring of the `media` service: one encoding worker: its slots and running ffmpeg jobs."""

from __future__ import annotations

import asyncio

from services.media.settings import MediaSettings
from services.media.worker import Worker
from shared.media.protocol import OFFER_PATTERN, OfferAnswer
from shared.messaging import ErrorReply, declare_reply
from shared.runtime import Runtime, ServiceDefinition


async def start(rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, MediaSettings)
    _, _, pool = rt.require()
    assert rt.broker is not None and rt.publishers is not None
    # its subscribers and publishers are declared on the broker here, before the runtime starts it
    worker = Worker(settings=settings, broker=rt.broker, events=rt.publishers, pool=pool, s3=rt.s3,
                    metrics=rt.metrics)
    # the offer is a request (its answer in the document); a cancel is only published, and answered by nothing
    declare_reply(rt.broker, OFFER_PATTERN, OfferAnswer | ErrorReply)
    rt.parts = worker
    await worker.start()


def _worker(rt: Runtime) -> Worker:
    return rt.parts_of(Worker)


async def work(rt: Runtime, stop: asyncio.Event) -> None:
    """Heartbeats (the first at once, the subscribers now in place) and result delivery until SIGTERM; then stop
    taking offers and hand back what cannot finish."""
    worker = _worker(rt)
    loops = [asyncio.create_task(worker.heartbeat_loop(stop)), asyncio.create_task(worker.deliver_loop(stop))]
    await stop.wait()
    await worker.drain()
    await asyncio.gather(*loops, return_exceptions=True)
    await worker.deliver()  # the hand-backs, if encode answers; else any worker delivers them later


SERVICE = ServiceDefinition(
    name="media",
    settings_cls=MediaSettings,
    on_start=start,
    background=(work,),
    description="one encoding worker: its slots and running ffmpeg jobs",
)
