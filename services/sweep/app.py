"""Wiring of the `sweep` service: the daily run, the on-demand trigger (`sweep.run`, a request/reply subscriber on
the broker, with the updates publisher beside it), its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from faststream.nats import NatsBroker
from faststream.nats.publisher.usecase import LogicPublisher

from services.sweep import domain, store
from services.sweep.domain import LeaveReason, Outcome, RunReport
from services.sweep.settings import SweepSettings
from services.sweep.storage import S3Storage
from services.sweep.sweep import SweepBusy, Sweeper
from services.sweep.trigger import (
    HEARTBEAT_SECONDS,
    QUEUE_GROUP,
    RUN_SUBJECT,
    UPDATES_PATTERN,
    RunAccepted,
    RunRequest,
    RunUpdate,
    report_to_json,
)
from shared.messaging import ErrorReply, declare_reply
from shared.runtime import Runtime, ServiceDefinition

log = logging.getLogger("weir.sweep")


def _settings(rt: Runtime) -> SweepSettings:
    assert isinstance(rt.settings, SweepSettings)
    return rt.settings


@dataclass
class SweepParts:
    """What sweep's start makes and its runs, loops and stop use."""

    sweeper: Sweeper
    storage: S3Storage
    runs: set[asyncio.Task[None]] = field(default_factory=set)  # on-demand runs going on, awaited at stop
    daily_checked: date | None = None  # the last day the daily loop found done (or ran): the tests' sign it settled


def parts(rt: Runtime) -> SweepParts:
    return rt.parts_of(SweepParts)


def sweeper(rt: Runtime) -> Sweeper:
    return parts(rt).sweeper


def count(rt: Runtime, report: RunReport) -> None:
    """A finished run on the sweep's metrics (shared/metrics.py): every run, dry ones too; what it retired and left
    alone (storage uncertain among them, counted on its own too) only for runs that change something."""
    m, t = rt.metrics, report.tally
    m.inc("sweep_runs_total", 1, trigger=report.trigger.value, outcome=report.outcome.value)
    m.set("sweep_last_run_seconds", report.duration_seconds or 0.0)
    m.set("sweep_last_run_timestamp_seconds", (report.finished_at or report.started_at).timestamp())
    if report.dry_run:
        return
    for reason, n in t.retired.items():
        m.inc("sweep_retired_total", n, reason=reason)
    for reason, n in t.left_alone.items():
        m.inc("sweep_left_alone_total", n, reason=reason)
    m.inc("sweep_left_uncertain_total", t.left_alone.get(LeaveReason.STORAGE_UNCERTAIN.value, 0))
    m.inc("sweep_errors_total", t.errors)
    m.inc("sweep_bytes_removed_total", t.bytes_removed)


async def start(rt: Runtime) -> None:
    settings = _settings(rt)
    _, _, pool = rt.require()
    assert rt.broker is not None
    storage = await S3Storage.from_settings(settings).open()
    rt.parts = SweepParts(sweeper=Sweeper(pool=pool, storage=storage, settings=settings, stopping=rt.stop),
                          storage=storage)
    serve_runs(rt, rt.broker)


def serve_runs(rt: Runtime, broker: NatsBroker) -> None:
    """`sweep.run` (queue group `sweep`): a request answered once the run holds the run lock (accepted) or at once
    when it cannot (refused); the run goes on in its own task and reports to the inbox the request named."""
    updates = broker.publisher(
        UPDATES_PATTERN, schema=RunUpdate, title=f"{RUN_SUBJECT}:Updates",
        description="Progress of an accepted run, then its final report, published to the `updates` inbox its request "
                    f"named, at least every {HEARTBEAT_SECONDS:g} s while the run goes on.")

    @broker.subscriber(RUN_SUBJECT, queue=QUEUE_GROUP, title=f"{RUN_SUBJECT}:Run",
                       description="Request (`weir sweep run`): run the sweep now. Replies RunAccepted once the run "
                                   "holds the run lock (accepted, with its id) or at once when another run is in "
                                   'progress (refused); `{"error": ...}` when the request does not validate.')
    async def on_run(request: RunRequest) -> RunAccepted:
        return await start_run(rt, request, updates)

    declare_reply(broker, RUN_SUBJECT, RunAccepted | ErrorReply)


