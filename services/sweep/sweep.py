"""One sweep run: survey the candidates, apply the safety valve, then confirm and retire under row locks.

1. Survey (no locks): candidates page by page, their open uploads and files; what is not left would be retired.
2. Valve: a run that would retire too large a share of its candidates stops here, before retiring anything.
3. Confirm, a batch of rows per transaction: lock, read storage again, retire only what all reads agree on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from enum import StrEnum

import asyncpg

from services.sweep import domain, store
from services.sweep.domain import (
    Confirm,
    Decision,
    FileRead,
    Leave,
    LeaveReason,
    Outcome,
    Retire,
    RunReport,
    Tally,
    Trigger,
    UploadsState,
)
from services.sweep.settings import SweepSettings
from services.sweep.storage import Storage
from shared import db

log = logging.getLogger("weir.sweep")


class ReadStage(StrEnum):
    SURVEY_UPLOADS = "survey_uploads"
    SURVEY_FILE = "survey_file"  # only candidates with an open upload
    SURVEYED = "surveyed"  # a page of candidates decided; nothing locked yet
    LOCKED = "locked"  # the batch's rows are locked; no storage read yet
    CONFIRM_FILE = "confirm_file"  # the first read under the lock
    CONFIRM_UPLOADS = "confirm_uploads"
    CONFIRM_FILE_AGAIN = "confirm_file_again"


ReadHook = Callable[[ReadStage, Sequence[str]], Awaitable[None]]
"""Called with the video ids after each stage of reads: tests drive races through it, deterministically."""

Progress = Callable[[str, int, int | None], None]
"""(phase, done, total): phase is `survey` (total unknown until the end) or `confirm`."""


class SweepBusy(Exception):
    """Another sweep run holds the run lock."""


class _Stopped(Exception):
    """The process is stopping: the run ends between batches (what it committed stays committed)."""


@dataclass
class Sweeper:
    pool: asyncpg.Pool
    storage: Storage
    settings: SweepSettings
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    hook: ReadHook | None = None
    stopping: asyncio.Event | None = None  # set on shutdown: the run ends at the next page or batch

    @property
    def min_age(self) -> timedelta:
        return timedelta(seconds=self.settings.sweep_min_age_seconds)

    @property
    def claim_stale(self) -> timedelta:
        return timedelta(seconds=self.settings.claim_stale_seconds)

    # ------------------------------------------------------------------------------------ entry points

    async def run(self, *, dry_run: bool = False, force: bool = False, now: datetime | None = None,
                  progress: Progress | None = None, outcomes: dict[str, str] | None = None,
                  on_start: Callable[[RunReport], Awaitable[None]] | None = None) -> RunReport:
        """An on-demand run; `SweepBusy` when another run is in progress anywhere."""
        report = await self._locked_run(Trigger.ON_DEMAND, None, dry_run=dry_run, force=force, now=now,
                                        progress=progress, outcomes=outcomes, on_start=on_start)
        assert report is not None
        return report

    async def run_daily(self, day: date, *, now: datetime | None = None) -> RunReport | None:
        """The daily run for `day`, unless one already ran; `SweepBusy` while another run is in progress."""
        return await self._locked_run(Trigger.DAILY, day, dry_run=False, force=False, now=now, progress=None,
                                      outcomes=None, on_start=None)

    async def _locked_run(self, trigger: Trigger, daily_for: date | None, *, dry_run: bool, force: bool,
                          now: datetime | None, progress: Progress | None, outcomes: dict[str, str] | None,
                          on_start: Callable[[RunReport], Awaitable[None]] | None) -> RunReport | None:
        async with db.session(self.pool) as lock_conn:  # the run's lock is the session's: reset on release
            if not await store.try_run_lock(lock_conn):
                raise SweepBusy("another sweep run is in progress")
            try:
                interrupted = await store.mark_interrupted(lock_conn)
                if interrupted:
                    log.warning("sweep: %d earlier run(s) ended with their process; marked interrupted", interrupted)
                if daily_for is not None and await store.daily_done(lock_conn, daily_for):
                    return None  # another instance ran this day's sweep
                report = RunReport(id=str(uuid.uuid4()), trigger=trigger, dry_run=dry_run, force=force,
                                   started_at=self.clock(), daily_for=daily_for)
                await store.start_run(lock_conn, report)
                if on_start is not None:
                    await on_start(report)
                started = time.monotonic()
                try:
                    await self._sweep(report, now=now or self.clock(), progress=progress, outcomes=outcomes)
                except _Stopped:
                    report.outcome = Outcome.INTERRUPTED
                    report.note = "stopped with its process; the next run takes up what is left"
                except Exception as exc:
                    log.exception("sweep run %s failed", report.id)
                    report.outcome = Outcome.FAILED
                    report.note = f"{type(exc).__name__}: {exc}"[:1000]
                report.finished_at = self.clock()
                report.duration_seconds = time.monotonic() - started
                await store.finish_run(lock_conn, report)
                return report
            finally:
                await store.release_run_lock(lock_conn)

    # ------------------------------------------------------------------------------------ the run

    async def _sweep(self, report: RunReport, *, now: datetime, progress: Progress | None,
                     outcomes: dict[str, str] | None) -> None:
        tally = report.tally
        record = _Recorder(tally, outcomes)
        slots = asyncio.Semaphore(self.settings.sweep_storage_concurrency)
        proposals = await self._survey(now, record, slots, progress)

        for _, reason in proposals.values():
            tally.would_retire[reason] += 1
        verdict = domain.safety_valve(
            tally.examined, len(proposals), max_share=self.settings.sweep_max_retire_share,
            min_candidates=self.settings.sweep_valve_min_candidates, force=report.force,
        )
        if verdict.stop:
            for vid in proposals:
                record.leave(vid, Leave(LeaveReason.SAFETY_VALVE))
            report.outcome = Outcome.STOPPED
            report.note = verdict.message
            log.warning("sweep run %s stopped by the safety valve: %s", report.id, verdict.message)
            return

        # batches of neighbouring keys (one app's, mostly): each batch's one listing covers a narrower prefix
        in_key_order = sorted(proposals, key=lambda vid: proposals[vid][0])
        await self._confirm(in_key_order, now, record, slots, progress, dry_run=report.dry_run)
        report.outcome = Outcome.COMPLETED
        notes = []
        if tally.left_alone.get(LeaveReason.STORAGE_UNCERTAIN):
            notes.append(f"storage could not say for certain for {tally.left_alone[LeaveReason.STORAGE_UNCERTAIN]}"
                         f" candidate(s), left alone (first: {record.first_uncertain})")
            log.warning("sweep run %s: %s", report.id, notes[-1])
        if tally.errors:
            notes.append(f"{tally.errors} error(s) (first: {record.first_error})")
        report.note = "; ".join(notes)

    async def _survey(self, now: datetime, record: _Recorder, slots: asyncio.Semaphore,
                      progress: Progress | None) -> dict[str, tuple[str, str]]:
        """Every candidate once, without locks: which to lock and read again (the valve needs the whole count)."""
        cutoff = domain.candidate_cutoff(now, self.min_age)
        proposals: dict[str, tuple[str, str]] = {}  # video id -> (object key, why the survey would retire it)
        async with self.pool.acquire() as conn:
            async for page in store.candidates(conn, cutoff=cutoff, page=self.settings.sweep_page_size):
                self._check_stopping()
                await self._survey_page(page, now, record, slots, proposals)
                if progress:
                    progress("survey", record.tally.examined, None)
        return proposals

    async def _survey_page(self, page: list[store.Candidate], now: datetime, record: _Recorder,
                           slots: asyncio.Semaphore, proposals: dict[str, tuple[str, str]]) -> None:
        """One page: its open uploads (one listing where storage allows), the file where an upload is open."""
        record.tally.examined += len(page)
        to_read = []
        for c in page:
            if domain.claim_protects(c.completion_claimed_at, now=now, stale_after=self.claim_stale):
                record.leave(c.id, Leave(LeaveReason.CLAIM_FRESH))
            else:
                to_read.append(c)
        if to_read:
            async with slots:
                uploads = await self.storage.read_uploads([c.object_key for c in to_read])
            await self._hook(ReadStage.SURVEY_UPLOADS, [c.id for c in to_read])
            with_upload = [c for c in to_read if uploads[c.object_key].state is UploadsState.OPEN]
            files = await self._read_files(with_upload, slots)
            await self._hook(ReadStage.SURVEY_FILE, [c.id for c in with_upload])
            for c in to_read:
                decision = domain.survey_decision(uploads[c.object_key], files.get(c.id), now=now,
                                                  min_age=self.min_age)
                if isinstance(decision, Retire | Confirm):
                    proposals[c.id] = (c.object_key, str(decision.reason))
                else:
                    record.leave(c.id, decision)
        await self._hook(ReadStage.SURVEYED, [c.id for c in page])

    async def _confirm(self, proposals: list[str], now: datetime, record: _Recorder,
                       slots: asyncio.Semaphore, progress: Progress | None, *, dry_run: bool) -> None:
        size = self.settings.sweep_batch_size
        batches = [proposals[i:i + size] for i in range(0, len(proposals), size)]
        batch_slots = asyncio.Semaphore(self.settings.sweep_batch_concurrency)
        done = 0

        async def one(batch: list[str]) -> None:
            nonlocal done
            async with batch_slots:
                if self.stopping is not None and self.stopping.is_set():
                    return  # every batch in flight finishes; none starts
                try:
                    await self._confirm_batch(batch, now, record, slots, dry_run=dry_run)
                except Exception as exc:  # the batch's transaction rolled back: nothing of it was retired
                    log.exception("sweep: a batch of %d failed", len(batch))
                    for vid in batch:
                        if vid not in record.settled:
                            record.error(vid, exc)
            done += len(batch)
            if progress:
                progress("confirm", done, len(proposals))

        if progress:
            progress("confirm", 0, len(proposals))
        await asyncio.gather(*(one(b) for b in batches))
        self._check_stopping()

    async def _confirm_batch(self, ids: list[str], now: datetime, record: _Recorder, slots: asyncio.Semaphore,
                             *, dry_run: bool) -> None:
        """Lock the rows (`FOR UPDATE SKIP LOCKED`), skip those with a fresh completion claim, read storage again
        (file, open uploads, file) and retire what all three agree on: remove from storage, mark retired, write
        `video.retired` to the outbox, commit. The locks last until that commit, so the api's initiate (same row
        lock) then finds the video retired, and its complete (open uploads only) cannot slip in."""
        cutoff = domain.candidate_cutoff(now, self.min_age)
        settled: dict[str, Decision] = {}
        async with self.pool.acquire() as conn, conn.transaction():
            locked = await store.lock_candidates(conn, ids, cutoff=cutoff)
            locked_ids = {c.id for c in locked}
            missing = [vid for vid in ids if vid not in locked_ids]
            if missing:
                waiting = await store.still_candidates(conn, missing, cutoff=cutoff)
                for vid in missing:
                    settled[vid] = Leave(LeaveReason.ROW_LOCKED if vid in waiting
                                         else LeaveReason.NO_LONGER_CANDIDATE)
            await self._hook(ReadStage.LOCKED, [c.id for c in locked])
            to_read = []
            for c in locked:
                # read again under the lock: a completion may have claimed it since the survey
                if domain.claim_protects(c.completion_claimed_at, now=now, stale_after=self.claim_stale):
                    settled[c.id] = Leave(LeaveReason.CLAIM_FRESH)
                else:
                    to_read.append(c)
            decisions = await self._confirming_reads(to_read, now, slots)
            retiring = [(c, d) for c in to_read if isinstance(d := decisions[c.id], Retire)]
            for c in to_read:
                if not isinstance(decisions[c.id], Retire):
                    settled[c.id] = decisions[c.id]
            if dry_run:
                for c, d in retiring:
                    settled[c.id] = Leave(LeaveReason.DRY_RUN, d.reason.value)
                retiring = []
            removed = await asyncio.gather(*(self._remove(c, d, slots) for c, d in retiring), return_exceptions=True)
            retirements: list[tuple[str, domain.RetireReason, int]] = []
            for (c, d), failure in zip(retiring, removed, strict=True):
                if isinstance(failure, Exception):  # storage did not confirm the removal: not retired this run
                    record.error(c.id, failure)
                    continue
                if isinstance(failure, BaseException):
                    raise failure
                retirements.append((c.id, d.reason, d.bytes_removed))
                settled[c.id] = d
            await store.retire(conn, retirements)
        # committed: the rows are retired and their events are in the outbox, or neither
        for vid, decision in settled.items():
            record.settle(vid, decision)

    async def _confirming_reads(self, candidates: list[store.Candidate], now: datetime,
                                slots: asyncio.Semaphore) -> dict[str, Decision]:
        """Under the row locks: the file, the open uploads, the file again; retire only where all three agree."""
        if not candidates:
            return {}
        ids = [c.id for c in candidates]
        first = await self._read_files(candidates, slots)
        await self._hook(ReadStage.CONFIRM_FILE, ids)
        async with slots:
            uploads = await self.storage.read_uploads([c.object_key for c in candidates])
        await self._hook(ReadStage.CONFIRM_UPLOADS, ids)
        second = await self._read_files(candidates, slots)
        await self._hook(ReadStage.CONFIRM_FILE_AGAIN, ids)
        return {
            c.id: domain.confirmed_decision(first[c.id], uploads[c.object_key], second[c.id], now=now,
                                            min_age=self.min_age)
            for c in candidates
        }

    async def _read_files(self, candidates: list[store.Candidate], slots: asyncio.Semaphore) -> dict[str, FileRead]:
        async def one(c: store.Candidate) -> tuple[str, FileRead]:
            async with slots:
                return c.id, await self.storage.read_file(c.object_key)

        return dict(await asyncio.gather(*(one(c) for c in candidates)))

    async def _remove(self, c: store.Candidate, decision: Retire, slots: asyncio.Semaphore) -> None:
        async with slots:
            for upload_id in decision.abort_uploads:
                await self.storage.abort_upload(c.object_key, upload_id)
            if decision.remove_file:
                await self.storage.remove_file(c.object_key)

    def _check_stopping(self) -> None:
        if self.stopping is not None and self.stopping.is_set():
            raise _Stopped

    async def _hook(self, stage: ReadStage, ids: Sequence[str]) -> None:
        if self.hook is not None and ids:
            await self.hook(stage, ids)


class _Recorder:
    """Counts each candidate once, keeps the first uncertain answer and error for the report."""

    def __init__(self, tally: Tally, outcomes: dict[str, str] | None) -> None:
        self.tally = tally
        self.outcomes = outcomes
        self.settled: set[str] = set()
        self.first_uncertain = ""
        self.first_error = ""

    def leave(self, vid: str, decision: Leave) -> None:
        self.tally.leave(decision.reason)
        if decision.reason is LeaveReason.STORAGE_UNCERTAIN and not self.first_uncertain:
            self.first_uncertain = decision.detail
        self._note(vid, f"left:{decision.reason.value}")

    def settle(self, vid: str, decision: Decision) -> None:
        if isinstance(decision, Leave) and decision.reason is LeaveReason.DRY_RUN:
            self.tally.would_have_retired(domain.RetireReason(decision.detail))
            self._note(vid, f"left:dry_run:{decision.detail}")
        elif isinstance(decision, Retire):
            self.tally.retire(decision.reason, decision.bytes_removed)
            self._note(vid, f"retired:{decision.reason.value}")
        else:
            self.leave(vid, decision)

    def error(self, vid: str, exc: BaseException) -> None:
        self.tally.errors += 1
        if not self.first_error:
            self.first_error = f"{type(exc).__name__}: {exc}"[:300]
        self._note(vid, "error")

    def _note(self, vid: str, what: str) -> None:
        self.settled.add(vid)
        if self.outcomes is not None:
            self.outcomes[vid] = what
