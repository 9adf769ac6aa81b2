"""The on-demand trigger's messages: a report survives the trip, and updates go only to the caller's inbox."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, date, datetime

import pytest
from pydantic import ValidationError

from services.sweep.domain import Outcome, RunReport, Tally, Trigger
from services.sweep.trigger import RunRequest, report_from_json, report_to_json


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
