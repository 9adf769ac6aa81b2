"""The sweep's decisions without a server: SPEC section 5's table, the survey, the triple read, the claim, the valve,
and the daily slot."""

from __future__ import annotations

import itertools
from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.sweep import domain
from services.sweep.domain import (
    FileRead,
    Leave,
    LeaveReason,
    Presence,
    Retire,
    RetireReason,
    Tally,
    UploadsRead,
    UploadsState,
)
from services.sweep.settings import SweepSettings
from shared.videos import IMPORT_ACTIVE, ImportState, is_sweep_candidate

SETTINGS = SweepSettings()
MIN_AGE = timedelta(seconds=SETTINGS.sweep_min_age_seconds)
STALE = timedelta(seconds=SETTINGS.claim_stale_seconds)
NOW = datetime(2026, 3, 4, 12, 0, tzinfo=UTC)
SECOND = timedelta(seconds=1)

OLD = FileRead.present(1234, NOW - MIN_AGE - SECOND, '"etag-old"')
EXACTLY_OLD = FileRead.present(1234, NOW - MIN_AGE, '"etag-old"')
RECENT = FileRead.present(99, NOW - MIN_AGE + SECOND, '"etag-new"')
AGE_UNKNOWN = FileRead.present(5, None)
ABSENT = FileRead.absent()
FILE_UNCERTAIN = FileRead.uncertain("HEAD: HTTP 503")
FILES = {"old": OLD, "recent": RECENT, "age_unknown": AGE_UNKNOWN, "absent": ABSENT, "uncertain": FILE_UNCERTAIN}

NONE = UploadsRead.none()
OPEN = UploadsRead.open("u1", "u2")
UPLOADS_UNCERTAIN = UploadsRead.uncertain("list: cut short")
UPLOADS = {"none": NONE, "open": OPEN, "uncertain": UPLOADS_UNCERTAIN}

STALE_FILE = Retire(RetireReason.STALE_FILE, remove_file=True, bytes_removed=1234)
STALE_FILE_ABORT = Retire(RetireReason.STALE_FILE, remove_file=True, bytes_removed=1234, abort_uploads=("u1", "u2"))
NEVER = Retire(RetireReason.NEVER_UPLOADED)

# SPEC section 5, every cell: (file, uploads) -> decision
TABLE: dict[tuple[str, str], domain.Decision | LeaveReason] = {
    ("old", "none"): STALE_FILE,
    ("old", "open"): STALE_FILE_ABORT,  # retire and remove the file, and abort any open upload
    ("old", "uncertain"): LeaveReason.STORAGE_UNCERTAIN,  # cannot say what to abort: leave
    ("recent", "none"): LeaveReason.FILE_RECENT,
    ("recent", "open"): LeaveReason.FILE_RECENT,
    ("recent", "uncertain"): LeaveReason.STORAGE_UNCERTAIN,
    ("age_unknown", "none"): LeaveReason.STORAGE_UNCERTAIN,
    ("age_unknown", "open"): LeaveReason.STORAGE_UNCERTAIN,
    ("age_unknown", "uncertain"): LeaveReason.STORAGE_UNCERTAIN,
    ("absent", "none"): NEVER,
    ("absent", "open"): LeaveReason.UPLOAD_OPEN,
    ("absent", "uncertain"): LeaveReason.STORAGE_UNCERTAIN,
    ("uncertain", "none"): LeaveReason.STORAGE_UNCERTAIN,
    ("uncertain", "open"): LeaveReason.STORAGE_UNCERTAIN,
    ("uncertain", "uncertain"): LeaveReason.STORAGE_UNCERTAIN,
}


def decide(file: FileRead, uploads: UploadsRead) -> domain.Decision:
    return domain.retire_decision(file, uploads, now=NOW, min_age=MIN_AGE)


def confirm(first: FileRead, uploads: UploadsRead, second: FileRead) -> domain.Decision:
    return domain.confirmed_decision(first, uploads, second, now=NOW, min_age=MIN_AGE)


def reason(decision: domain.Decision | domain.Confirm) -> domain.Decision | domain.Confirm | LeaveReason:
    return decision.reason if isinstance(decision, Leave) else decision


def test_the_table_covers_every_combination() -> None:
    assert set(TABLE) == set(itertools.product(FILES, UPLOADS))


@pytest.mark.parametrize(("file", "uploads"), list(TABLE))
def test_decision_table(file: str, uploads: str) -> None:
    assert reason(decide(FILES[file], UPLOADS[uploads])) == TABLE[(file, uploads)]


