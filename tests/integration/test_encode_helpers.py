"""What the encode and media tests share: service processes to start and kill, test sources, events, encode's rows.

No tests here (pytest collects this module and finds none).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from services.encode.app import consumers as encode_consumers
from services.encode.settings import EncodeSettings
from shared.bus import HDR_MSG_ID, connect
from shared.consumer import EventConsumer
from shared.devstack.ports import free_port
from shared.events import Envelope, RecordingCompleted, UploadCompleted, VideoDeleted, new_event
from shared.media.probe import ffmpeg_exe
from shared.media.protocol import STATUS_SUBJECT, ProcessingStatus, StatusRequest
from shared.runtime import Runtime, ServiceDefinition
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.waiting import stop_process, wait_service_ready

FFMPEG = ffmpeg_exe()


# --------------------------------------------------------------------------------------------------- media


@dataclass(frozen=True)
class Source:
    """A test source: testsrc and a sine tone as H.264/AAC MP4, made at test time (nothing is committed).

    Long sources that only hold a slot (read at real time by a worker with media_read_rate=1) use a low fps: cheap to
    make and to encode on 2 cores.
    """

    height: int
    seconds: float
    fps: int = 25
    audio: bool = True

    @property
    def name(self) -> str:
        return f"{self.height}p-{self.seconds:g}s-{self.fps}fps{'' if self.audio else '-mute'}.mp4"

    def args(self, path: Path) -> list[str]:
        w = self.height * 16 // 9 // 2 * 2
        args = [FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                "-f", "lavfi", "-i", f"testsrc=size={w}x{self.height}:rate={self.fps}:duration={self.seconds}"]
        if self.audio:
            args += ["-f", "lavfi", "-i", f"sine=duration={self.seconds}"]
        args += ["-c:v", "libx264", "-preset", "ultrafast", "-g", str(self.fps)]
        if self.audio:
            args += ["-c:a", "aac", "-shortest"]
        return [*args, str(path)]


def make_sources(directory: Path, *sources: Source) -> dict[Source, Path]:
    """Every source at once (ffmpeg processes side by side)."""
    paths = {s: directory / s.name for s in sources}
    running = [subprocess.Popen(s.args(p)) for s, p in paths.items() if not p.exists()]
    for proc in running:
        assert proc.wait(120) == 0
    return paths


def make_source(path: Path, *, height: int, seconds: float, fps: int = 25, audio: bool = True) -> Path:
    source = Source(height, seconds, fps, audio)
    if not path.exists():
        subprocess.run(source.args(path), check=True, timeout=120)
    return path


def decode(path: Path) -> tuple[int, str]:
    """ffmpeg decodes every frame of a file: (return code, errors)."""
    run = subprocess.run([FFMPEG, "-hide_banner", "-nostdin", "-v", "error", "-i", str(path), "-f", "null", "-"],
                         capture_output=True, text=True, timeout=120)
    return run.returncode, run.stderr


def stream_info(path: Path) -> str:
    run = subprocess.run([FFMPEG, "-hide_banner", "-nostdin", "-i", str(path)], capture_output=True, text=True)
    return run.stderr


async def put_object(settings: CommonSettings, key: str, path: Path) -> int:
    async with s3_client(settings) as s3:
        await s3.upload_file(str(path), settings.s3_bucket, key)
    return path.stat().st_size


async def get_object(settings: CommonSettings, key: str, dest: Path) -> Path:
    async with s3_client(settings) as s3:
        await s3.download_file(settings.s3_bucket, key, str(dest))
    return dest


async def objects_under(settings: CommonSettings, prefix: str) -> list[str]:
    """The keys stored under `prefix`."""
    async with s3_client(settings) as s3:
        listed = await s3.list_objects_v2(Bucket=settings.s3_bucket, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


# ----------------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill9(self) -> None:
        """kill -9 of the service and what it started (its ffmpeg): the machine is gone."""
        with _suppress():
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)


@dataclass
class Procs:
    """Service processes (`python -m services.<name>`) with settings as WEIR_* variables; stopped at the end."""

    env: dict[str, str]
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, *names: str, **settings: Any) -> list[Proc]:
        started = []
        for name in names:
            service = name.split("-")[0]
            port = free_port()
            log = self.logs / f"{name}-{port}.log"
            env = {**self.env, "WEIR_HTTP_PORT": str(port),
                   **{f"WEIR_{k.upper()}": str(v) for k, v in settings.items()}}
            if service == "media":
                env.setdefault("WEIR_MEDIA_WORKER_ID", name)
            with log.open("wb") as out:
                popen = subprocess.Popen([sys.executable, "-m", f"services.{service}"], env=env, stdout=out,
                                         stderr=out, start_new_session=True)
            started.append(Proc(name, popen, port, log))
        for p in started:
            wait_service_ready(p.url, p.popen, p.log)
        self.procs += started
        return started

    def stop(self, p: Proc, timeout: float = 30) -> int:
        return stop_process(p.popen, timeout)

    def stop_all(self) -> None:
        """At the end of a test, kill -9 (with their ffmpeg): quicker than draining, and the next test cleans up."""
        for p in self.procs:
            p.kill9()


@contextmanager
def _suppress() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


@contextmanager
def processes(stack_env: dict[str, str], logs: Path) -> Iterator[Procs]:
    env = {**os.environ, **stack_env, "PYTHONUNBUFFERED": "1", "WEIR_LOG_LEVEL": "INFO"}
    procs = Procs(env, logs)
    try:
        yield procs
    finally:
        procs.stop_all()


def ffmpeg_children(proc: Proc) -> list[int]:
    """The ffmpeg processes a service process runs now (its children running the ffmpeg executable), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == proc.popen.pid and argv0 == FFMPEG and state != "Z":
            found.append(int(entry.name))
    return found


