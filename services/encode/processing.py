"""What encode does: open videos, run their dispatch rounds, apply results and heartbeats, answer status requests.

Each step reads and changes a video under its row lock, decides with `domain`, and writes its events to the outbox in
the same transaction. A round commits its new attempts before any offer goes out, and records the answers in a second
transaction: a kill -9 in between leaves the outputs `offered`, in doubt, which heartbeats (or the doubt window) settle,
so no output is lost and none runs twice at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from opentelemetry.context import Context

from services.encode import domain, store
from services.encode.domain import AnswerKind, FailureReason, FarmAnswer
from services.encode.farm import Farm, Registry
from services.encode.settings import EncodeSettings
from shared import db, tracing
from shared.consumer import NotYet, Refused
from shared.contracts import origin_of
from shared.events import (
    DispatchBusy,
    EncodeCompleted,
    EncodeFailed,
    EncodeStarted,
    Event,
    EventData,
    RecordingCompleted,
    new_event,
)
from shared.events.catalog import PublisherRejected
from shared.media.objects import remove_prefix
from shared.media.playback import artwork_prefix, hls_prefix, video_prefix
from shared.media.probe import PROBE_TIMEOUT_S
from shared.media.protocol import (
    Heartbeat,
    JobKey,
    Offer,
    Outcome,
    OutputResult,
    OutputStatus,
    ProcessingStatus,
    ResultAck,
)
from shared.media.source import open_source, probe_source
from shared.metrics import Metrics
from shared.outbox import enqueue
from shared.videos import JobClass, OutputState, ProcessingState, shown_output_state

log = logging.getLogger("weir.encode")

SOURCE = "encode"
STUCK_MESSAGE = "encoding took too long; offered again"
REJECTED_SALT = b"weir publisher.rejected"
Clock = Callable[[], datetime]
CancelList = list[tuple[str, str, int, int]]  # (worker instance, video, height, attempt)


def rejection_id(event_id: str | None) -> str | None:
    """The id of the publisher.rejected of a refused event: a UUIDv7 with the refused event's time and bits hashed
    from its id, the same each time it is told (None, a fresh one: the event had no readable UUIDv7 id)."""
    try:
        refused = uuid.UUID(event_id or "")
    except ValueError:
        return None
    if refused.version != 7:
        return None
    digest = bytearray(hashlib.sha256(REJECTED_SALT + refused.bytes).digest()[:16])
    digest[:6] = refused.bytes[:6]  # the refused event's millisecond timestamp
    digest[6] = 0x70 | (digest[6] & 0x0F)  # version 7
    digest[8] = 0x80 | (digest[8] & 0x3F)  # RFC 9562 variant
    return str(uuid.UUID(bytes=bytes(digest)))


def utcnow() -> datetime:
    return datetime.now(UTC)


def event(data: EventData, video_id: str) -> Any:
    return new_event(data, source=SOURCE, subject=video_id)


def _shown(video_id: str, video: store.Video | None, restarted: tuple[int, ...] = ()) -> ProcessingStatus:
    """A video's processing state as encode.status answers it (`found=False`: encode does not know the video)."""
    if video is None:
        return ProcessingStatus(video_id=video_id, found=False)
    return ProcessingStatus(
        video_id=video_id, found=True, status=video.state.value, deadline_at=video.deadline.deadline_at,
        busy_at=video.deadline.busy_at,
        outputs=[OutputStatus(height=o.height, state=shown_output_state(o.state),
                              worker=o.worker if o.state in (OutputState.ENCODING, OutputState.DONE) else None,
                              started_at=o.started_at, restarts=video.restarts.get(o.height, 0))
                 for o in video.outputs],
        failure_reason=video.failure_reason, failure_message=video.failure_message, restarted=list(restarted),
    )


