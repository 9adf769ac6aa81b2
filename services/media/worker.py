"""One encoding worker: answers offers at once, runs ffmpeg per accepted output, records and delivers results.

Admission has no await between its check and its reservation, so two offers racing for the last slot cannot both
get it. A result is recorded in the service's `results` table (which frees the slot) and delivered on `farm.result`
until encode answers. `encode.progress` is a hint published straight to its stream (shared/publishers.py HINTS says
so, for the AsyncAPI document too): a lost one is followed by the next. The protocol, and why it is core NATS, is in
`shared/media/protocol.py`.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from botocore.exceptions import ClientError
from faststream.nats import NatsBroker
from faststream.nats.publisher.usecase import LogicPublisher
from faststream.nats.subscriber.usecases import LogicSubscriber
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import trace
from opentelemetry.trace import Span
from pydantic import ValidationError

from services.media import domain
from services.media.settings import MediaSettings
from shared import tracing
from shared.bus import HDR_LEGACY_COPY
from shared.contracts import contract
from shared.events import EncodeProgress, Envelope, new_event
from shared.media.hls import MalformedMedia, measure_rendition
from shared.media.objects import remove_prefix
from shared.media.playback import Artwork, HlsRendition, artwork_prefix, hls_prefix
from shared.media.probe import ffmpeg_exe
from shared.media.protocol import (
    CANCEL_PATTERN,
    HEARTBEAT_SUBJECT,
    OFFER_PATTERN,
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
from shared.media.source import StoredSource, open_source
from shared.messaging import error_in, unreadable_reply
from shared.metrics import Metrics
from shared.outbox import bus_subject
from shared.publishers import EventPublishers, Outgoing

log = logging.getLogger("weir.media")

SOURCE = "media"
JSON = {"content-type": "application/json"}  # bytes already JSON: said so, as FastStream says it of a model
STDERR_TAIL_LINES = 12
RESULT_REQUEST_TIMEOUT = 5.0
REMOVE_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1
MOOF_BYTES = 1 << 20  # of the first HLS segment, read for its frame rate: its moof comes first and is far smaller
Key = tuple[str, int, int]


class PackagingFailed(Exception):
    """ffmpeg could not remux the rendition into HLS."""


def _die_with_worker() -> None:
    """In the forked ffmpeg: SIGKILL when the worker dies (Linux): a killed worker leaves no encode running unowned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def child_setup(niceness: int) -> Callable[[], None]:
    """The forked ffmpeg's setup: it dies with the worker, and runs `niceness` below the worker's priority."""
    def setup() -> None:
        _die_with_worker()
        if niceness:
            with contextlib.suppress(OSError):
                os.nice(niceness)
    return setup


def _source_missing(exc: Exception) -> bool:
    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in (
        "404", "NoSuchKey", "NotFound")


def progress_messages(event: Envelope, settings: MediaSettings, span: Span | None = None) -> list[Outgoing]:
    """An encode.progress as the outbox relay would publish it: on `encode.progress.<account_id>` when the offer named
    the account, with a copy on the bare type for the release before's consumers (`events_legacy_subjects`); on the
    bare type alone when it did not (an older encode, or a video opened before encode knew its account). `span`: the
    job's, whose trace context both carry in their `traceparent` header."""
    account = bus_subject(event)
    body = event.to_bytes()
    messages = [Outgoing(account or event.type, body, event.id, span=span)]
    if account is not None and settings.events_legacy_subjects and contract(event.type).legacy:
        messages.append(Outgoing(event.type, body, f"{event.id}-legacy", {HDR_LEGACY_COPY: "1"}, span=span))
    return messages


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
    stored: bool = False  # it began writing to storage: what it wrote goes unless it completes

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.handed_back

    @property
    def slotted(self) -> domain.Slotted:
        return domain.Slotted(self.offer.job_class, self.offer.output)