def metric(proc: Proc, name: str, **labels: str) -> float:
    """The value of one Prometheus series on the process's /metrics (0 when absent), labels matched as a subset."""
    total = 0.0
    for line in httpx.get(f"{proc.url}/metrics", timeout=5).text.splitlines():
        if not line.startswith(f"weir_{name}{{") and not line.startswith(f"weir_{name} "):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def fast_farm(**overrides: Any) -> dict[str, Any]:
    """Settings that shrink the farm's durations for tests (every number still from the settings models)."""
    return {"media_heartbeat_seconds": 0.2, "media_heartbeat_timeout_seconds": 1.5, "dispatch_retry_seconds": 0.3,
            "dispatch_answer_timeout_ms": 500, "media_progress_seconds": 0.2, "media_x264_preset": "ultrafast",
            "shutdown_grace_seconds": 8, "media_drain_seconds": 1, "media_result_retry_seconds": 0.3,
            "consumer_nak_delay_seconds": 0.2, "consumer_ack_wait_seconds": 2, **overrides}


# ------------------------------------------------------------------------------------------------ the bus


async def prepare_encode_consumers(settings: CommonSettings) -> None:
    """Encode's durable consumers start at the end of their streams: the session's earlier tests published uploads
    whose files are gone, and encode would otherwise begin by processing all of them. Their ack wait (fixed when a
    durable consumer is created) is the fast farm's, so an upload taken by a killed encode comes back soon."""
    nc = await connect(settings, name="test")
    js = nc.jetstream()
    encode_settings = EncodeSettings(consumer_ack_wait_seconds=fast_farm()["consumer_ack_wait_seconds"])
    try:
        rt = Runtime(definition=ServiceDefinition(name="encode", settings_cls=EncodeSettings),
                     settings=encode_settings, metrics=None)  # type: ignore[arg-type]
        for spec in encode_consumers(rt):
            consumer = EventConsumer(spec, pool=None, settings=encode_settings)
            for stream, durable, subjects in consumer.sources():
                try:
                    info = await js.consumer_info(stream, durable)
                    if info.config.ack_wait == encode_settings.consumer_ack_wait_seconds:
                        continue
                    await js.delete_consumer(stream, durable)  # made by an encode started with other settings
                except NotFoundError:
                    pass
                config = consumer.consumer_config(durable=durable, subjects=subjects)
                config.deliver_policy = jsapi.DeliverPolicy.NEW
                await js.add_consumer(stream, config)
    finally:
        await nc.close()