def test_a_file_exactly_the_minimum_age_is_old() -> None:
    assert decide(EXACTLY_OLD, NONE) == STALE_FILE
    assert reason(decide(FileRead.present(1, NOW - MIN_AGE + timedelta(microseconds=1)), NONE)) \
        is LeaveReason.FILE_RECENT


def test_a_file_from_the_future_is_recent() -> None:
    assert reason(decide(FileRead.present(1, NOW + timedelta(hours=1)), NONE)) is LeaveReason.FILE_RECENT


def test_uncertain_keeps_what_storage_said() -> None:
    decision = decide(ABSENT, UPLOADS_UNCERTAIN)
    assert isinstance(decision, Leave) and decision.detail == "list: cut short"
    decision = decide(FILE_UNCERTAIN, NONE)
    assert isinstance(decision, Leave) and decision.detail == "HEAD: HTTP 503"


# --------------------------------------------------------------------------------------- the survey


@pytest.mark.parametrize("file", [*FILES, None])
def test_survey_with_no_open_upload_confirms_under_the_lock_whatever_the_file(file: str | None) -> None:
    # stale_file or never_uploaded, or a recent file: the three reads under the lock decide; the valve counts it
    decision = domain.survey_decision(NONE, FILES[file] if file else None, now=NOW, min_age=MIN_AGE)
    assert decision == domain.Confirm()


@pytest.mark.parametrize("file", [*FILES, None])
def test_survey_leaves_what_it_cannot_list(file: str | None) -> None:
    decision = domain.survey_decision(UPLOADS_UNCERTAIN, FILES[file] if file else None, now=NOW, min_age=MIN_AGE)
    assert decision == Leave(LeaveReason.STORAGE_UNCERTAIN, "list: cut short")


@pytest.mark.parametrize("file", list(FILES))
def test_survey_with_an_open_upload_decides_by_the_table(file: str) -> None:
    decision = domain.survey_decision(OPEN, FILES[file], now=NOW, min_age=MIN_AGE)
    assert reason(decision) == TABLE[(file, "open")]


def test_survey_with_an_open_upload_needs_the_file() -> None:
    with pytest.raises(ValueError):
        domain.survey_decision(OPEN, None, now=NOW, min_age=MIN_AGE)


@pytest.mark.parametrize(("file", "uploads"), list(TABLE))
def test_the_survey_never_leaves_what_the_table_would_retire(file: str, uploads: str) -> None:
    # the survey may propose more than the table retires (the valve only stops sooner), never less
    survey = domain.survey_decision(UPLOADS[uploads], FILES[file], now=NOW, min_age=MIN_AGE)
    if isinstance(TABLE[(file, uploads)], Retire):
        assert isinstance(survey, Retire | domain.Confirm)


# --------------------------------------------------------------------------------- the triple read


@pytest.mark.parametrize(("file", "uploads"), list(TABLE))
def test_three_agreeing_reads_decide_as_the_table(file: str, uploads: str) -> None:
    assert reason(confirm(FILES[file], UPLOADS[uploads], FILES[file])) == TABLE[(file, uploads)]


def test_an_upload_assembled_between_the_first_two_reads_still_shows() -> None:
    # first read: no file; then the completion assembles: the listing shows no upload; the second read shows the file
    assembled = FileRead.present(10, NOW - timedelta(milliseconds=5), '"new"')
    assert decide(ABSENT, NONE) == NEVER  # two reads alone would retire it
    assert confirm(ABSENT, NONE, assembled) == Leave(LeaveReason.STORAGE_CHANGED,
                                                     "first read absent, second read present")


def test_a_file_that_went_away_between_reads_is_left() -> None:
    assert reason(confirm(OLD, NONE, ABSENT)) is LeaveReason.STORAGE_CHANGED


def test_a_file_replaced_between_reads_is_left() -> None:
    replaced = FileRead.present(1234, NOW - MIN_AGE - SECOND, '"another-etag"')
    assert reason(confirm(OLD, NONE, replaced)) is LeaveReason.STORAGE_CHANGED


@pytest.mark.parametrize(("first", "second"), [("uncertain", "absent"), ("absent", "uncertain"),
                                               ("old", "uncertain"), ("uncertain", "old")])
def test_any_uncertain_read_leaves_it(first: str, second: str) -> None:
    assert reason(confirm(FILES[first], NONE, FILES[second])) is LeaveReason.STORAGE_UNCERTAIN