@dataclass
class Worker:
    settings: MediaSettings
    broker: NatsBroker
    events: EventPublishers  # the runtime's, one per event type the service publishes (encode.progress)
    pool: asyncpg.Pool
    s3: Any
    metrics: Metrics | None = None
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    jobs: dict[Key, Job] = field(default_factory=dict)
    leaving: bool = False
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.name = self.settings.media_worker_id or f"{socket.gethostname()}-{os.getpid()}"
        base = Path(self.settings.media_work_dir or tempfile.gettempdir())
        self.work_dir = base / f"weir-media-{self.instance}"
        self.options = domain.EncodeOptions(
            preset=self.settings.media_x264_preset, crf=self.settings.media_x264_crf,
            audio_bitrate_kbps=self.settings.media_audio_bitrate_kbps, read_rate=self.settings.media_read_rate,
            keyframe_seconds=self.settings.media_keyframe_seconds,
        )
        self._declare()

    # ----------------------------------------------------------------------------------------- lifecycle

    def _declare(self) -> None:
        """The worker's subjects on the broker: two subscribers (its own offer and cancel subjects) and two
        publishers. Declared before the broker starts; the first heartbeat goes out once the subscribers are in
        place (`heartbeat_loop`), so no encode instance offers to a worker that cannot hear it yet."""
        b = self.broker
        self.offers: LogicSubscriber[Any] = b.subscriber(
            offer_subject(self.instance), title=f"{OFFER_PATTERN}:Offer",
            description=f"Request from encode, on this worker's own subject ({OFFER_PATTERN}, the instance id "
                        f"{self.instance}): take this output now. Replies OfferAnswer at once (accepted, or busy with "
                        'its reason; never queued), or `{"error": ...}` when the offer does not validate.')
        self.offers(self.on_offer)
        self.cancels: LogicSubscriber[Any] = b.subscriber(
            cancel_subject(self.instance), title=f"{CANCEL_PATTERN}:Cancel",
            description=f"From encode, on this worker's own subject ({CANCEL_PATTERN}): stop these jobs, report no "
                        "result of them, remove what they wrote.")
        self.cancels(self.on_cancel)
        self.heartbeats = b.publisher(
            HEARTBEAT_SUBJECT, schema=Heartbeat, title=f"{HEARTBEAT_SUBJECT}:Heartbeat",
            description="This worker's slots and running jobs, every media_heartbeat_seconds and when a slot frees.")
        self.results: LogicPublisher = b.publisher(
            RESULT_SUBJECT, schema=OutputResult, title=f"{RESULT_SUBJECT}:Result",
            description="Request to encode (queue group encode): one output's result, recorded in this worker's "
                        "table first and sent until encode replies ResultAck after its commit.")

    async def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log.info("worker %s (instance %s) ready with %d slots", self.name, self.instance, self.settings.media_slots)

    async def drain(self) -> None:
        """SIGTERM: take no more offers, give running jobs media_drain_seconds, hand back the rest.

        The runtime stops every subscriber of the broker when SIGTERM comes, this worker's cancel subject too: a cancel
        sent during the drain is not heard, the job runs on until it finishes or is handed back, and encode ignores
        that result as stale (removing its rendition), as it does any result of a job it no longer wants."""
        self.leaving = True  # an offer that still comes is answered busy (leaving)
        await self._stop(self.offers)
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
        await self._stop(self.cancels)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    @staticmethod
    async def _stop(subscriber: LogicSubscriber[Any]) -> None:
        try:  # the runtime may be stopping it at the same time (it stops every subscriber on SIGTERM)
            await subscriber.stop()
        except Exception as exc:
            log.info("subscriber %s stopped with %r", subscriber.subject.template, exc)

    # ------------------------------------------------------------------------------------------ offers

    async def on_offer(self, offer: Offer) -> OfferAnswer:
        """Accepted or busy, at once (the reply is the return value); an accepted job starts as it is answered."""
        tracing.tag_video(offer.video_id)  # FastStream's span of the offer, in the trace of encode's round
        key = key_of(offer)
        if key in self.jobs:  # the same offer again (a retried request): the same answer
            return self._answer(accepted=True)
        slotted = domain.Slotted(offer.job_class, offer.output)
        refusal = domain.admission(self.settings.media_slots, (j.slotted for j in self._holding()), slotted,
                                   large_height=self.settings.large_output_height, leaving=self.leaving)
        if refusal is not None:
            self._count("offers_total", answer="busy")
            return self._answer(accepted=False, reason=refusal.value)
        # reserved with no await since the check: a second offer racing for the last slot sees it taken
        job = Job(offer=offer, started_at=datetime.now(UTC))
        self.jobs[key] = job
        log.info("accepted %s %dp attempt %d (%s)", offer.video_id, offer.output, offer.attempt, offer.job_class)
        self._count("offers_total", answer="accepted")
        self._gauge_slots()
        job.task = asyncio.create_task(self._run(job), name=f"job-{offer.video_id}-{offer.output}")
        return self._answer(accepted=True)

    def _answer(self, *, accepted: bool, reason: str | None = None) -> OfferAnswer:
        return OfferAnswer(accepted=accepted, worker=self.name, instance=self.instance, reason=reason)

    async def on_cancel(self, cancel: Cancel) -> None:
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
        """The job, in a span of its own: the child of the offer's (FastStream's span of the request, in the trace of
        encode's round), so the result it delivers and what encode publishes of it join the video's trace."""
        offer = job.offer
        with tracing.span(f"media job {offer.output}p", video_id=offer.video_id, attributes={
            "weir.output": offer.output, "weir.attempt": offer.attempt, "weir.job_class": offer.job_class,
            "weir.worker": self.name,
        }) as span:
            outcome = await self._run_job(job)
            span.set_attribute("weir.outcome", outcome)

    async def _run_job(self, job: Job) -> str:
        """Runs the job; returns its outcome (or "cancelled": no result)."""
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
                result = self._result(job, Outcome.FAILED, reason="source_missing",
                                      message="the source is not in storage")
            else:  # storage or the machine, not the source: another worker may do better
                log.warning("job %s %dp failed on this worker: %r", offer.video_id, offer.output, exc)
                result = self._result(job, Outcome.HANDED_BACK, reason="worker_error", message=f"{type(exc).__name__}")
        finally:
            with contextlib.suppress(OSError):
                out.unlink()
        if job.cancelled:  # cancelled by encode (whatever it got to): no result, and nothing of it left in storage
            await self._remove_written(offer)
            result = None
        elif result is not None and result.outcome != Outcome.COMPLETED and job.stored:
            await self._remove_written(offer)  # an output is in storage whole, or not at all
        if result is None:
            self.jobs.pop(key_of(offer), None)
            await self.heartbeat()
            return "cancelled"
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
        return result.outcome

    async def _encode(self, job: Job, out: Path) -> OutputResult | None:
        offer = job.offer
        source = await open_source(
            self.s3, self.settings.s3_bucket, offer.object_key, url_ttl=self.settings.media_source_url_ttl_seconds
        )
        if job.handed_back:
            return self._result(job, Outcome.HANDED_BACK, reason="worker_stopping")
        if job.cancelled:
            return None
        container = source.sniffed.container
        if container is None:
            return self._result(job, Outcome.FAILED, reason="unsupported_source",
                                message="the source is not a video container Weir reads")
        args = domain.encode_args(source.url, skip=source.sniffed.id3_bytes_skipped, container=container,
                                  height=offer.output, output=str(out), options=self.options)
        code, tail = await self._ffmpeg(job, args)
        if job.handed_back:
            return self._result(job, Outcome.HANDED_BACK, reason="worker_stopping")
        if job.cancelled:
            return None
        if code != 0:
            message = " | ".join(line.replace(source.url, "<source>") for line in tail)[-1000:]
            return self._result(job, Outcome.FAILED, reason="ffmpeg_failed", message=message or f"ffmpeg exited {code}")
        key = rendition_key(offer.video_id, offer.output, offer.attempt)
        size = await asyncio.to_thread(os.path.getsize, out)
        job.stored = True
        await self.s3.upload_file(str(out), self.settings.s3_bucket, key, ExtraArgs={"ContentType": "video/mp4"})
        hls: HlsRendition | None = None
        artwork: Artwork | None = None
        if self.settings.media_hls:
            try:
                hls = await self._package(job, out)
            except PackagingFailed as exc:
                if not job.stopped:
                    return self._result(job, Outcome.FAILED, reason="packaging_failed", message=str(exc)[-1000:])
            if job.stopped:
                return self._stopped_result(job)
            assert hls is not None
            if offer.artwork:
                artwork = await self._artwork(job, source, out, hls.duration)
                if job.stopped:
                    return self._stopped_result(job)
        return self._result(job, Outcome.COMPLETED, object_key=key, size=size, hls=hls, artwork=artwork)

    def _stopped_result(self, job: Job) -> OutputResult | None:
        """A job stopped mid-way: handed back (the worker stops), or no result at all (encode cancelled it)."""
        return self._result(job, Outcome.HANDED_BACK, reason="worker_stopping") if job.handed_back else None

    # ------------------------------------------------------------------------------------- HLS, artwork

    async def _package(self, job: Job, rendition: Path) -> HlsRendition | None:
        """The rendition remuxed to HLS (CMAF) and stored under its attempt's prefix, the playlist last (a stored
        playlist has its segments); measured for the master playlist. None when the job was stopped meanwhile."""
        offer = job.offer
        directory = self.work_dir / f"{offer.video_id}-{offer.output}-{offer.attempt}-hls"
        prefix = hls_prefix(offer.video_id, offer.output, offer.attempt)
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        try:
            code, tail = await self._ffmpeg(job, domain.hls_args(
                str(rendition), str(directory), segment_seconds=self.settings.media_hls_segment_seconds))
            if job.stopped:
                return None
            if code != 0:
                raise PackagingFailed(" | ".join(tail) or f"ffmpeg exited {code}")
            try:
                hls, files = await asyncio.to_thread(self._measure, directory, prefix)
            except MalformedMedia as exc:  # ffmpeg's own output, unreadable: no other worker would do better
                raise PackagingFailed(f"the packaged rendition cannot be measured: {exc}") from exc
            playlist = directory / domain.HLS_PLAYLIST
            await self._upload([(f, prefix + f.name) for f in files if f != playlist])
            await self._upload([(playlist, prefix + playlist.name)])
            return hls
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    @staticmethod
    def _measure(directory: Path, prefix: str) -> tuple[HlsRendition, list[Path]]:
        """What the master playlist says of the packaged files (read from the disk), and the files."""
        files = sorted(directory.iterdir())
        text = (directory / domain.HLS_PLAYLIST).read_text()
        sizes = {f.name: f.stat().st_size for f in files}
        first = next((f for f in files if f.suffix == ".m4s"), None)
        head = None
        if first is not None:
            with first.open("rb") as f:
                head = f.read(MOOF_BYTES)
        hls = measure_rendition(playlist_key=prefix + domain.HLS_PLAYLIST, playlist=text, sizes=sizes,
                                init=(directory / domain.HLS_INIT).read_bytes(), first_segment=head)
        return hls, files

    async def _upload(self, files: list[tuple[Path, str]]) -> None:
        """Files to storage, media_upload_concurrency at a time, each with its content type."""
        limit = asyncio.Semaphore(self.settings.media_upload_concurrency)

        async def one(path: Path, key: str) -> None:
            async with limit:
                await self.s3.upload_file(str(path), self.settings.s3_bucket, key,
                                          ExtraArgs={"ContentType": domain.content_type(path.name)})

        await asyncio.gather(*(one(p, k) for p, k in files))

    async def _artwork(self, job: Job, source: StoredSource, rendition: Path, duration: float) -> Artwork | None:
        """The video's poster and storyboard, for the one job of the video encode asked them of. A failure is logged
        and counted, and the output completes without them (encode keeps no artwork of the video)."""
        offer = job.offer
        try:
            return await self._make_artwork(job, source, rendition, duration)
        except Exception as exc:
            if job.stopped:
                return None
            # the message may hold the source's presigned URL (its signature is a credential): never logged
            log.warning("no artwork for %s (%dp attempt %d): %s", offer.video_id, offer.output, offer.attempt,
                        str(exc).replace(source.url, "<source>")[-500:] or type(exc).__name__)
            if self.metrics:
                self.metrics.inc("artwork_failures_total", 1, "jobs whose poster or storyboard could not be made")
            with contextlib.suppress(Exception):
                await remove_prefix(self.s3, self.settings.s3_bucket, artwork_prefix(offer.video_id, offer.attempt))
            return None

    async def _make_artwork(self, job: Job, source: StoredSource, rendition: Path, duration: float
                            ) -> Artwork | None:
        s, offer = self.settings, job.offer
        directory = self.work_dir / f"{offer.video_id}-{offer.output}-{offer.attempt}-art"
        prefix = artwork_prefix(offer.video_id, offer.attempt)
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        try:
            poster, sprite, vtt = directory / domain.POSTER, directory / domain.SPRITE, directory / domain.STORYBOARD
            at = domain.poster_time(s.media_poster_seconds, duration)
            container = source.sniffed.container
            assert container is not None
            code, tail = await self._ffmpeg(job, domain.poster_args(
                source.url, skip=source.sniffed.id3_bytes_skipped, container=container, at=at,
                max_height=s.media_poster_max_height, output=str(poster), quality=s.media_jpeg_quality))
            if job.stopped:
                return None
            if code != 0:
                raise RuntimeError("poster: " + " | ".join(tail))
            plan = domain.storyboard_plan(duration, keyframe_seconds=s.media_keyframe_seconds,
                                          max_tiles=s.media_storyboard_max_tiles, columns=s.media_storyboard_columns)
            tiles = 0

            def count(line: str) -> None:
                nonlocal tiles
                tiles += domain.storyboard_tile(line)

            code, tail = await self._ffmpeg(job, domain.storyboard_args(
                str(rendition), plan=plan, keyframe_seconds=s.media_keyframe_seconds,
                tile_width=s.media_storyboard_tile_width, output=str(sprite), quality=s.media_jpeg_quality),
                on_stderr=count)
            if job.stopped:
                return None
            if code != 0 or tiles == 0:
                raise RuntimeError(f"storyboard ({tiles} tiles): " + " | ".join(tail[-3:]))
            poster_w, poster_h = domain.jpeg_size(await asyncio.to_thread(poster.read_bytes))
            sprite_w, sprite_h = domain.jpeg_size(await asyncio.to_thread(sprite.read_bytes))
            tile_w, tile_h = sprite_w // plan.columns, sprite_h // plan.rows
            tiles = min(tiles, plan.columns * plan.rows)
            text = domain.storyboard_vtt(plan, tiles=tiles, tile_width=tile_w, tile_height=tile_h, duration=duration)
            await asyncio.to_thread(vtt.write_text, text)
            await self._upload([(f, prefix + f.name) for f in (poster, sprite, vtt)])
            return Artwork(poster_key=prefix + poster.name, poster_time=at, poster_width=poster_w,
                           poster_height=poster_h, sprite_key=prefix + sprite.name, storyboard_key=prefix + vtt.name,
                           tile_width=tile_w, tile_height=tile_h, tiles=tiles, interval=plan.interval,
                           duration=round(duration, 6))
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    async def _remove_written(self, offer: Offer) -> None:
        """What a job that did not complete wrote, whole or in part, goes: its rendition, its HLS files and its
        artwork are this attempt's alone, and encode takes no result of a job it cancelled. Tried a few times; encode
        removes them too if a result ever comes."""
        bucket = self.settings.s3_bucket
        key = rendition_key(offer.video_id, offer.output, offer.attempt)
        prefixes = [hls_prefix(offer.video_id, offer.output, offer.attempt)]
        if offer.artwork:
            prefixes.append(artwork_prefix(offer.video_id, offer.attempt))
        for attempt in range(1, REMOVE_ATTEMPTS + 1):
            try:
                await self.s3.delete_object(Bucket=bucket, Key=key)
                for prefix in prefixes:
                    await remove_prefix(self.s3, bucket, prefix)
                return
            except Exception as exc:
                if attempt == REMOVE_ATTEMPTS:
                    log.warning("could not remove what %s %dp attempt %d wrote: %r", offer.video_id, offer.output,
                                offer.attempt, exc)
                    return
                await asyncio.sleep(self.settings.media_result_retry_seconds)

    async def _ffmpeg(self, job: Job, args: list[str], on_stderr: Callable[[str], None] | None = None
                      ) -> tuple[int, list[str]]:
        """Runs ffmpeg as the job's process (a cancel or a drain kills it); returns its exit code and its stderr's
        last lines. `-progress` blocks on stdout become encode.progress events; `on_stderr` sees every stderr line."""
        proc = await asyncio.create_subprocess_exec(
            ffmpeg_exe(), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=child_setup(domain.ffmpeg_niceness(first_playable=job.offer.artwork,
                                                           ladder_nice=self.settings.media_ladder_nice)),
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
                if on_stderr is not None:
                    on_stderr(line)
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
        """One encode.progress, in the job's trace (its span is current here, as in every task the job starts): the
        envelope's `traceparent` and the messages' header, as an event from the outbox carries its writer's."""
        if job.cancelled:  # encode no longer wants it (its video may be gone): say nothing more of it
            return
        o = job.offer
        event = new_event(EncodeProgress(video_id=o.video_id, output=o.output, worker=self.name, progress=fraction,
                                         account_id=o.account_id), source=SOURCE, subject=o.video_id,
                          traceparent=tracing.current_traceparent())
        span = trace.get_current_span() if event.traceparent else None
        try:  # the stream named: JetStream acknowledges it (PubAck), or this raises
            for result in await self.events.publish_hint(progress_messages(event, self.settings, span)):
                if isinstance(result, BaseException):
                    raise result
        except Exception as exc:  # progress is a hint: the next one says more
            log.info("a progress event of %s %dp was not stored: %r", o.video_id, o.output, exc)

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
                        "INSERT INTO results (video_id, output, attempt, payload, traceparent)"
                        " VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                        result.video_id, result.output, result.attempt, result.model_dump_json(),
                        tracing.current_traceparent(),  # the job's: its delivery continues the job's trace
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
                    "SELECT video_id, output, attempt, payload, traceparent FROM results WHERE delivered_at IS NULL"
                    " ORDER BY recorded_at LIMIT $1 FOR UPDATE SKIP LOCKED", limit,
                )
            else:
                rows = await conn.fetch(
                    "SELECT video_id, output, attempt, payload, traceparent FROM results WHERE delivered_at IS NULL"
                    " AND video_id = $1 AND output = $2 AND attempt = $3 FOR UPDATE SKIP LOCKED", *only,
                )
            for row in rows:
                try:  # the payload as recorded, byte for byte; in the trace of the job that made it
                    with tracing.continued(row["traceparent"]):
                        reply = await self.results.request(row["payload"].encode(), headers=dict(JSON),
                                                           timeout=RESULT_REQUEST_TIMEOUT)
                except (NoRespondersError, NatsTimeout, TimeoutError) as exc:
                    log.info("encode did not take a result yet (%s); retrying later", type(exc).__name__)
                    break
                try:
                    ack = ResultAck.model_validate_json(reply.body)
                except ValidationError as exc:
                    # refused (it does not validate for encode) or an answer this worker cannot read: it stays
                    # undelivered (sent again on the next delivery), and the results behind it still go
                    refused = error_in(reply.body)
                    if refused is None:
                        unreadable_reply(RESULT_SUBJECT, reply.headers, exc, outcome=(
                            f"the result of {row['video_id']} {row['output']}p attempt {row['attempt']} stays "
                            "undelivered"))
                    else:
                        log.warning("encode refused the result of %s %sp attempt %s: %s", row["video_id"],
                                    row["output"], row["attempt"], refused.error.detail[:300])
                    continue
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
            for j in self._holding()
        ]
        return Heartbeat(worker=self.name, instance=self.instance, slots=self.settings.media_slots, running=running,
                         leaving=self.leaving, sent_at=datetime.now(UTC))

    async def heartbeat(self) -> None:
        self._gauge_slots()  # a heartbeat follows every freed slot: the gauges are as current as encode's view
        try:
            with tracing.outside_traces():  # sent from a job's span too (a freed slot): never part of its trace
                await self.heartbeats.publish(self.heartbeat_message())
        except Exception as exc:  # the next one carries the same facts
            log.info("a heartbeat was not sent: %r", exc)

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

    def _holding(self) -> Iterator[Job]:
        """The jobs that hold a slot: a cancelled one frees its slot at once (admission, heartbeats and gauges agree),
        while its killed ffmpeg and its clean-up finish in the background."""
        return (j for j in self.jobs.values() if not j.cancelled)

    def _gauge_slots(self) -> None:
        if self.metrics:
            self.metrics.set("media_slots", self.settings.media_slots)
            self.metrics.set("media_busy_slots", sum(1 for _ in self._holding()))

    def _count(self, name: str, **labels: str) -> None:
        if self.metrics:
            self.metrics.inc(name, 1, "dispatch offers by answer", **labels)