@dataclass
class Processing:
    settings: EncodeSettings
    pool: asyncpg.Pool
    farm: Farm
    s3: Any
    metrics: Metrics | None = None
    clock: Clock = utcnow
    listening_since: float = field(default_factory=time.monotonic)  # heard and recorded heartbeats since (monotonic)

    def __post_init__(self) -> None:
        self.wake = asyncio.Event()
        self.capacity = False  # a slot freed since the last pass: offer to waiting videos now

    @property
    def registry(self) -> Registry:
        return self.farm.registry

    # --------------------------------------------------------------------------------------- intake

    async def open(self, conn: asyncpg.Connection, *, video_id: str, job_class: JobClass, object_key: str,
                   source_height: int | None, account_id: str | None = None, learned_from: str = "") -> None:
        """upload.completed / recording.completed, in the consumer's transaction: processing starts now. The
        account, when the event names it, is remembered first: its encode.* events go on its subjects."""
        if account_id is not None:
            await self.learn_account(conn, video_id, account_id, learned_from=learned_from)
        await store.open_video(conn, video_id=video_id, job_class=job_class, object_key=object_key,
                               source_height=source_height, now=self.clock(),
                               deadline_seconds=self.settings.processing_deadline_seconds,
                               traceparent=tracing.current_traceparent())

    async def learn_account(self, conn: asyncpg.Connection, video_id: str, account_id: str, *,
                            learned_from: str) -> None:
        """video.created, upload.completed, video.deleted: the video's account (the first word stays)."""
        held = await store.learn_account(conn, video_id, account_id, learned_from=learned_from, now=self.clock())
        if held != account_id:
            log.warning("%s says video %s is account %s's; encode holds it as %s's", learned_from, video_id,
                        account_id, held)

    async def take_recording(self, conn: asyncpg.Connection, event: Event[RecordingCompleted], origin: str) -> None:
        """recording.completed, in the consumer's transaction: opened if `domain.recording_decision` accepts it;
        raises Refused (parked, the team told) or NotYet (delivered again while the video's account may still come).
        Under the video id's lock, so no upload, deletion or other recording of it commits between check and open."""
        data = event.data
        origin_fields = domain.RecordingOrigin()
        found = origin_of(origin)
        if found is not None and found[1]:  # the account subject; `{}`: the bare legacy one
            tokens = found[1]
            origin_fields = domain.RecordingOrigin(account=tokens["account_id"], publisher=tokens["publisher"],
                                                   job_class=tokens["job_class"])
        await store.lock_video_id(conn, data.recording_id)
        facts = await store.video_facts(conn, data.recording_id)
        now = self.clock()
        wait = self.settings.recording_owner_wait_seconds
        decision = domain.recording_decision(origin_fields, data.object_key, facts, published_at=event.time, now=now,
                                             owner_wait_seconds=wait)
        if decision.verdict == domain.RecordingVerdict.REFUSE:
            assert decision.code is not None
            raise Refused(decision.reason, decision.code.value)
        if decision.verdict == domain.RecordingVerdict.WAIT:
            raise NotYet(decision.reason, domain.recording_retry_in(event.time, now, wait,
                                                                    self.settings.consumer_nak_delay_seconds))
        assert decision.job_class is not None
        await self.open(conn, video_id=data.recording_id, job_class=decision.job_class, object_key=data.object_key,
                        source_height=domain.known_ladder_side(data.source_width, data.source_height),
                        account_id=decision.remember_owner,
                        learned_from=event.type)
        log.info("recording %s taken from %s as a %s job", data.recording_id, origin, decision.job_class.value)

    async def tell_publisher(self, subject: str, event_id: str | None, reason: str, code: str) -> None:
        """A parked event from a team (on_park): `publisher.rejected` on `publisher.<name>.rejected`, through the
        outbox. Its id follows from the refused event's, so a park told twice (a redelivery) is one event on the bus;
        a bare legacy subject names no publisher: nothing to tell."""
        found = origin_of(subject)
        if found is None or "publisher" not in found[1]:
            return
        event_type, tokens = found
        publisher = tokens["publisher"]
        data = PublisherRejected(publisher=publisher, event_id=event_id, event_type_refused=event_type,
                                 subject=subject, reason=reason[:2000], code=code)
        rejected = new_event(data, source=SOURCE, subject=publisher, id=rejection_id(event_id))
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                if not await store.in_outbox(conn, rejected.id):
                    await enqueue(conn, rejected)
        except Exception as exc:
            if db.database_away(exc):
                raise  # the message is not acked: parked and told again on its redelivery
            log.exception("could not tell %s of its refused %s %s", publisher, event_type, event_id)
            return
        log.info("told %s: %s %s refused (%s)", publisher, event_type, event_id, code)
        if self.metrics:
            self.metrics.inc("publisher_rejections_total", 1, "teams' events refused or parked, by code", code=code)

    async def delete(self, conn: asyncpg.Connection, *, video_id: str) -> None:
        """video.deleted, in the consumer's transaction: processing stops for good, whatever its state.

        Pending outputs are never offered again, running jobs are told to stop, every file encoding made of the
        video (renditions, HLS, artwork: all under its prefix) is removed, all before the commit (repeatable: a
        failure rolls back and the redelivery does them again); afterwards a late answer, heartbeat or result of the
        video's jobs is stopped or ignored (`judge_result`, `reconcile`), and what it wrote removed.
        """
        now = self.clock()
        await store.lock_video_id(conn, video_id)  # an upload.completed of it handled meanwhile opens nothing
        video = await store.load(conn, video_id, lock=True)
        plan = domain.deletion_plan(video.state if video else None, video.outputs if video else ())
        await store.record_deletion(conn, video_id, known=video is not None, now=now)
        if not plan.delete:
            log.info("video %s deleted (%s)", video_id, "already" if video else "never processed here")
            return
        await store.mark_deleted(conn, video_id, plan.cancel, now)
        removed = await remove_prefix(self.s3, self.settings.s3_bucket, video_prefix(video_id),
                                      batch=self.settings.delete_batch_size)
        await self._cancel([(s.instance, video_id, s.height, s.attempt) for s in plan.stop], "deleted")
        log.info("video %s deleted: %d outputs cancelled, %d jobs stopped, %d renditions done, %d files removed",
                 video_id, len(plan.cancel), len(plan.stop), len(plan.remove), removed)
        if self.metrics:
            self.metrics.inc("videos_deleted_total", 1, "videos whose processing stopped because they were deleted")

    # --------------------------------------------------------------------------------------- rounds

    def lease(self, offers: int = len(domain.LADDER)) -> timedelta:
        """How long a round holds its video: each offer waits at most one answer timeout (a timeout ends the offer),
        plus room for the database. Short, so that the rounds of an instance killed mid-round resume soon; a round
        that overruns it is still safe, since only pending outputs are ever offered, each under a new attempt."""
        return timedelta(seconds=(offers + 2) * self.settings.dispatch_answer_timeout_ms / 1000 + 1.0)

    async def claim(self, *, limit: int, waiting: bool) -> list[str]:
        now = self.clock()
        async with self.pool.acquire() as conn:
            return await store.claim(conn, now=now, hold_until=now + self.lease(), limit=limit, waiting=waiting)

    async def next_due(self) -> datetime | None:
        async with self.pool.acquire() as conn:
            return await store.next_due(conn)

    async def round(self, video_id: str) -> list[FarmAnswer]:
        """One dispatch round of a claimed video; returns the answers its offers got. Traced in the video's trace
        (the span of its upload.completed's handling): its offers, and so the farm's jobs, join that trace."""
        parent = await self._trace_of(video_id) if tracing.enabled() else None
        with tracing.span("encode dispatch round", context=parent, video_id=video_id) as span:
            try:
                answers = await self._round(video_id)
            except Exception as exc:
                tracing.failed(span, exc)
                log.exception("round of %s failed; the lease expires and another round retries", video_id)
                return []
            span.set_attribute("weir.answers", [a.kind.value for a in answers])
            return answers

    async def _trace_of(self, video_id: str) -> Context:
        """The context a round of the video runs in: its stored trace, else a trace of its own."""
        try:
            async with self.pool.acquire() as conn:
                return tracing.context_of(await store.traceparent(conn, video_id)) or tracing.ROOT
        except Exception:  # the round itself meets the database's trouble, and says so
            return tracing.ROOT

    async def _round(self, video_id: str, *, probed: bool = False) -> list[FarmAnswer]:
        retry = timedelta(seconds=self.settings.dispatch_retry_seconds)
        cancels: CancelList = []
        offered: dict[int, int] = {}
        async with self.pool.acquire() as conn, conn.transaction():
            now = self.clock()
            video = await store.load(conn, video_id, lock=True)
            if video is None or video.state != ProcessingState.PROCESSING:
                return []
            unprobed = video.source_height is None and not video.outputs
            plan = domain.plan_tick(video.deadline, video.outputs, now,
                                    doubt_seconds=self.settings.media_heartbeat_timeout_seconds)
            if plan.fail is not None:
                cancels = await self._fail(conn, video.video_id, plan.fail, domain.DEADLINE_MESSAGE, now)
            elif not unprobed:
                await store.settle(conn, video_id, plan.settle)
                offered = await store.mark_offered(conn, video_id, plan.offer, now)
                if not offered:
                    await store.release(conn, video_id, now + retry)
        await self._cancel(cancels, "failed")
        if unprobed and plan.fail is None:  # upload.completed did not know the height: probe, then the round
            return await self._round(video_id, probed=True) if not probed and await self._probe(video_id) else []
        if not offered:
            return []
        # the attempts are committed: whatever happens to this process now, no offer is out that encode forgot
        answers: dict[int, FarmAnswer] = {}
        artwork = domain.artwork_output(o.height for o in video.outputs)
        for height, attempt in sorted(offered.items()):
            answers[height] = await self.farm.offer(Offer(
                video_id=video.video_id, output=height, attempt=attempt, job_class=video.job_class,
                object_key=video.object_key, source_height=video.source_height, account_id=video.account_id,
                artwork=height == artwork,
            ))
        await self._record_round(video_id, offered, answers)
        return list(answers.values())

    async def _record_round(self, video_id: str, offered: dict[int, int], answers: dict[int, FarmAnswer]) -> None:
        now = self.clock()  # when encode learned the answers: the outputs' started_at
        async with self.pool.acquire() as conn, conn.transaction():
            video = await store.load(conn, video_id, lock=True)
            if video is None or video.state != ProcessingState.PROCESSING:  # it failed or was deleted meanwhile
                await self._cancel([(a.instance, video_id, h, offered[h]) for h, a in answers.items()
                                    if a.kind == AnswerKind.ACCEPTED and a.instance is not None],
                                   video.state.value if video else None)
                return
            events = []
            for height, answer in answers.items():
                attempt = offered[height]
                if answer.kind == AnswerKind.ACCEPTED:
                    assert answer.worker is not None and answer.instance is not None
                    if await store.accept(conn, video_id, height, attempt, worker=answer.worker,
                                          instance=answer.instance, now=now):
                        log.info("%s %dp attempt %d accepted by %s", video_id, height, attempt, answer.worker)
                        events.append(new_event(EncodeStarted(video_id=video_id, output=height,
                                                              worker=answer.worker, account_id=video.account_id),
                                                source=SOURCE, subject=video_id, time=now))  # as in started_at
                elif not answer.in_doubt:
                    await store.unoffer(conn, video_id, height, attempt)
            encoding = domain.any_encoding(video.outputs, offered_now=answers.keys())
            outcome = domain.deadline_after_round(
                video.deadline, [a.kind for a in answers.values()], heard=any(a.heard for a in answers.values()),
                encoding=encoding, now=now, deadline_seconds=self.settings.processing_deadline_seconds,
            )
            if outcome.dispatch_busy:
                assert outcome.deadline.busy_at is not None
                workers = sorted({w for a in answers.values() for w in a.busy_workers})
                events.append(event(DispatchBusy(video_id=video_id, outputs_offered=sorted(answers),
                                                 workers_answered=workers, busy_at=outcome.deadline.busy_at),
                                    video_id))
            await store.finish_round(conn, video_id, outcome.deadline,
                                     now + timedelta(seconds=self.settings.dispatch_retry_seconds))
            if events:
                await enqueue(conn, *events)
        self._count_answers(answers.values())

    async def _probe(self, video_id: str) -> bool:
        """A source whose height upload.completed did not know is probed (sniffed past ID3 tags, then ffmpeg)
        before its first round; True when its ladder is now known."""
        async with self.pool.acquire() as conn:
            video = await store.load(conn, video_id)
            if video is None:
                return False
            await store.hold(conn, video_id, self.clock() + self.lease(0) + timedelta(seconds=PROBE_TIMEOUT_S))
        try:
            source = await open_source(self.s3, self.settings.s3_bucket, video.object_key,
                                       url_ttl=self.settings.probe_url_ttl_seconds)
            info = await probe_source(source)
        except Exception as exc:  # storage trouble: the next round probes again (the deadline still runs)
            log.warning("cannot probe %s yet: %s", video_id, exc)
            retry = timedelta(seconds=self.settings.dispatch_retry_seconds)
            async with self.pool.acquire() as conn:
                await store.release(conn, video_id, self.clock() + retry)
            return False
        async with self.pool.acquire() as conn, conn.transaction():
            locked = await store.load(conn, video_id, lock=True)
            if locked is None or locked.state != ProcessingState.PROCESSING:
                return False
            if info is None:
                await self._fail(conn, video_id, FailureReason.UNREADABLE_SOURCE,
                                 "the source could not be read as a video", self.clock())
                return False
            if locked.source_height is None:
                # the ladder goes by the shorter side as shown: a portrait source's is its width
                await store.set_ladder(conn, video_id, domain.ladder_side(info.display_width, info.display_height))
        return True

    async def _fail(self, conn: asyncpg.Connection, video_id: str, reason: FailureReason, message: str,
                    now: datetime) -> CancelList:
        cancels = await store.fail_video(conn, video_id, reason.value, message, now)
        account = await store.account_of(conn, video_id)
        await enqueue(conn, event(EncodeFailed(video_id=video_id, output=None, worker=None, reason=reason.value,
                                               message=message, account_id=account), video_id))
        log.info("video %s failed: %s", video_id, reason.value)
        if self.metrics:
            self.metrics.inc("videos_failed_total", 1, "videos failed by reason", reason=reason.value)
        return cancels

    async def _cancel(self, cancels: CancelList, reason: str | None = None) -> None:
        by_instance: dict[str, list[JobKey]] = {}
        for instance, video_id, height, attempt in cancels:
            by_instance.setdefault(instance, []).append(JobKey(video_id=video_id, output=height, attempt=attempt))
        for instance, jobs in by_instance.items():
            try:
                await self.farm.cancel(instance, jobs, reason)
            except Exception as exc:  # a lost cancel is repeated when the worker's next heartbeat lists the job
                log.warning("could not send a cancel to worker %s: %r", instance, exc)

    def _count_answers(self, answers: Any) -> None:
        if self.metrics:
            for a in answers:
                self.metrics.inc("dispatch_answers_total", 1, "dispatch answers by kind", answer=a.kind.value)

    # --------------------------------------------------------------------------------------- results

    async def apply_result(self, result: OutputResult) -> ResultAck:
        """A worker's result: applied once if it is the output's current attempt, else ignored (and acknowledged)."""
        tracing.tag_video(result.video_id)  # the span of the request, in the job's trace (FastStream's middleware)
        stale = False
        cancels: CancelList = []
        async with self.pool.acquire() as conn, conn.transaction():
            now = self.clock()
            video = await store.load(conn, result.video_id, lock=True)
            output = video.output(result.output) if video else None
            verdict = domain.judge_result(video.state if video else None, output, result.attempt)
            if verdict == domain.Verdict.STALE:
                stale = True
                log.info("ignored a stale result of %s %dp attempt %d from %s", result.video_id, result.output,
                         result.attempt, result.worker)
            elif verdict == domain.Verdict.APPLY:
                assert video is not None and output is not None
                cancels = await self._apply(conn, video, output, result, now)
        await self._cancel(cancels, "failed")
        if stale:
            await self._remove_attempt(result)
        if self.metrics:
            self.metrics.inc("results_total", 1, "worker results by verdict", verdict=verdict.value)
        return ResultAck(recorded=True, applied=verdict == domain.Verdict.APPLY)

    async def _remove_attempt(self, result: OutputResult) -> None:
        """An ignored result's files: its rendition, its HLS files and its artwork, all under keys of its attempt's
        own, which nothing else refers to. Best effort: a failure leaves them to the video's deletion."""
        bucket = self.settings.s3_bucket
        try:
            if result.object_key:
                await self.s3.delete_object(Bucket=bucket, Key=result.object_key)
            await remove_prefix(self.s3, bucket, hls_prefix(result.video_id, result.output, result.attempt))
            if result.artwork is not None:  # the prefix is this attempt's only if its job made the artwork
                await remove_prefix(self.s3, bucket, artwork_prefix(result.video_id, result.attempt))
        except Exception as exc:
            log.warning("could not remove the files of an ignored result of %s %dp attempt %d: %r", result.video_id,
                        result.output, result.attempt, exc)

    async def _apply(self, conn: asyncpg.Connection, video: store.Video, output: domain.Output,
                     result: OutputResult, now: datetime) -> CancelList:
        """Apply a current result; returns the jobs to stop if it failed the video."""
        vid, height, account = video.video_id, output.height, video.account_id
        cancels: CancelList = []
        if output.state == OutputState.OFFERED and await store.adopt(
            conn, vid, height, result.attempt, worker=result.worker, instance=result.instance, now=now
        ):  # the worker's acceptance was lost (encode stopped between offer and answer) and no heartbeat has said it
            # runs this job yet: the result is the first word of it, so it was started, by that worker, just now
            await enqueue(conn, event(EncodeStarted(video_id=vid, output=height, worker=result.worker,
                                                    account_id=account), vid))
        if result.outcome == Outcome.COMPLETED and result.object_key is not None and result.size is not None:
            remaining = await store.complete_output(conn, vid, height, worker=result.worker, instance=result.instance,
                                                    object_key=result.object_key, size=result.size)
            await store.keep_playback(conn, vid, height, result.attempt, hls=result.hls, artwork=result.artwork)
            await enqueue(conn, event(EncodeCompleted(video_id=vid, output=height, worker=result.worker,
                                                      object_key=result.object_key, size=result.size,
                                                      outputs_remaining=remaining, account_id=account,
                                                      hls=result.hls, artwork=result.artwork), vid))
            if remaining == 0:
                await store.mark_ready(conn, vid, now)
                log.info("video %s ready", vid)
            await store.notify(conn, "capacity")
        elif result.outcome == Outcome.HANDED_BACK:
            await store.return_output(conn, vid, height, now=now)
            await store.notify(conn, "capacity")
        else:
            reason = result.reason or "encode_failed"
            message = result.message or "the worker could not encode this output"
            await enqueue(conn, event(EncodeFailed(video_id=vid, output=height, worker=result.worker, reason=reason,
                                                   message=message[:2000], account_id=account), vid))
            if output.failures + 1 >= self.settings.output_max_failures:
                cancels = await self._fail(conn, vid, FailureReason.ENCODE_ERROR, message[:2000], now)
            else:
                await store.return_output(conn, vid, height, now=now, failed=True)
            await store.notify(conn, "capacity")
        return cancels

    # --------------------------------------------------------------------------------------- status

    async def status(self, video_id: str) -> ProcessingStatus:
        """One video's processing state (encode.status v1): `statuses` of that one video."""
        return (await self.statuses([video_id]))[0]

    async def statuses(self, video_ids: Sequence[str]) -> list[ProcessingStatus]:
        """The processing state of each distinct video asked, in the order asked (v1 asks one, v2 a page); an output
        encoding past the stuck threshold is restarted now (SPEC section 6). The videos are read in one go without a
        lock; only one with a stuck output is read again under its lock, where the rule decides again."""
        asked = list(dict.fromkeys(video_ids))
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            known = await store.load_many(conn, asked)  # videos and outputs of one snapshot
        now = self.clock()
        shown: list[ProcessingStatus] = []
        for video_id in asked:
            video = known.get(video_id)
            if video is not None and self._stuck(video, now):
                shown.append(await self._restart_stuck(video_id))
            else:
                shown.append(_shown(video_id, video))
        return shown

    def _stuck(self, video: store.Video, now: datetime) -> tuple[int, ...]:
        if video.state != ProcessingState.PROCESSING:
            return ()
        return domain.stuck_outputs(video.outputs, video.deadline.busy_at, now, self.settings.stuck_restart_seconds)

    async def _restart_stuck(self, video_id: str) -> ProcessingStatus:
        """Under the video's lock: restart the outputs that are stuck now, and show the state after."""
        cancels: CancelList = []
        restarted: tuple[int, ...] = ()
        async with self.pool.acquire() as conn, conn.transaction():
            now = self.clock()
            video = await store.load(conn, video_id, lock=True)
            if video is None:
                return _shown(video_id, None)
            restarted = self._stuck(video, now)
            for height in restarted:
                o = video.output(height)
                assert o is not None and o.instance is not None
                cancels.append((o.instance, video_id, height, o.attempt))
                await store.return_output(conn, video_id, height, now=now, restarted=True)
                await enqueue(conn, event(EncodeFailed(video_id=video_id, output=height, worker=o.worker,
                                                       reason="stuck_restarted", message=STUCK_MESSAGE,
                                                       account_id=video.account_id), video_id))
                log.info("restarted %s %dp: encoding on %s since %s", video_id, height, o.worker, o.started_at)
            if restarted:
                await store.notify(conn, "due")
                video = await store.load(conn, video_id)
                assert video is not None
        await self._cancel(cancels, "stuck_restarted")
        if self.metrics and restarted:
            self.metrics.inc("stuck_restarts_total", len(restarted), "outputs restarted by the stuck rule")
        return _shown(video_id, video, restarted)

    # ------------------------------------------------------------------------------------ heartbeats

    async def heartbeat(self, hb: Heartbeat) -> None:
        """Record a worker's heartbeat; adopt offers it runs whose answer was lost; cancel what encode does not want."""
        if self.registry.heard(hb):  # a slot freed (or a worker came): offer to waiting videos now, before the write
            self.capacity = True
            self.wake.set()
        try:
            cancels = await self._record_heartbeat(hb)
        except Exception as exc:  # unrecorded: the silence it leaves says nothing of the worker
            self.missed_heartbeats()
            if not db.database_away(exc):
                raise
            log.info("a heartbeat of %s was not recorded: %r", hb.worker, exc)
            return
        await self._cancel(cancels, "not_wanted")

    def missed_heartbeats(self) -> None:
        """Heartbeats went unheard or unrecorded (the database or the bus away): a whole timeout of listening again
        before any worker is judged dead by its silence."""
        self.listening_since = time.monotonic()

    async def _record_heartbeat(self, hb: Heartbeat) -> CancelList:
        reported = [domain.Reported(j.video_id, j.output, j.attempt) for j in hb.running]
        cancels: CancelList = []
        async with self.pool.acquire() as conn, conn.transaction():
            now = self.clock()
            await store.record_heartbeat(conn, instance=hb.instance, name=hb.worker, slots=hb.slots,
                                         leaving=hb.leaving, now=now)
            if reported:
                known = await store.known_outputs(conn, [(r.video_id, r.height) for r in reported])
                plan = domain.reconcile(hb.instance, reported, known)
                for job in plan.adopt:
                    if await store.adopt(conn, job.video_id, job.height, job.attempt, worker=hb.worker,
                                         instance=hb.instance, now=now):
                        account = await store.account_of(conn, job.video_id)
                        await enqueue(conn, event(EncodeStarted(video_id=job.video_id, output=job.height,
                                                                worker=hb.worker, account_id=account), job.video_id))
                cancels = [(hb.instance, j.video_id, j.height, j.attempt) for j in plan.cancel]
        return cancels

    def may_declare_dead(self) -> bool:
        return domain.may_declare_dead(time.monotonic() - self.listening_since,
                                       self.settings.media_heartbeat_timeout_seconds)

    async def bury_dead_workers(self) -> list[str]:
        """Workers silent past the timeout are dead: their encoding outputs go back to pending, offered again."""
        if not self.may_declare_dead():
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            now = self.clock()
            dead = await store.declare_dead(
                conn, silent_since=now - timedelta(seconds=self.settings.media_heartbeat_timeout_seconds), now=now
            )
            if not dead:
                return []
            await store.forget_dead_workers(conn, now - timedelta(seconds=self.settings.outbox_keep_sent_seconds))
            returned = await store.encoding_on(conn, dead)
            for video_id, height, _ in returned:
                await store.return_output(conn, video_id, height, now=now)
            if returned:
                await store.notify(conn, "due")
        for instance in dead:
            self.registry.forget(instance)
        log.info("workers declared dead: %s; %d outputs back to pending", ", ".join(dead), len(returned))
        if self.metrics:
            self.metrics.inc("outputs_returned_total", len(returned), "outputs returned from dead workers")
        return dead

    async def refresh_metrics(self) -> None:
        """The farm as this instance sees it (per worker: slots, busy slots), and the outputs waiting for one."""
        if self.metrics is None:
            return
        async with self.pool.acquire() as conn:
            waiting = await store.outputs_waiting(conn)
        slots: dict[str, int] = {}
        busy: dict[str, int] = {}
        for w in self.registry.heard_recently():  # by name: a restarted worker's old instance adds to the new one
            slots[w.name] = slots.get(w.name, 0) + w.slots
            busy[w.name] = busy.get(w.name, 0) + min(w.slots, w.developer_running + w.first_party_running)
        m = self.metrics
        m.set("outputs_waiting", waiting)
        m.set("farm_workers", len(self.registry.live()))
        m.clear("farm_worker_slots")  # workers come and go: only the live ones have series
        m.clear("farm_worker_busy_slots")
        for name, n in slots.items():
            m.set("farm_worker_slots", n, worker=name)
            m.set("farm_worker_busy_slots", busy[name], worker=name)

    async def load_registry(self) -> None:
        """On start, the workers heard from recently (by any instance), until their own heartbeats arrive."""
        now = self.clock()
        async with self.pool.acquire() as conn:
            rows = await store.live_workers(
                conn, now - timedelta(seconds=self.settings.media_heartbeat_timeout_seconds)
            )
        for r in rows:
            view = domain.WorkerView(name=r["name"], instance=r["instance"], slots=r["slots"])
            self.registry.remember(view, (now - r["last_seen"]).total_seconds())