@pytest.mark.parametrize(("first", "uploads", "second"), list(itertools.product(FILES, UPLOADS, FILES)))
def test_retired_only_when_all_three_reads_definitely_agree(first: str, uploads: str, second: str) -> None:
    decision = confirm(FILES[first], UPLOADS[uploads], FILES[second])
    if not isinstance(decision, Retire):
        return
    assert first == second, "two file reads that differ never retire"
    assert Presence.UNCERTAIN not in (FILES[first].presence, FILES[second].presence)
    assert UPLOADS[uploads].state is not UploadsState.UNCERTAIN
    assert decision == TABLE[(first, uploads)]
    if decision.reason is RetireReason.NEVER_UPLOADED:
        assert (first, uploads) == ("absent", "none")


file_reads = st.one_of(
    st.just(ABSENT), st.builds(FileRead.uncertain, st.text(max_size=5)),
    st.builds(FileRead.present, st.integers(0, 10**12),
              st.one_of(st.none(), st.datetimes(timezones=st.just(UTC))), st.sampled_from(['"a"', '"b"', None])),
)
upload_reads = st.one_of(st.just(NONE), st.builds(UploadsRead.uncertain, st.text(max_size=5)),
                         st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3).map(
                             lambda ids: UploadsRead.open(*ids)))


@given(file_reads, upload_reads, file_reads)
def test_never_retires_on_a_guess(first: FileRead, uploads: UploadsRead, second: FileRead) -> None:
    decision = confirm(first, uploads, second)
    if isinstance(decision, Retire):
        assert first.presence is second.presence is not Presence.UNCERTAIN
        assert uploads.state is not UploadsState.UNCERTAIN
        assert domain.same_file(first, second)
        if first.presence is Presence.ABSENT:
            assert uploads.state is UploadsState.NONE and decision.reason is RetireReason.NEVER_UPLOADED
        else:
            assert second.last_modified is not None and NOW - second.last_modified >= MIN_AGE
            assert decision.abort_uploads == uploads.upload_ids and decision.bytes_removed == second.size


# --------------------------------------------------------------------------------------- the claim


@pytest.mark.parametrize(("claimed", "protects"), [
    (None, False),
    (NOW, True),
    (NOW - timedelta(minutes=5), True),
    (NOW - STALE + SECOND, True),
    (NOW - STALE, False),  # a claim exactly the stale age no longer keeps the video
    (NOW - STALE - timedelta(minutes=1), False),
    (NOW + timedelta(minutes=1), True),  # a claim from a clock ahead of ours: still under way
])
def test_claim_rule(claimed: datetime | None, protects: bool) -> None:
    assert domain.claim_protects(claimed, now=NOW, stale_after=STALE) is protects


def test_claim_rule_follows_the_setting() -> None:
    claimed = NOW - timedelta(minutes=16)
    assert not domain.claim_protects(claimed, now=NOW, stale_after=STALE)
    assert domain.claim_protects(claimed, now=NOW, stale_after=timedelta(minutes=20))


# ---------------------------------------------------------------------------------------- candidates


@pytest.mark.parametrize(("status", "recorded", "age", "expected"), [
    ("created", False, MIN_AGE + SECOND, True),
    ("uploading", False, MIN_AGE + SECOND, True),
    ("created", False, MIN_AGE, False),  # created exactly a day ago: not yet
    ("created", False, MIN_AGE - SECOND, False),
    ("uploading", True, MIN_AGE + SECOND, False),
    ("uploaded", True, MIN_AGE + SECOND, False),
    ("failed", False, MIN_AGE + SECOND, False),  # only created and uploading may become retired
    ("retired", False, MIN_AGE + SECOND, False),
    ("deleted", False, MIN_AGE + SECOND, False),
])
def test_candidates(status: str, recorded: bool, age: timedelta, expected: bool) -> None:
    cutoff = domain.candidate_cutoff(NOW, MIN_AGE)
    assert is_sweep_candidate(status, NOW if recorded else None, NOW - age, cutoff=cutoff) is expected


@pytest.mark.parametrize("state", [None, *ImportState])
def test_an_import_on_its_way_keeps_a_video_out_of_the_candidates(state: ImportState | None) -> None:
    cutoff = domain.candidate_cutoff(NOW, MIN_AGE)
    candidate = is_sweep_candidate("created", None, NOW - MIN_AGE - SECOND, cutoff=cutoff, import_state=state)
    assert candidate is (state not in IMPORT_ACTIVE)
    assert candidate is (state not in (ImportState.QUEUED, ImportState.FETCHING))


# ---------------------------------------------------------------------------------------- the valve

