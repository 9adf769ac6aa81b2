"""One encoding worker: answers offers at once, runs ffmpeg per accepted output, records and delivers results.

The protocol and why it is core NATS is in `shared/media/protocol.py`. In short:
- `farm.offer.<instance>`: accepted or busy, decided and reserved in one step (nats-py runs a subscription's
  callbacks one at a time, and admission has no await between the check and the reservation);
- `farm.heartbeat` every media_heartbeat_seconds, and at once when a slot frees, listing the running attempts;
- results: recorded in this service's `results` table, then delivered to encode on `farm.result` until it answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from botocore.exceptions import ClientError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from pydantic import ValidationError

from services.media import domain
from services.media.settings import MediaSettings
from shared.bus import HDR_MSG_ID
from shared.events import EncodeProgress, new_event
from shared.media.probe import ffmpeg_exe
from shared.media.protocol import (
    HEARTBEAT_SUBJECT,
    RESULT_SUBJECT,
    Cancel,
    Heartbeat,
    JobKey,
    Offer,
    OfferAnswer,
    Outcome,
    OutputResult,
    ResultAck,
    RunningJob,
    cancel_subject,
    offer_subject,
    rendition_key,
)
from shared.media.source import open_source
from shared.metrics import Metrics

log = logging.getLogger("weir.media")

SOURCE = "media"
STDERR_TAIL_LINES = 12
RESULT_REQUEST_TIMEOUT = 5.0
REMOVE_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1
Key = tuple[str, int, int]


def _die_with_worker() -> None:
    """In the forked ffmpeg: SIGKILL when the worker dies (Linux): a killed worker leaves no encode running unowned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _source_missing(exc: Exception) -> bool:
    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in (
        "404", "NoSuchKey", "NotFound")


def key_of(job: JobKey) -> Key:
    return (job.video_id, job.output, job.attempt)


@dataclass
class Job:
    offer: Offer
    started_at: datetime
    task: asyncio.Task[None] | None = None
    proc: asyncio.subprocess.Process | None = None
    cancelled: bool = False  # encode no longer wants it: no result
    handed_back: bool = False  # this worker is stopping: the output goes back to encode unfinished

    @property
    def slotted(self) -> domain.Slotted:
        return domain.Slotted(domain.JobClass(self.offer.job_class), self.offer.output)


