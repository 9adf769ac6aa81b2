"""Wiring of the `encode` service: per-video processing state: outputs, deadlines, busy_at, restarts.

- consumers: `upload.completed` (developer jobs), `recording.completed` (first-party jobs) and `video.deleted`
  (processing stops for good), idempotent;
- core NATS: `farm.heartbeat` (every instance), `farm.result` and `encode.status` (queue group `encode`);
- loops: the dispatcher (due rounds, woken at commit by NOTIFY and by freed slots) and the dead-worker check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

import asyncpg
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.encode import store
from services.encode.domain import JobClass
from services.encode.farm import Registry
from services.encode.processing import Processing, dispatch_pass
from services.encode.settings import EncodeSettings
from shared.bus import ConsumerSpec, wait_any
from shared.events import Envelope, RecordingCompleted, UploadCompleted, VideoDeleted
from shared.media.protocol import (
    ENCODE_QUEUE,
    HEARTBEAT_SUBJECT,
    RESULT_SUBJECT,
    STATUS_SUBJECT,
    Heartbeat,
    OutputResult,
    StatusRequest,
)
from shared.runtime import Runtime, ServiceDefinition, task_per_message

log = logging.getLogger("weir.encode")
MIN_WAIT = 0.005
HANDLER_CONCURRENCY = 64


def _processing(rt: Runtime) -> Processing:
    p = rt.state["processing"]
    assert isinstance(p, Processing)
    return p


def consumers(rt: Runtime) -> list[ConsumerSpec]:
    async def on_upload(conn: asyncpg.Connection, envelope: Envelope) -> None:
        data = envelope.parsed_as(UploadCompleted)
        await _processing(rt).open(conn, video_id=data.video_id, job_class=JobClass.DEVELOPER,
                                   object_key=data.object_key, source_height=data.source_height)

    async def on_recording(conn: asyncpg.Connection, envelope: Envelope) -> None:
        data = envelope.parsed_as(RecordingCompleted)
        await _processing(rt).open(conn, video_id=data.recording_id, job_class=JobClass.FIRST_PARTY,
                                   object_key=data.object_key, source_height=data.source_height)

    async def on_deleted(conn: asyncpg.Connection, envelope: Envelope) -> None:
        await _processing(rt).delete(conn, video_id=envelope.parsed_as(VideoDeleted).video_id)

    return [
        ConsumerSpec(name="encode_uploads", stream="VIDEOS", subjects=("upload.completed",), handler=on_upload,
                     description="developer uploads to encode"),
        ConsumerSpec(name="encode_recordings", stream="RECORDINGS", subjects=("recording.completed",),
                     handler=on_recording, description="first-party recordings to encode"),
        # a durable of its own: an existing durable's filter is never changed on start-up (ensure only creates)
        ConsumerSpec(name="encode_deletions", stream="VIDEOS", subjects=("video.deleted",), handler=on_deleted,
                     description="deleted videos: stop their encoding"),
    ]


async def start(rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, EncodeSettings)
    nc, _, pool = rt.require()
    processing = Processing(settings=settings, pool=pool, nc=nc, s3=rt.s3,
                            registry=Registry(settings.media_heartbeat_timeout_seconds), metrics=rt.metrics)
    rt.state["processing"] = processing
    await processing.load_registry()
    spawn = task_per_message(rt, HANDLER_CONCURRENCY)

    async def on_heartbeat(msg: Msg) -> None:
        try:
            hb = Heartbeat.model_validate_json(msg.data)
        except ValidationError:
            return
        await processing.heartbeat(hb)

    async def on_result(msg: Msg) -> None:
        try:
            result = OutputResult.model_validate_json(msg.data)
        except ValidationError:
            return  # no answer: the worker keeps it, and an operator sees it undelivered
        ack = await processing.apply_result(result)
        await msg.respond(ack.model_dump_json().encode())  # after the commit: a lost answer means a repeat, no loss

    async def on_status(msg: Msg) -> None:
        try:
            request = StatusRequest.model_validate_json(msg.data)
        except ValidationError:
            return
        reply = await processing.status(request.video_id)
        await msg.respond(reply.model_dump_json().encode())

    rt.state["subs"] = [
        await nc.subscribe(HEARTBEAT_SUBJECT, cb=spawn(on_heartbeat)),  # every instance keeps its own registry
        await nc.subscribe(RESULT_SUBJECT, queue=ENCODE_QUEUE, cb=spawn(on_result)),
        await nc.subscribe(STATUS_SUBJECT, queue=ENCODE_QUEUE, cb=spawn(on_status)),
    ]


async def stop(rt: Runtime) -> None:
    subs: list[Subscription] = rt.state.get("subs", [])
    for sub in subs:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    tasks = rt.state.get("tasks", set())
    if tasks:
        await asyncio.wait(list(tasks), timeout=rt.settings.shutdown_grace_seconds)


async def _listen(dsn: str, processing: Processing) -> asyncpg.Connection | None:
    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == "capacity":
            processing.capacity = True
        processing.wake.set()

    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn)
        await conn.add_listener(store.WAKE_CHANNEL, on_notify)
        return conn
    except Exception as exc:
        log.warning("dispatcher: LISTEN failed, polling: %s", exc)
        return None


async def dispatcher(rt: Runtime, stop_event: asyncio.Event) -> None:
    """Runs every round that is due, woken at the commit that makes one due (NOTIFY) or when a slot frees."""
    processing = _processing(rt)
    retry = processing.settings.dispatch_retry_seconds
    listener: asyncpg.Connection | None = None
    try:
        while not stop_event.is_set():
            if listener is None or listener.is_closed():
                listener = await _listen(rt.settings.database_url, processing)
            processing.wake.clear()
            wait = retry
            try:
                await dispatch_pass(processing)
                due = await processing.next_due()
                if due is not None:
                    wait = min(retry, max(MIN_WAIT, (due - datetime.now(UTC)).total_seconds()))
            except Exception as exc:  # the database or the bus is away: try again shortly
                log.warning("dispatcher: %s", exc)
                wait = min(retry, 1.0)
            await wait_any(stop_event, processing.wake, wait)
    finally:
        if listener is not None and not listener.is_closed():
            await listener.close()


async def dead_workers(rt: Runtime, stop_event: asyncio.Event) -> None:
    processing = _processing(rt)
    s = processing.settings
    interval = min(s.media_heartbeat_seconds, s.media_heartbeat_timeout_seconds / 3)
    while not stop_event.is_set():
        await wait_any(stop_event, None, interval)
        if stop_event.is_set():
            return
        try:
            await processing.bury_dead_workers()
        except Exception as exc:
            log.warning("dead-worker check: %s", exc)


SERVICE = ServiceDefinition(
    name="encode",
    settings_cls=EncodeSettings,
    consumers=consumers,
    publishes=("dispatch.busy", "encode.started", "encode.completed", "encode.failed"),
    on_start=start,
    on_stop=stop,
    background=(dispatcher, dead_workers),
    description="per-video processing state: outputs, deadlines, busy_at, restarts",
)