MAX_SHARE = SETTINGS.sweep_max_retire_share
MIN_CANDIDATES = SETTINGS.sweep_valve_min_candidates


def valve(candidates: int, would: int, force: bool = False) -> domain.ValveVerdict:
    return domain.safety_valve(candidates, would, max_share=MAX_SHARE, min_candidates=MIN_CANDIDATES, force=force)


def test_valve_stops_a_run_that_would_retire_too_large_a_share() -> None:
    n = MIN_CANDIDATES * 5
    verdict = valve(n, int(n * MAX_SHARE) + 1)
    assert verdict.stop and "--force" in verdict.message and "nothing was retired" in verdict.message


def test_valve_lets_exactly_the_share_through() -> None:
    n = MIN_CANDIDATES * 4
    assert not valve(n, int(n * MAX_SHARE)).stop


def test_valve_does_not_hold_a_small_deployment() -> None:
    assert not valve(MIN_CANDIDATES - 1, MIN_CANDIDATES - 1).stop
    assert valve(MIN_CANDIDATES, MIN_CANDIDATES).stop  # from the minimum on, it applies


def test_force_proceeds_past_the_valve() -> None:
    assert not valve(MIN_CANDIDATES * 10, MIN_CANDIDATES * 10, force=True).stop


def test_valve_with_no_candidates() -> None:
    verdict = domain.safety_valve(0, 0, max_share=MAX_SHARE, min_candidates=0, force=False)
    assert not verdict.stop and verdict.share == 0.0


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.floats(0, 1), st.integers(0, 100), st.booleans())
def test_valve_invariant(candidates: int, would: int, share: float, minimum: int, force: bool) -> None:
    would = min(would, candidates)
    verdict = domain.safety_valve(candidates, would, max_share=share, min_candidates=minimum, force=force)
    assert verdict.stop == (not force and candidates >= minimum and candidates > 0 and would / candidates > share)


# ------------------------------------------------------------------------------------------- the slot

DAILY_AT = SETTINGS.sweep_daily_at
SLOT_TODAY = domain.daily_slot(NOW.date(), DAILY_AT)


def test_daily_slot_is_utc() -> None:
    assert SLOT_TODAY.tzinfo is UTC and SLOT_TODAY.strftime("%H:%M") == DAILY_AT


def test_daily_run_due_once_its_time_has_come() -> None:
    assert domain.due_daily_run(SLOT_TODAY - SECOND, DAILY_AT, done_today=False) is None
    assert domain.due_daily_run(SLOT_TODAY, DAILY_AT, done_today=False) == SLOT_TODAY.date()
    assert domain.due_daily_run(SLOT_TODAY + timedelta(hours=5), DAILY_AT, done_today=False) == SLOT_TODAY.date()
    assert domain.due_daily_run(SLOT_TODAY + SECOND, DAILY_AT, done_today=True) is None


def test_next_daily_slot() -> None:
    assert domain.next_daily_slot(SLOT_TODAY - SECOND, DAILY_AT) == SLOT_TODAY
    assert domain.next_daily_slot(SLOT_TODAY, DAILY_AT) == SLOT_TODAY + timedelta(days=1)
    late = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert domain.next_daily_slot(late, "23:30") == datetime(2027, 1, 1, 23, 30, tzinfo=UTC)
    assert domain.next_daily_slot(late, "00:00") == datetime(2027, 1, 1, tzinfo=UTC)


def test_due_day_uses_utc_whatever_the_offset() -> None:
    from datetime import timezone

    tokyo = datetime(2026, 3, 5, 1, 0, tzinfo=timezone(timedelta(hours=9)))  # 2026-03-04 16:00 UTC
    assert domain.due_daily_run(tokyo, "03:00", done_today=False) == date(2026, 3, 4)


@pytest.mark.parametrize("bad", ["24:00", "3:00", "03:60", "0300", ""])
def test_daily_at_setting_is_validated(bad: str) -> None:
    with pytest.raises(ValueError):
        SweepSettings(sweep_daily_at=bad)


# ------------------------------------------------------------------------------------------- the tally


def test_tally_accounts_every_candidate() -> None:
    tally = Tally(examined=4)
    tally.retire(RetireReason.STALE_FILE, 100)
    tally.retire(RetireReason.NEVER_UPLOADED, 0)
    tally.leave(LeaveReason.UPLOAD_OPEN)
    tally.errors += 1
    assert tally.accounted == tally.examined
    assert tally.bytes_removed == 100 and tally.retired == {"stale_file": 1, "never_uploaded": 1}