@dataclass
class Worker:
    settings: MediaSettings
    nc: NATS
    js: JetStreamContext
    pool: asyncpg.Pool
    s3: Any
    metrics: Metrics | None = None
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    jobs: dict[Key, Job] = field(default_factory=dict)
    leaving: bool = False
    _subs: list[Subscription] = field(default_factory=list)
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.name = self.settings.media_worker_id or f"{socket.gethostname()}-{os.getpid()}"
        base = Path(self.settings.media_work_dir or tempfile.gettempdir())
        self.work_dir = base / f"weir-media-{self.instance}"
        self.options = domain.EncodeOptions(
            preset=self.settings.media_x264_preset, crf=self.settings.media_x264_crf,
            audio_bitrate_kbps=self.settings.media_audio_bitrate_kbps, read_rate=self.settings.media_read_rate,
        )

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._subs = [
            await self.nc.subscribe(offer_subject(self.instance), cb=self.on_offer),
            await self.nc.subscribe(cancel_subject(self.instance), cb=self.on_cancel),
        ]
        await self.heartbeat()
        log.info("worker %s (instance %s) ready with %d slots", self.name, self.instance, self.settings.media_slots)

    async def drain(self) -> None:
        """SIGTERM: take no more offers, give running jobs media_drain_seconds, hand back the rest."""
        self.leaving = True
        for sub in self._subs[:1]:  # offers; cancellations still count while draining
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.heartbeat()
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.media_drain_seconds)
        unfinished = [j for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for job in unfinished:
            job.handed_back = True
            if job.proc is not None and job.proc.returncode is None:
                job.proc.kill()
        if unfinished:
            log.info("handing back %d unfinished outputs", len(unfinished))
            await asyncio.wait([j.task for j in unfinished if j.task is not None], timeout=10)
        await self.heartbeat()
        for sub in self._subs[1:]:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ offers

    async def on_offer(self, msg: Msg) -> None:
        try:
            offer = Offer.model_validate_json(msg.data)
        except ValidationError:
            await self._answer(msg, accepted=False, reason="invalid_offer")
            return
        key = key_of(offer)
        if key in self.jobs:  # the same offer again (a retried request): the same answer
            await self._answer(msg, accepted=True)
            return
        slotted = domain.Slotted(domain.JobClass(offer.job_class), offer.output)
        refusal = domain.admission(
            self.settings.media_slots, (j.slotted for j in self.jobs.values()), slotted, leaving=self.leaving
        )
        if refusal is not None:
            self._count("offers_total", answer="busy")
            await self._answer(msg, accepted=False, reason=refusal.value)
            return
        # reserved before the first await: a second offer racing for the last slot sees it taken
        job = Job(offer=offer, started_at=datetime.now(UTC))
        self.jobs[key] = job
        log.info("accepted %s %dp attempt %d (%s)", offer.video_id, offer.output, offer.attempt, offer.job_class)
        self._count("offers_total", answer="accepted")
        await self._answer(msg, accepted=True)
        job.task = asyncio.create_task(self._run(job), name=f"job-{offer.video_id}-{offer.output}")

    async def _answer(self, msg: Msg, *, accepted: bool, reason: str | None = None) -> None:
        answer = OfferAnswer(accepted=accepted, worker=self.name, instance=self.instance, reason=reason)
        with contextlib.suppress(Exception):
            await msg.respond(answer.model_dump_json().encode())

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.model_validate_json(msg.data)
        except ValidationError:
            return
        for k in cancel.jobs:  # repeated cancels (encode repeats them while heartbeats list the job) change nothing
            job = self.jobs.get(key_of(k))
            if job is None or job.cancelled:
                continue
            log.info("encode cancelled %s %dp attempt %d (%s)", k.video_id, k.output, k.attempt,
                     cancel.reason or "not wanted")
            job.cancelled = True  # no result, no progress; what it wrote is removed (see _run)
            if self.metrics:
                self.metrics.inc("cancels_total", 1, "jobs cancelled by encode, by reason",
                                 reason=cancel.reason or "not_wanted")
            if job.proc is not None and job.proc.returncode is None:
                job.proc.kill()

    # -------------------------------------------------------------------------------------------- jobs

    async def _run(self, job: Job) -> None:
        offer = job.offer
        out = self.work_dir / f"{offer.video_id}-{offer.output}-{offer.attempt}.mp4"
        result: OutputResult | None = None
        t0 = time.monotonic()
        try:
            result = await self._encode(job, out)
        except Exception as exc:
            if job.cancelled:  # e.g. a deleted video's source removed under it: nobody wants to hear of it
                log.info("cancelled job %s %dp ended with %r", offer.video_id, offer.output, exc)
            elif _source_missing(exc):  # the video was deleted: no worker can do better; encode counts the failure
                result = self._result(job, "failed", reason="source_missing", message="the source is not in storage")
            else:  # storage or the machine, not the source: another worker may do better
                log.warning("job %s %dp failed on this worker: %r", offer.video_id, offer.output, exc)
                result = self._result(job, "handed_back", reason="worker_error", message=f"{type(exc).__name__}")
        finally:
            with contextlib.suppress(OSError):
                out.unlink()
        if job.cancelled:  # cancelled by encode (whatever it got to): no result, and nothing of it left in storage
            await self._remove_rendition(offer)
            result = None
        if result is None:
            self.jobs.pop(key_of(offer), None)
            await self.heartbeat()
            return
        if self.metrics:
            self.metrics.inc("jobs_total", 1, "jobs by outcome", outcome=result.outcome)
            self.metrics.inc("job_seconds_total", time.monotonic() - t0, "time spent on jobs")
        await self._record(result)
        log.info("%s %s %dp attempt %d in %.2f s", result.outcome, offer.video_id, offer.output, offer.attempt,
                 time.monotonic() - t0)
        self.jobs.pop(key_of(offer), None)  # the slot frees once the result cannot be lost
        await self.heartbeat()  # tells encode at once that a slot is free
        with contextlib.suppress(Exception):  # else the delivery loop tries again
            await self.deliver(only=key_of(offer))

    async def _encode(self, job: Job, out: Path) -> OutputResult | None:
        offer = job.offer
        source = await open_source(
            self.s3, self.settings.s3_bucket, offer.object_key, url_ttl=self.settings.media_source_url_ttl_seconds
        )
        if job.handed_back:
            return self._result(job, "handed_back", reason="worker_stopping")
        if job.cancelled:
            return None
        container = source.sniffed.container
        if container is None:
            return self._result(job, "failed", reason="unsupported_source",
                                message="the source is not a video container Weir reads")
        args = domain.encode_args(source.url, skip=source.sniffed.id3_bytes_skipped, container=container,
                                  height=offer.output, output=str(out), options=self.options)
        code, tail = await self._ffmpeg(job, args)
        if job.handed_back:
            return self._result(job, "handed_back", reason="worker_stopping")
        if job.cancelled:
            return None
        if code != 0:
            message = " | ".join(line.replace(source.url, "<source>") for line in tail)[-1000:]
            return self._result(job, "failed", reason="ffmpeg_failed", message=message or f"ffmpeg exited {code}")
        key = rendition_key(offer.video_id, offer.output, offer.attempt)
        size = await asyncio.to_thread(os.path.getsize, out)
        await self.s3.upload_file(str(out), self.settings.s3_bucket, key, ExtraArgs={"ContentType": "video/mp4"})
        return self._result(job, "completed", object_key=key, size=size)

    async def _remove_rendition(self, offer: Offer) -> None:
        """A cancelled job's rendition, whole or partly written, goes: its key is this attempt's alone, and encode
        takes no result of a job it cancelled. Tried a few times; encode removes it too if a result ever comes."""
        key = rendition_key(offer.video_id, offer.output, offer.attempt)
        for attempt in range(1, REMOVE_ATTEMPTS + 1):
            try:
                await self.s3.delete_object(Bucket=self.settings.s3_bucket, Key=key)
                return
            except Exception as exc:
                if attempt == REMOVE_ATTEMPTS:
                    log.warning("could not remove %s of a cancelled job: %r", key, exc)
                    return
                await asyncio.sleep(self.settings.media_result_retry_seconds)

    async def _ffmpeg(self, job: Job, args: list[str]) -> tuple[int, list[str]]:
        proc = await asyncio.create_subprocess_exec(
            ffmpeg_exe(), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_worker,
        )  # fmt: skip
        job.proc = proc
        if job.cancelled or job.handed_back:
            proc.kill()
        assert proc.stdout is not None and proc.stderr is not None
        reader = domain.ProgressReader()
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)

        async def stderr() -> None:
            assert proc.stderr is not None
            async for raw in proc.stderr:
                line = raw.decode("utf-8", errors="replace").rstrip()
                if reader.duration is None and (d := domain.duration_seconds(line)) is not None:
                    reader.duration = d
                tail.append(line)

        async def stdout() -> None:
            assert proc.stdout is not None
            last = 0.0
            async for raw in proc.stdout:
                fraction = reader.feed(raw.decode("utf-8", errors="replace"))
                now = time.monotonic()
                if fraction is not None and (now - last >= self.settings.media_progress_seconds or reader.ended):
                    last = now
                    self._spawn(self._progress(job, fraction))

        try:
            await asyncio.gather(stderr(), stdout())
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
        return code, list(tail)

    async def _progress(self, job: Job, fraction: float) -> None:
        if job.cancelled:  # encode no longer wants it (its video may be gone): say nothing more of it
            return
        o = job.offer
        event = new_event(EncodeProgress(video_id=o.video_id, output=o.output, worker=self.name, progress=fraction),
                          source=SOURCE, subject=o.video_id)
        with contextlib.suppress(Exception):  # progress is a hint: the next one says more
            await self.js.publish(event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id}, timeout=2.0)

    def _result(self, job: Job, outcome: Outcome, **fields: Any) -> OutputResult:
        o = job.offer
        return OutputResult(video_id=o.video_id, output=o.output, attempt=o.attempt, worker=self.name,
                            instance=self.instance, outcome=outcome, finished_at=datetime.now(UTC), **fields)

    # ------------------------------------------------------------------------------------------ results

    async def _record(self, result: OutputResult) -> None:
        """The result in this service's table; retried until the database answers (the slot stays held meanwhile)."""
        while True:
            try:
                async with self.pool.acquire() as conn:
                    await conn.execute(
                        "INSERT INTO results (video_id, output, attempt, payload) VALUES ($1, $2, $3, $4)"
                        " ON CONFLICT DO NOTHING",
                        result.video_id, result.output, result.attempt, result.model_dump_json(),
                    )
                return
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("cannot record a result yet: %s", exc)
                await asyncio.sleep(self.settings.media_result_retry_seconds)

    async def deliver(self, only: Key | None = None, limit: int = 50) -> int:
        """Deliver recorded, undelivered results (any worker's) to encode; returns how many it acknowledged."""
        delivered: list[Key] = []
        async with self.pool.acquire() as conn, conn.transaction():
            if only is None:
                rows = await conn.fetch(
                    "SELECT video_id, output, attempt, payload FROM results WHERE delivered_at IS NULL"
                    " ORDER BY recorded_at LIMIT $1 FOR UPDATE SKIP LOCKED", limit,
                )
            else:
                rows = await conn.fetch(
                    "SELECT video_id, output, attempt, payload FROM results WHERE delivered_at IS NULL"
                    " AND video_id = $1 AND output = $2 AND attempt = $3 FOR UPDATE SKIP LOCKED", *only,
                )
            for row in rows:
                try:
                    reply = await self.nc.request(RESULT_SUBJECT, row["payload"].encode(),
                                                  timeout=RESULT_REQUEST_TIMEOUT)
                    ack = ResultAck.model_validate_json(reply.data)
                except (NoRespondersError, NatsTimeout, TimeoutError, ValidationError) as exc:
                    log.info("encode did not take a result yet (%s); retrying later", type(exc).__name__)
                    break
                if ack.recorded:
                    delivered.append((row["video_id"], row["output"], row["attempt"]))
            if delivered:
                await conn.execute(
                    "UPDATE results SET delivered_at = now() FROM unnest($1::text[], $2::int[], $3::int[])"
                    " AS d(v, o, a) WHERE video_id = d.v AND output = d.o AND attempt = d.a",
                    [d[0] for d in delivered], [d[1] for d in delivered], [d[2] for d in delivered],
                )
        return len(delivered)

    async def deliver_loop(self, stop: asyncio.Event) -> None:
        last_cleanup = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.media_result_retry_seconds)
            try:
                await self.deliver()
                if time.monotonic() - last_cleanup > 60:
                    last_cleanup = time.monotonic()
                    async with self.pool.acquire() as conn:  # delivered results are kept as long as sent events
                        await conn.execute(
                            "DELETE FROM results WHERE delivered_at < now() - make_interval(secs => $1)",
                            float(self.settings.outbox_keep_sent_seconds),
                        )
            except Exception as exc:
                log.warning("result delivery: %s", exc)

    # ----------------------------------------------------------------------------------------- heartbeats

    def heartbeat_message(self) -> Heartbeat:
        running = [
            RunningJob(video_id=j.offer.video_id, output=j.offer.output, attempt=j.offer.attempt,
                       job_class=j.offer.job_class, started_at=j.started_at)
            for j in self.jobs.values() if not j.cancelled
        ]
        return Heartbeat(worker=self.name, instance=self.instance, slots=self.settings.media_slots, running=running,
                         leaving=self.leaving, sent_at=datetime.now(UTC))

    async def heartbeat(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(HEARTBEAT_SUBJECT, self.heartbeat_message().model_dump_json().encode())

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.heartbeat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.media_heartbeat_seconds)

    # ---------------------------------------------------------------------------------------------- misc

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _count(self, name: str, **labels: str) -> None:
        if self.metrics:
            self.metrics.inc(name, 1, "dispatch offers by answer", **labels)
