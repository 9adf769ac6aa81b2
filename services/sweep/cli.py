"""`weir sweep run [--dry-run] [--force]` and `weir sweep history`.

A run goes to the sweep service over NATS (`sweep.run`), which runs it and reports progress; when no sweep service
answers (or NATS does not), the CLI runs it in this process with the same code, and publishes the events it wrote
to the outbox. Both go through a FastStream broker of the CLI's own (`shared.messaging.tool_broker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.sweep.domain import Outcome, RunReport
from services.sweep.settings import SweepSettings
from shared.release import VERSION
from shared.settings import local_stack_settings

# NATS, FastStream and the trigger's models are imported where a run needs them: `weir` registers this app, and
# every other `weir` command (`weir rollout` during a deploy) would pay their import, the better part of a second

sweep_app = typer.Typer(no_args_is_help=True, help="The sweep: retire uploads that never received a file.")
console = Console()
INACTIVITY_SECONDS = 60.0  # the service heartbeats every couple of seconds; this long a silence means it is gone
ANSWER_SECONDS = 30.0  # the service answers once the run holds the run lock, or at once when it cannot
EXIT_STOPPED = 3  # stopped by the safety valve
EXIT_BUSY = 4  # another run is in progress


def sweep_settings() -> SweepSettings:
    """Settings from the environment; addresses and seeds from a running `weir up` (.weir/stack.json) where not
    set."""
    return SweepSettings(**local_stack_settings())


class _Bar:
    """The progress bar: survey (a count; the total is known only at its end), then confirm (M of N)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase not in ("survey", "confirm"):
            return
        if phase not in self.tasks:
            label = "survey (read storage)" if phase == "survey" else "confirm (row locks, read again, retire)"
            self.tasks[phase] = self.progress.add_task(label, total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total)


@sweep_app.command("run")
def run(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="decide and report; retire and remove nothing")] = False,
    force: Annotated[bool, typer.Option("--force", help="proceed past the safety valve")] = False,
    local: Annotated[bool, typer.Option("--local", help="run in this process, not in the sweep service")] = False,
) -> None:
    """Run the sweep now: a progress bar, then a summary table."""
    settings = sweep_settings()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        bar = _Bar(progress)
        try:
            report = asyncio.run(_run(settings, dry_run=dry_run, force=force, local=local, bar=bar))
        except _Refused as exc:
            progress.stop()
            console.print(f"[red]sweep: {exc}[/red]")
            raise typer.Exit(EXIT_BUSY) from exc
        except _Unreadable as exc:  # one line, not a traceback: what could not be read, and where to look
            progress.stop()
            console.print(f"[red]sweep: {exc}[/red]", soft_wrap=True)
            raise typer.Exit(1) from exc
    console.print(summary_table(report))
    if report.note:
        console.print(report.note)
    if report.outcome is Outcome.STOPPED:
        raise typer.Exit(EXIT_STOPPED)
    if report.outcome is Outcome.FAILED:
        raise typer.Exit(1)


class _Refused(Exception):
    pass


class _Unreadable(Exception):
    """The sweep service answered something this version cannot read."""


def _unreadable(what: str, exc: Exception, sender: str) -> _Unreadable:
    """`sender`: the sweep service's release (its reply's Weir-Version header; "unknown" before 1.1.0)."""
    from services.sweep.trigger import RUN_SUBJECT

    reason = _summary(exc) if isinstance(exc, ValidationError) else str(exc)
    return _Unreadable(f"{RUN_SUBJECT}: the sweep service sent {what} this version cannot read (this release "
                       f"{VERSION}, the sweep service's {sender}: {reason[:300]}); see `weir sweep history`")


def _summary(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                     for e in exc.errors(include_url=False, include_input=False))


async def _run(settings: SweepSettings, *, dry_run: bool, force: bool, local: bool, bar: _Bar) -> RunReport:
    if not local:
        report = await _ask_service(settings, dry_run=dry_run, force=force, bar=bar)
        if report is not None:
            return report
        console.print("no sweep service answers: running here")
    return await _run_here(settings, dry_run=dry_run, force=force, bar=bar)


