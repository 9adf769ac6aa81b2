"""The on-demand trigger over NATS: what `weir sweep run` sends the sweep service, and what comes back.

`sweep.run` (queue group `sweep`) is answered once the run lock is held (accepted, with the run's id) or at once when
another run is in progress (refused); progress, then the report, go to the request's `updates` subject; an invalid
request gets `shared.messaging.ErrorReplies`. Read tolerantly: an unknown update kind is progress, a report's unknown
trigger on demand and unknown outcome failed (with a note), so a caller never takes an unjudgeable outcome as success.
"""

from __future__ import annotations

from collections import Counter
from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.sweep.domain import Outcome, RunReport, Tally, Trigger
from shared.contracts import SWEEP_RUN_SUBJECT
from shared.messaging import unknown_as

RUN_SUBJECT = SWEEP_RUN_SUBJECT
QUEUE_GROUP = "sweep"
UPDATES_PATTERN = "{updates}"  # the updates go to the inbox a request names, whatever its prefix
HEARTBEAT_SECONDS = 2.0  # the service says something at least this often while a run goes on


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class UnreadableReport(ValueError):
    """A run report this version cannot read (a field missing or of another type)."""


class RunRequest(_Model):
    dry_run: bool = False
    force: bool = False
    updates: str = Field(pattern=r"^_INBOX\.[A-Za-z0-9_.-]+$",
                         description="the caller's inbox, for progress and the final report")


class RunAccepted(_Model):
    accepted: bool
    run_id: str | None = None
    detail: str = ""


class RunUpdate(_Model):
    kind: Annotated[Literal["progress", "report"], unknown_as("progress")]  # an unknown kind: a heartbeat
    phase: str = ""
    done: int = 0
    total: int | None = None
    report: dict[str, Any] | None = None


def report_to_json(report: RunReport) -> dict[str, Any]:
    t = report.tally
    return {
        "id": report.id, "trigger": report.trigger.value, "dry_run": report.dry_run, "force": report.force,
        "started_at": report.started_at.isoformat(),
        "daily_for": report.daily_for.isoformat() if report.daily_for else None,
        "outcome": report.outcome.value,
        "finished_at": report.finished_at.isoformat() if report.finished_at else None,
        "duration_seconds": report.duration_seconds, "note": report.note,
        "examined": t.examined, "retired": dict(t.retired), "left_alone": dict(t.left_alone),
        "would_retire": dict(t.would_retire), "dry_run_retire": dict(t.dry_run_retire), "errors": t.errors,
        "bytes_removed": t.bytes_removed,
    }


def report_from_json(data: dict[str, Any]) -> RunReport:
    """The report `report_to_json` wrote, read tolerantly (see the module docstring); UnreadableReport when it is
    not one."""
    try:
        return _report(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnreadableReport(f"{type(exc).__name__}: {exc}") from exc


def _report(data: dict[str, Any]) -> RunReport:
    tally = Tally(examined=int(data["examined"]), retired=Counter(data["retired"]),
                  left_alone=Counter(data["left_alone"]), would_retire=Counter(data["would_retire"]),
                  dry_run_retire=Counter(data.get("dry_run_retire") or {}),
                  errors=int(data["errors"]), bytes_removed=int(data["bytes_removed"]))
    note = data.get("note") or ""
    trigger = data["trigger"]
    outcome = data["outcome"]
    if outcome not in Outcome.__members__.values():
        note = f"{note}; " if note else ""
        note += f"the service reported the outcome {outcome!r}, which this version does not know"
    return RunReport(
        id=str(data["id"]),
        trigger=Trigger(trigger) if trigger in Trigger.__members__.values() else Trigger.ON_DEMAND,
        dry_run=bool(data["dry_run"]), force=bool(data["force"]),
        started_at=datetime.fromisoformat(data["started_at"]),
        daily_for=date.fromisoformat(data["daily_for"]) if data.get("daily_for") else None,
        outcome=Outcome(outcome) if outcome in Outcome.__members__.values() else Outcome.FAILED,
        finished_at=datetime.fromisoformat(data["finished_at"]) if data.get("finished_at") else None,
        duration_seconds=data.get("duration_seconds"), tally=tally, note=note,
    )