# ------------------------------------------------------------------------------------------ the dispatcher


async def run_rounds(processing: Processing, video_ids: list[str], limit: int,
                     on_answers: Callable[[list[FarmAnswer]], Awaitable[None]] | None = None) -> None:
    """Rounds of several claimed videos, `limit` at a time."""
    slots = asyncio.Semaphore(limit)

    async def one(video_id: str) -> None:
        async with slots:
            answers = await processing.round(video_id)
            if on_answers is not None:
                await on_answers(answers)

    await asyncio.gather(*(one(v) for v in video_ids))


async def dispatch_pass(processing: Processing) -> int:
    """Due rounds; then, if a slot freed, rounds of waiting videos (oldest first) until the farm answers busy."""
    batch = 64
    ran = 0
    while True:
        claimed = await processing.claim(limit=batch, waiting=False)
        ran += len(claimed)
        await run_rounds(processing, claimed, processing.settings.dispatch_concurrency)
        if len(claimed) < batch:
            break
    if processing.capacity:
        processing.capacity = False
        while True:
            claimed = await processing.claim(limit=1, waiting=True)
            if not claimed:
                break
            ran += 1
            answers = await processing.round(claimed[0])
            if not any(a.kind == AnswerKind.ACCEPTED for a in answers):
                break  # the farm is full again (or unreachable): the rest keep their schedule
    return ran
