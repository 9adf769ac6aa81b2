"""Wiring of the `sweep` service: the daily run, the on-demand trigger (`sweep.run` over NATS), its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.sweep import domain, store
from services.sweep.domain import Outcome, RunReport
from services.sweep.settings import SweepSettings
from services.sweep.storage import S3Storage
from services.sweep.sweep import SweepBusy, Sweeper
from services.sweep.trigger import (
    HEARTBEAT_SECONDS,
    QUEUE_GROUP,
    RUN_SUBJECT,
    RunAccepted,
    RunRequest,
    RunUpdate,
    report_to_json,
)
from shared.runtime import Runtime, ServiceDefinition

log = logging.getLogger("weir.sweep")


def _settings(rt: Runtime) -> SweepSettings:
    assert isinstance(rt.settings, SweepSettings)
    return rt.settings


def sweeper(rt: Runtime) -> Sweeper:
    s = rt.state["sweeper"]
    assert isinstance(s, Sweeper)
    return s


def count(rt: Runtime, report: RunReport) -> None:
    m, t = rt.metrics, report.tally
    m.inc("sweep_runs_total", 1, "sweep runs by trigger and outcome", trigger=report.trigger.value,
          outcome=report.outcome.value)
    if report.dry_run:
        return
    for reason, n in t.retired.items():
        m.inc("sweep_retired_total", n, "videos retired, by reason", reason=reason)
    for reason, n in t.left_alone.items():
        m.inc("sweep_left_alone_total", n, "candidates left alone, by reason", reason=reason)
    m.inc("sweep_errors_total", t.errors, "candidates a run could not settle")
    m.inc("sweep_bytes_removed_total", t.bytes_removed, "bytes of stale files removed")
    m.set("sweep_last_run_seconds", report.duration_seconds or 0.0, "duration of the last run")


async def start(rt: Runtime) -> None:
    settings = _settings(rt)
    _, _, pool = rt.require()
    storage = await S3Storage.from_settings(settings).open()
    rt.state.update(storage=storage, tasks=set(),
                    sweeper=Sweeper(pool=pool, storage=storage, settings=settings, stopping=rt.stop))
    assert rt.nc is not None

    async def on_request(msg: Msg) -> None:
        # nats-py runs callbacks one at a time: the run gets its own task, so the next request is answered (busy)
        tasks: set[asyncio.Task[None]] = rt.state["tasks"]
        task = asyncio.create_task(on_run(rt, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    rt.state["subs"] = [await rt.nc.subscribe(RUN_SUBJECT, queue=QUEUE_GROUP, cb=on_request)]


async def on_run(rt: Runtime, msg: Msg) -> None:
    """An on-demand run: answer once the run lock is held (or at once if it is not free), then report progress."""
    assert rt.nc is not None
    nc = rt.nc
    try:
        request = RunRequest.model_validate_json(msg.data)
    except ValidationError as exc:
        await msg.respond(RunAccepted(accepted=False, detail=f"bad request: {exc.errors(include_url=False)}"[:500])
                          .model_dump_json().encode())
        return
    last = RunUpdate(kind="progress", phase="starting")

    async def update(u: RunUpdate) -> None:
        with contextlib.suppress(Exception):
            await nc.publish(request.updates, u.model_dump_json().encode())

    def progress(phase: str, done: int, total: int | None) -> None:
        nonlocal last
        last = RunUpdate(kind="progress", phase=phase, done=done, total=total)

    async def heartbeat() -> None:
        while True:  # the latest progress, often enough that the caller knows the run goes on
            await asyncio.sleep(HEARTBEAT_SECONDS / 4)
            await update(last)

    answered = False

    async def accepted(report: RunReport) -> None:
        nonlocal answered
        answered = True
        await msg.respond(RunAccepted(accepted=True, run_id=report.id).model_dump_json().encode())

    beat = asyncio.create_task(heartbeat())
    try:
        report = await sweeper(rt).run(dry_run=request.dry_run, force=request.force, progress=progress,
                                       on_start=accepted)
    except Exception as exc:  # busy, or the database did not answer: say so rather than leave the caller waiting
        if not answered:
            await msg.respond(RunAccepted(accepted=False, detail=str(exc) or type(exc).__name__)
                              .model_dump_json().encode())
        if not isinstance(exc, SweepBusy):
            log.exception("on-demand sweep")
        return
    finally:
        beat.cancel()
    count(rt, report)
    await update(RunUpdate(kind="report", report=report_to_json(report)))


async def stop(rt: Runtime) -> None:
    for sub in rt.state.get("subs", []):
        assert isinstance(sub, Subscription)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    tasks: set[asyncio.Task[None]] = rt.state.get("tasks", set())
    if tasks:
        _, pending = await asyncio.wait(list(tasks), timeout=rt.settings.shutdown_grace_seconds)
        for t in pending:
            t.cancel()
    storage = rt.state.get("storage")
    if isinstance(storage, S3Storage):
        await storage.close()


async def daily_runs(rt: Runtime, stop_event: asyncio.Event) -> None:
    """The daily run at `sweep_daily_at` UTC (or as soon as this instance starts, if today's has not run yet).

    Every instance keeps this loop; the run lock and the ledger let one of them run each day's sweep, once.
    """
    settings = _settings(rt)
    if not settings.sweep_daily_enabled:
        return
    clock: Callable[[], datetime] = rt.state.get("clock") or (lambda: datetime.now(UTC))
    _, _, pool = rt.require()
    while not stop_event.is_set():
        now = clock()
        wait: float
        try:
            async with pool.acquire() as conn:
                done_today = await store.daily_done(conn, now.date())
            day = domain.due_daily_run(now, settings.sweep_daily_at, done_today=done_today)
            if day is None:
                rt.state["daily_checked"] = now.date() if done_today else rt.state.get("daily_checked")
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
                    rt.state["daily_checked"] = day
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
    publishes=("video.retired",),
    on_start=start,
    on_stop=stop,
    background=(daily_runs,),
    description="sweep runs and their ledger; retires uploads that never received a file",
)