async def clean_encode_state(settings: CommonSettings) -> None:
    """Earlier tests' videos stop processing and their workers are forgotten, so they take no slot of this test."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("UPDATE encode.videos SET state = 'failed', failure_reason = 'test_cleanup'"
                           " WHERE state = 'processing'")
        await conn.execute("DELETE FROM encode.workers")
        await conn.execute("UPDATE media.results SET delivered_at = now() WHERE delivered_at IS NULL")
    finally:
        await conn.close()


async def publish_upload(nc: NATS, *, video_id: str, object_key: str, size: int, source_height: int | None,
                         source_width: int | None = None) -> Envelope:
    """upload.completed, as the api publishes it (through JetStream on its account's subject, with its id as
    Nats-Msg-Id)."""
    event = new_event(UploadCompleted(video_id=video_id, app_id=str(uuid.uuid4()), account_id=str(uuid.uuid4()),
                                      key_id=str(uuid.uuid4()), object_key=object_key, size=size,
                                      content_type="video/mp4", source_height=source_height,
                                      source_width=source_width),
                      source="api", subject=video_id)
    await nc.jetstream().publish(f"{event.type}.{event.data['account_id']}", event.to_bytes(),
                                 headers={HDR_MSG_ID: event.id})
    return event


async def publish_deleted(nc: NATS, *, video_id: str) -> Envelope:
    """video.deleted, as the api publishes it (through JetStream, with its id as Nats-Msg-Id)."""
    event = new_event(VideoDeleted(video_id=video_id, app_id=str(uuid.uuid4()), account_id=str(uuid.uuid4())),
                      source="api", subject=video_id)
    await nc.jetstream().publish(event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id})
    return event


async def publish_recording(nc: NATS, *, recording_id: str, object_key: str, size: int,
                            source_height: int | None) -> None:
    event = new_event(RecordingCompleted(recording_id=recording_id, object_key=object_key, size=size,
                                         source_height=source_height), source="recorder", subject=recording_id)
    await nc.jetstream().publish(event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id})


@dataclass
class Events:
    """Every encode.* and dispatch.busy event published while it listens (a core subscription on those subjects).

    Publishing is at least once: a relay killed after its publish and before marking the row publishes the same
    event again (same id), which the stream drops within its duplicate window but a core subscription sees twice.
    `of` therefore lists each event once, by id, as every consumer of the stream sees it.
    """

    seen: list[Envelope] = field(default_factory=list)

    def of(self, video_id: str, type_: str | None = None) -> list[Envelope]:
        unique: dict[str, Envelope] = {}
        for e in self.seen:
            if e.subject == video_id and (type_ is None or e.type == type_):
                unique.setdefault(str(e.id), e)
        return list(unique.values())


@asynccontextmanager
async def listening(nc: NATS) -> AsyncIterator[Events]:
    events = Events()

    async def on(msg: Msg) -> None:
        try:
            events.seen.append(Envelope.from_bytes(msg.data))
        except Exception:
            pass

    subs = [await nc.subscribe("encode.>", cb=on), await nc.subscribe("dispatch.busy", cb=on)]
    try:
        yield events
    finally:
        for s in subs:
            await s.unsubscribe()


async def status(nc: NATS, video_id: str, timeout: float = 5.0) -> ProcessingStatus:
    reply = await nc.request(STATUS_SUBJECT, StatusRequest(video_id=video_id).model_dump_json().encode(),
                             timeout=timeout)
    return ProcessingStatus.model_validate_json(reply.data)


async def encode_rows(settings: CommonSettings, video_id: str) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
    conn = await asyncpg.connect(settings.database_url)
    try:
        video = await conn.fetchrow("SELECT * FROM encode.videos WHERE video_id = $1", video_id)
        outputs = await conn.fetch("SELECT * FROM encode.outputs WHERE video_id = $1 ORDER BY height", video_id)
        return video, list(outputs)
    finally:
        await conn.close()


async def encode_sql(settings: CommonSettings, sql: str, *args: Any) -> None:
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


class FakeWorker:
    """A worker that accepts what it is told to and never finishes: a hung ffmpeg, as far as encode can tell.

    It heartbeats like a real worker (listing what it runs) and records what encode cancels.
    """

    def __init__(self, nc: NATS, name: str = "fake-1", slots: int = 4, heartbeat_seconds: float = 0.2) -> None:
        self.nc = nc
        self.name = name
        self.instance = uuid.uuid4().hex
        self.slots = slots
        self.heartbeat_seconds = heartbeat_seconds
        self.busy_heights: set[int] = set()  # answer busy to offers of these outputs
        self.running: dict[tuple[str, int], Any] = {}
        self.offers: list[Any] = []
        self.cancelled: list[Any] = []
        self.obey_cancels = True  # False: cancels are recorded but the jobs run on (as if every cancel were lost)
        self._subs: list[Any] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeWorker:
        from shared.media.protocol import cancel_subject, offer_subject

        self._subs = [await self.nc.subscribe(offer_subject(self.instance), cb=self._on_offer),
                      await self.nc.subscribe(cancel_subject(self.instance), cb=self._on_cancel)]
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
        for s in self._subs:
            await s.unsubscribe()

    async def _on_offer(self, msg: Msg) -> None:
        from shared.media.protocol import Offer, OfferAnswer, RunningJob

        offer = Offer.model_validate_json(msg.data)
        self.offers.append(offer)
        accepted = offer.output not in self.busy_heights and len(self.running) < self.slots
        if accepted:
            self.running[(offer.video_id, offer.output)] = RunningJob(
                video_id=offer.video_id, output=offer.output, attempt=offer.attempt, job_class=offer.job_class,
                started_at=datetime.now(UTC))
        answer = OfferAnswer(accepted=accepted, worker=self.name, instance=self.instance,
                             reason=None if accepted else "full")
        await msg.respond(answer.model_dump_json().encode())

    async def _on_cancel(self, msg: Msg) -> None:
        from shared.media.protocol import Cancel

        for job in Cancel.model_validate_json(msg.data).jobs:
            self.cancelled.append(job)
            if not self.obey_cancels:
                continue
            held = self.running.get((job.video_id, job.output))
            if held is not None and held.attempt == job.attempt:
                del self.running[(job.video_id, job.output)]

    async def _beat(self) -> None:
        from shared.media.protocol import HEARTBEAT_SUBJECT, Heartbeat

        while True:
            hb = Heartbeat(worker=self.name, instance=self.instance, slots=self.slots,
                           running=list(self.running.values()), sent_at=datetime.now(UTC))
            await self.nc.publish(HEARTBEAT_SUBJECT, hb.model_dump_json().encode())
            await asyncio.sleep(self.heartbeat_seconds)


# ------------------------------------------------------------------------------------------------- asyncapi


def _resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    from urllib.parse import unquote

    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[unquote(part)]
    return dict(node)


def asyncapi_channels(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    """What a service's AsyncAPI document declares: (address, action, payload schema) for every operation, the action
    `receive` for a subscriber and `send` for a publisher."""

    def target(ref: str) -> dict[str, Any]:
        return _resolve(doc, ref)

    declared = set()
    for op in doc["operations"].values():
        channel = target(op["channel"]["$ref"])
        for message_ref in op["messages"]:
            message = target(target(message_ref["$ref"])["$ref"])
            declared.add((channel["address"], op["action"], message["payload"]["$ref"].rsplit("/", 1)[1]))
    return declared


def asyncapi_replies(doc: dict[str, Any]) -> dict[str, set[str]]:
    """The replies a service's AsyncAPI document declares (`shared.messaging.declare_reply`): for each request subject,
    the titles of the schemas its reply may have (the reply model, and ErrorReply)."""
    from shared.messaging import REPLY_ADDRESS

    replies: dict[str, set[str]] = {}
    for name, channel in doc["channels"].items():
        if not name.endswith(":reply") or channel["address"] != REPLY_ADDRESS:
            continue
        (message,) = channel["messages"].values()
        payload = _resolve(doc, _resolve(doc, message["$ref"])["payload"]["$ref"])
        members = [_resolve(doc, m["$ref"]) if "$ref" in m else m for m in payload.get("anyOf", [payload])]
        replies[name.removesuffix(":reply")] = {m["title"] for m in members}
    return replies