async def start_run(rt: Runtime, request: RunRequest, updates: LogicPublisher) -> RunAccepted:
    """Start an on-demand run in its own task; the answer once it holds the run lock, or why it could not."""
    answer: asyncio.Future[RunAccepted] = asyncio.get_running_loop().create_future()
    tasks = parts(rt).runs
    task = asyncio.create_task(run_on_demand(rt, request, updates, answer))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    either: set[asyncio.Future[Any]] = {answer, task}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if answer.done():
        return answer.result()
    return RunAccepted(accepted=False, detail="the run ended before it started")  # run_on_demand answers every way out


async def run_on_demand(rt: Runtime, request: RunRequest, updates: LogicPublisher,
                        answer: asyncio.Future[RunAccepted]) -> None:
    """An on-demand run: answer once the run lock is held (or at once if it is not free), then report progress."""
    last = RunUpdate(kind="progress", phase="starting")

    async def update(u: RunUpdate) -> None:
        try:
            await updates.publish(u, subject=request.updates)
        except Exception as exc:  # the caller learns from the next one, or from the ledger
            log.info("a sweep run update was not sent: %r", exc)

    def progress(phase: str, done: int, total: int | None) -> None:
        nonlocal last
        last = RunUpdate(kind="progress", phase=phase, done=done, total=total)

    async def heartbeat() -> None:
        while True:  # the latest progress, often enough that the caller knows the run goes on
            await asyncio.sleep(HEARTBEAT_SECONDS / 4)
            await update(last)

    async def accepted(report: RunReport) -> None:
        answer.set_result(RunAccepted(accepted=True, run_id=report.id))

    beat = asyncio.create_task(heartbeat())
    try:
        report = await sweeper(rt).run(dry_run=request.dry_run, force=request.force, progress=progress,
                                       on_start=accepted)
    except Exception as exc:  # busy, or the database did not answer: say so rather than leave the caller waiting
        if not answer.done():
            answer.set_result(RunAccepted(accepted=False, detail=str(exc) or type(exc).__name__))
        if not isinstance(exc, SweepBusy):
            log.exception("on-demand sweep")
        return
    finally:
        beat.cancel()
    count(rt, report)
    await update(RunUpdate(kind="report", report=report_to_json(report)))


async def stop(rt: Runtime) -> None:
    if not isinstance(rt.parts, SweepParts):  # the start did not get that far
        return
    if rt.parts.runs:
        _, pending = await asyncio.wait(list(rt.parts.runs), timeout=rt.settings.shutdown_grace_seconds)
        for t in pending:
            t.cancel()
    await rt.parts.storage.close()


async def daily_runs(rt: Runtime, stop_event: asyncio.Event) -> None:
    """The daily run at `sweep_daily_at` UTC (or as soon as this instance starts, if today's has not run yet).

    Every instance keeps this loop; the run lock and the ledger let one of them run each day's sweep, once.
    """
    settings = _settings(rt)
    if not settings.sweep_daily_enabled:
        return
    _, _, pool = rt.require()
    own = parts(rt)
    while not stop_event.is_set():
        now = datetime.now(UTC)
        wait: float
        try:
            async with pool.acquire() as conn:
                done_today = await store.daily_done(conn, now.date())
            day = domain.due_daily_run(now, settings.sweep_daily_at, done_today=done_today)
            if day is None:
                if done_today:
                    own.daily_checked = now.date()
                wait = (domain.next_daily_slot(now, settings.sweep_daily_at) - now).total_seconds()
            else:
                report = await sweeper(rt).run_daily(day)
                if report is not None:
                    count(rt, report)
                    log.info("daily sweep for %s: %s, examined %d, retired %s, left alone %s", day,
                             report.outcome.value, report.tally.examined, dict(report.tally.retired),
                             dict(report.tally.left_alone))
                if report is not None and report.outcome is Outcome.FAILED:
                    wait = settings.sweep_daily_retry_seconds
                else:
                    own.daily_checked = day
                    continue  # look again: the ledger now says done, so the loop sleeps until the next slot
        except SweepBusy:
            wait = settings.sweep_daily_retry_seconds  # another run holds the lock: look again after it
        except Exception:
            log.exception("daily sweep loop")
            wait = settings.sweep_daily_retry_seconds
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), timeout=max(wait, 0.05))


SERVICE = ServiceDefinition(
    name="sweep",
    settings_cls=SweepSettings,
    on_start=start,
    on_stop=stop,
    background=(daily_runs,),
    description="sweep runs and their ledger; retires uploads that never received a file",
)
