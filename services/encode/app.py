"""Wiring of the `encode` service: per-video processing state: outputs, deadlines, busy_at, restarts.

- consumers: `upload.completed` (developer jobs), `recording.completed` (teams' recordings, checked against the
  subject's account, identity and job class; refusals told on `publisher.<name>.rejected`), `video.deleted`
  (processing stops for good) and `video.created` (each video's account), idempotent;
- subscribers on the broker: `farm.heartbeat` (every instance), `farm.result` and `encode.status` in its two
  versions, v1 and v2 (request/reply, queue group `encode`); publishers: the farm's offers and cancels
  (`services/encode/farm.py`);
- loops: the dispatcher (due rounds, woken at commit by NOTIFY and by freed slots) and the dead-worker check.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import asyncpg
from faststream.nats import NatsBroker

from services.encode import domain, store
from services.encode.farm import Farm, Registry
from services.encode.processing import Processing, dispatch_pass
from services.encode.settings import EncodeSettings
from shared.bus import wait_any
from shared.consumer import ConsumerSpec
from shared.events import Event, RecordingCompleted, UploadCompleted, VideoCreated, VideoDeleted
from shared.media.protocol import (
    ENCODE_QUEUE,
    HEARTBEAT_SUBJECT,
    RESULT_SUBJECT,
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
    Heartbeat,
    OutputResult,
    ProcessingStatus,
    ProcessingStatuses,
    ResultAck,
    StatusesRequest,
    StatusRequest,
)
from shared.messaging import ErrorReply, declare_reply, error_reply
from shared.runtime import Runtime, ServiceDefinition
from shared.videos import JobClass

log = logging.getLogger("weir.encode")
MIN_WAIT = 0.005
HANDLER_CONCURRENCY = 64


def _processing(rt: Runtime) -> Processing:
    return rt.parts_of(Processing)


def consumers(rt: Runtime) -> list[ConsumerSpec]:
    """Each handler's event annotation is what its durable consumes (subjects, stream, AsyncAPI schema); its effects
    commit with the inbox record of the event (shared/consumer.py)."""

    async def on_upload(conn: asyncpg.Connection, event: Event[UploadCompleted]) -> None:
        data = event.data
        await _processing(rt).open(conn, video_id=data.video_id, job_class=JobClass.DEVELOPER,
                                   object_key=data.object_key,
                                   source_height=domain.known_ladder_side(data.source_width, data.source_height),
                                   account_id=data.account_id, learned_from=event.type)

    async def on_recording(conn: asyncpg.Connection, event: Event[RecordingCompleted], origin: str) -> None:
        # `origin`: the subject it came on, naming the team's account, identity and job class (SPEC 12)
        await _processing(rt).take_recording(conn, event, origin)

    async def on_video(conn: asyncpg.Connection, event: Event[VideoCreated]) -> None:
        await _processing(rt).learn_account(conn, event.data.video_id, event.data.account_id,
                                            learned_from=event.type)

    async def on_deleted(conn: asyncpg.Connection, event: Event[VideoDeleted]) -> None:
        await _processing(rt).learn_account(conn, event.data.video_id, event.data.account_id,
                                            learned_from=event.type)
        await _processing(rt).delete(conn, video_id=event.data.video_id)

    async def on_recording_parked(subject: str, event_id: str | None, reason: str, code: str) -> None:
        await _processing(rt).tell_publisher(subject, event_id, reason, code)

    return [
        ConsumerSpec(name="encode_uploads", handler=on_upload),
        ConsumerSpec(name="encode_recordings", handler=on_recording, on_park=on_recording_parked),
        # durables of their own: one per purpose, so each is replayed and parked on its own
        ConsumerSpec(name="encode_deletions", handler=on_deleted),
        ConsumerSpec(name="encode_videos", handler=on_video),
    ]


async def start(rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, EncodeSettings) and rt.broker is not None
    _, _, pool = rt.require()
    farm = Farm.declare(rt.broker, Registry(settings.media_heartbeat_timeout_seconds, settings.large_output_height),
                        settings.dispatch_answer_timeout_ms / 1000)
    processing = Processing(settings=settings, pool=pool, farm=farm, s3=rt.s3, metrics=rt.metrics)
    rt.parts = processing
    rt.refreshers.append(processing.refresh_metrics)
    if rt.watch is not None:  # off the bus, heartbeats went unheard: the workers went on meanwhile
        rt.watch.on_reconnect(processing.missed_heartbeats)
    await processing.load_registry()
    serve_farm(rt.broker, processing)


def serve_farm(broker: NatsBroker, processing: Processing) -> None:
    """encode's subscribers: heartbeats, results and status requests. Each message is handled in its own task (at
    most HANDLER_CONCURRENCY at once): every handler waits on the database, and one at a time would serialise them.
    The runtime stops them before the broker, letting what is in flight finish."""

    @broker.subscriber(HEARTBEAT_SUBJECT, max_workers=HANDLER_CONCURRENCY, title=f"{HEARTBEAT_SUBJECT}:Heartbeat",
                       description="Every worker's heartbeat. No queue group: every encode instance keeps its own "
                                   "registry of live workers.")
    async def on_heartbeat(hb: Heartbeat) -> None:
        await processing.heartbeat(hb)

    @broker.subscriber(RESULT_SUBJECT, queue=ENCODE_QUEUE, max_workers=HANDLER_CONCURRENCY,
                       title=f"{RESULT_SUBJECT}:Result",
                       description="Request from a worker: the result of one output. Replies ResultAck once encode "
                                   "has committed what it does with it (a lost reply means a repeat, which changes "
                                   'nothing), or `{"error": ...}` when the result does not validate (the worker '
                                   "keeps it undelivered).")
    async def on_result(result: OutputResult) -> ResultAck:
        return await processing.apply_result(result)

    declare_reply(broker, RESULT_SUBJECT, ResultAck | ErrorReply)

    @broker.subscriber(STATUS_SUBJECT, queue=ENCODE_QUEUE, max_workers=HANDLER_CONCURRENCY,
                       title=f"{STATUS_SUBJECT}:Status",
                       description="Request from the api of release 1.0.0 (GET /v1/videos/{id}; v1, kept beside v2 "
                                   "until no release in service calls it): a video's processing state, with the "
                                   'stuck rule applied. Replies ProcessingStatus, or `{"error": ...}` when the '
                                   "request does not validate.")
    async def on_status(request: StatusRequest) -> ProcessingStatus:
        return await processing.status(request.video_id)

    declare_reply(broker, STATUS_SUBJECT, ProcessingStatus | ErrorReply)

    # v2 beside v1 (a breaking change: many videos per request): both answer through `Processing.statuses`, so the
    # stuck rule applies the same way whichever version asks
    most = processing.settings.status_max_videos

    @broker.subscriber(STATUS_V2_SUBJECT, queue=ENCODE_QUEUE, max_workers=HANDLER_CONCURRENCY,
                       title=f"{STATUS_V2_SUBJECT}:Statuses",
                       description="Request from the api (a page of GET /v1/videos, or GET /v1/videos/{id}): the "
                                   "processing state of each video asked, with the stuck rule applied. Replies "
                                   'ProcessingStatuses, or `{"error": ...}` when the request does not validate or '
                                   "asks about more videos than the setting status_max_videos allows.")
    async def on_statuses(request: StatusesRequest) -> ProcessingStatuses | ErrorReply:
        if len(request.video_ids) > most:
            return error_reply(400, "too_many_videos", f"at most {most} videos per request, "
                               f"asked {len(request.video_ids)}")
        return ProcessingStatuses(videos=await processing.statuses(request.video_ids))

    declare_reply(broker, STATUS_V2_SUBJECT, ProcessingStatuses | ErrorReply)


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
    on_start=start,
    background=(dispatcher, dead_workers),
    description="per-video processing state: outputs, deadlines, busy_at, restarts",
)