async def _ask_service(settings: SweepSettings, *, dry_run: bool, force: bool, bar: _Bar) -> RunReport | None:
    """The run, by the sweep service; None when no sweep service (or no NATS) answers."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from services.sweep.trigger import (
        RUN_SUBJECT,
        RunAccepted,
        RunRequest,
        RunUpdate,
        UnreadableReport,
        report_from_json,
    )
    from shared.bus import sender_version
    from shared.messaging import error_in, tool_broker

    async with contextlib.AsyncExitStack() as stack:
        try:
            broker = await stack.enter_async_context(tool_broker(settings, "sweep-cli", fail_fast=True))
        except Exception as exc:  # no NATS, so no service to ask: the caller runs the sweep here
            console.print(f"[yellow]NATS unreachable ({type(exc).__name__})[/yellow]")
            return None
        updates: asyncio.Queue[Any] = asyncio.Queue()
        inbox = broker.connection.new_inbox()
        subscriber = broker.subscriber(inbox, title=f"{RUN_SUBJECT}:Updates",
                                       description="progress of the run this CLI asked for, then its report")

        @subscriber
        async def collect(update: Any) -> None:  # read below, so that an unreadable one is an error of this run
            updates.put_nowait(update)

        await subscriber.start()  # declared on a started broker: started here, before the request names its inbox
        request = RunRequest(dry_run=dry_run, force=force, updates=inbox)
        try:
            reply = await broker.request(request, RUN_SUBJECT, timeout=ANSWER_SECONDS)
        except NoRespondersError:
            return None
        except NatsTimeout as exc:
            raise _Refused("the sweep service did not answer in time") from exc
        try:
            answer = RunAccepted.model_validate_json(reply.body)
        except ValidationError as exc:  # refused as invalid (`{"error": ...}`), or an answer this CLI cannot read
            refused = error_in(reply.body)
            if refused is None:
                raise _unreadable("an answer", exc, sender_version(reply.headers)) from exc
            raise _Refused(f"the sweep service refused the request: {refused.error.detail}") from exc
        if not answer.accepted:
            raise _Refused(answer.detail or "refused")
        while True:
            try:
                body = await asyncio.wait_for(updates.get(), timeout=INACTIVITY_SECONDS)
            except TimeoutError as exc:
                raise _Refused(f"the sweep service went silent during run {answer.run_id}; "
                               "see `weir sweep history`") from exc
            try:
                update = RunUpdate.model_validate(body)
                if update.kind == "report" and update.report is not None:
                    return report_from_json(update.report)
            except (ValidationError, UnreadableReport) as exc:
                # the updates come from the service that accepted the run: its reply named its release
                raise _unreadable(f"an update of run {answer.run_id}", exc, sender_version(reply.headers)) from exc
            bar(update.phase, update.done, update.total)


async def _run_here(settings: SweepSettings, *, dry_run: bool, force: bool, bar: _Bar) -> RunReport:
    import asyncpg

    from services.sweep.app import SERVICE
    from services.sweep.storage import S3Storage
    from services.sweep.sweep import SweepBusy, Sweeper
    from shared import db
    from shared.messaging import tool_broker
    from shared.outbox import OutboxRelay
    from shared.publishers import EventPublishers

    conn = await asyncpg.connect(settings.database_url)
    try:
        await db.migrate(conn, "sweep")
    finally:
        await conn.close()
    pool = await db.create_pool(settings.database_url, schema=db.SCHEMAS["sweep"],
                                max_size=settings.sweep_batch_concurrency + 2)
    try:
        async with S3Storage.from_settings(settings) as storage:
            try:
                report = await Sweeper(pool=pool, storage=storage, settings=settings).run(
                    dry_run=dry_run, force=force, progress=bar)
            except SweepBusy as exc:
                raise _Refused(str(exc)) from exc
        # the events this run wrote go out now (the service's relay would send them too, once it runs)
        async with contextlib.AsyncExitStack() as stack:
            try:
                # sweep's events are sweep's to publish: as `sweep` where its seed is at hand (a seed directory);
                # as the CLI's identity otherwise, and a refused publish leaves them for the service's relay
                broker = await stack.enter_async_context(tool_broker(
                    settings, "sweep-cli", fail_fast=True,
                    identity="sweep" if settings.nats_nkey_seed_dir and not settings.nats_identity else "operator"))
            except Exception as exc:
                console.print(f"[yellow]NATS unreachable ({type(exc).__name__}): video.retired events wait in the "
                              "outbox for the sweep service's relay[/yellow]")
                return report
            # the sweep service's own publishers (its event types), as its relay has them
            publishers = EventPublishers(broker, SERVICE.publishes, timeout=settings.bus_publish_timeout_seconds)
            relay = OutboxRelay(pool=pool, publishers=publishers, dsn=settings.database_url,
                                schema=db.SCHEMAS["sweep"])
            while await relay.drain_once():
                pass
        return report
    finally:
        await pool.close()


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()) if v) or "0"


def summary_table(report: RunReport) -> Table:
    t = report.tally
    table = Table("", "", title="sweep run", show_header=False)
    table.add_row("run", report.id)
    table.add_row("trigger", report.trigger.value + (", dry run" if report.dry_run else "")
                  + (", forced" if report.force else ""))
    table.add_row("outcome", report.outcome.value)
    table.add_row("examined", str(t.examined))
    retired = t.dry_run_retire if report.dry_run else t.retired
    table.add_row("would retire (dry run)" if report.dry_run else "retired", str(sum(retired.values())))
    for reason in ("stale_file", "never_uploaded"):
        table.add_row(f"  {reason}", str(retired.get(reason, 0)))
    table.add_row("left alone", str(sum(t.left_alone.values())))
    for reason, n in sorted(t.left_alone.items()):
        table.add_row(f"  {reason}", str(n))
    table.add_row("errors", str(t.errors))
    table.add_row("bytes removed", f"{t.bytes_removed:,}")
    table.add_row("survey said retire", _counts(t.would_retire))
    table.add_row("duration", f"{report.duration_seconds or 0:.2f} s")
    return table


@sweep_app.command("history")
def history(
    limit: Annotated[int, typer.Option(help="how many recent runs")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """Recent runs from the ledger: when, outcome, examined, retired and left alone by reason, errors, duration."""
    from services.sweep.trigger import report_to_json

    runs = asyncio.run(_history(sweep_settings(), limit))
    if as_json:
        print(json.dumps([report_to_json(r) for r in runs], indent=2))
        return
    table = Table("started (UTC)", "trigger", "outcome", "examined", "retired", "left alone", "errors", "duration",
                  "note")
    for r in runs:
        trigger = r.trigger.value + (" (dry run)" if r.dry_run else "") + (" (forced)" if r.force else "")
        retired = _counts(r.tally.retired) if not r.dry_run else f"would: {_counts(r.tally.dry_run_retire)}"
        table.add_row(r.started_at.strftime("%Y-%m-%d %H:%M:%S"), trigger, r.outcome.value, str(r.tally.examined),
                      retired, _counts(r.tally.left_alone), str(r.tally.errors),
                      f"{r.duration_seconds:.2f} s" if r.duration_seconds is not None else "", r.note)
    console.print(table)


async def _history(settings: SweepSettings, limit: int) -> list[RunReport]:
    import asyncpg

    from services.sweep import store
    from shared import db

    conn = await asyncpg.connect(settings.database_url,
                                 server_settings={"search_path": f"{db.quote_ident(db.SCHEMAS['sweep'])}, public"})
    try:
        return await store.recent_runs(conn, limit)
    finally:
        await conn.close()


if __name__ == "__main__":  # `python -m services.sweep.cli`, until `weir sweep` is wired into weir/cli.py
    sweep_app()
