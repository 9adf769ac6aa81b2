"""The on-demand trigger's messages: a report survives the trip, and updates go only to the caller's inbox."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, date, datetime

import pytest
from pydantic import ValidationError

from services.sweep.domain import Outcome, RunReport, Tally, Trigger
from services.sweep.trigger import (
    RunAccepted,
    RunRequest,
    RunUpdate,
    UnreadableReport,
    report_from_json,
    report_to_json,
)


def test_a_report_survives_the_trip() -> None:
    report = RunReport(
        id="0b5e2c9e-6d0c-4a37-9d7e-1b7f0c1f2a3b", trigger=Trigger.DAILY, dry_run=False, force=True,
        started_at=datetime(2026, 3, 4, 3, 0, tzinfo=UTC), daily_for=date(2026, 3, 4), outcome=Outcome.COMPLETED,
        finished_at=datetime(2026, 3, 4, 3, 1, tzinfo=UTC), duration_seconds=61.5, note="n",
        tally=Tally(examined=5, retired=Counter(stale_file=1, never_uploaded=2), left_alone=Counter(upload_open=1),
                    would_retire=Counter(no_open_upload=3), dry_run_retire=Counter(stale_file=2), errors=1,
                    bytes_removed=1234),
    )
    assert report_from_json(report_to_json(report)) == report


@pytest.mark.parametrize("updates", ["video.retired", "_INBOX.", "_INBOX.a b", ""])
def test_updates_go_to_an_inbox_only(updates: str) -> None:
    with pytest.raises(ValidationError):
        RunRequest(updates=updates)
    assert RunRequest(updates="_INBOX.abc123.x").updates == "_INBOX.abc123.x"


# ------------------------------------------------------------------------------------------ tolerant readers


def test_every_message_is_read_with_fields_a_newer_release_adds() -> None:
    assert RunRequest.model_validate_json(b'{"updates": "_INBOX.a.b", "priority": 1}').updates == "_INBOX.a.b"
    assert RunAccepted.model_validate_json(b'{"accepted": true, "run_id": "r", "queue": 2}').run_id == "r"
    update = RunUpdate.model_validate_json(b'{"kind": "progress", "phase": "survey", "done": 2, "rate": 9.5}')
    assert (update.kind, update.done) == ("progress", 2)


def test_an_update_of_a_kind_this_version_does_not_know_is_progress() -> None:
    update = RunUpdate.model_validate_json(b'{"kind": "estimate", "phase": "survey", "done": 1}')
    assert (update.kind, update.phase, update.done) == ("progress", "survey", 1)
    with pytest.raises(ValidationError):
        RunUpdate.model_validate_json(b'{"kind": 7}')  # not a kind at all


def _report_json(**changes: object) -> dict[str, object]:
    report = RunReport(id="r", trigger=Trigger.ON_DEMAND, dry_run=True, force=False,
                       started_at=datetime(2026, 3, 4, 3, 0, tzinfo=UTC), daily_for=None, outcome=Outcome.COMPLETED,
                       finished_at=None, duration_seconds=None, tally=Tally(examined=2), note="")
    return {**report_to_json(report), **changes}


def test_a_report_with_new_fields_and_values_is_read_with_its_fallbacks() -> None:
    read = report_from_json(_report_json(shards=4, trigger="weekly", outcome="paused"))
    assert read.trigger is Trigger.ON_DEMAND  # a run asked over sweep.run
    assert read.outcome is Outcome.FAILED  # not taken for success
    assert "'paused', which this version does not know" in read.note
    assert report_from_json(_report_json(shards=4)).outcome is Outcome.COMPLETED


@pytest.mark.parametrize("data", [{}, {"id": "r"}, {**_report_json(), "examined": "many"},
                                  {**_report_json(), "started_at": None}])
def test_a_report_that_is_not_one_is_unreadable(data: dict[str, object]) -> None:
    with pytest.raises(UnreadableReport):
        report_from_json(data)
