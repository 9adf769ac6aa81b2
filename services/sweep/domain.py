"""The sweep's decisions as plain functions: storage's answers -> retire or leave, the claim rule, the safety valve,
the daily slot, and the tally a run keeps.

No I/O and no clock: what storage said and `now` come in as parameters (SPEC section 5).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from enum import StrEnum


class Presence(StrEnum):
    PRESENT = "present"
    ABSENT = "absent"
    UNCERTAIN = "uncertain"  # an error, a timeout, throttling: storage did not say


@dataclass(frozen=True)
class FileRead:
    """What one read of the video's object said."""

    presence: Presence
    size: int = 0
    last_modified: datetime | None = None
    etag: str | None = None
    detail: str = ""  # why it is uncertain

    @classmethod
    def present(cls, size: int, last_modified: datetime | None, etag: str | None = None) -> FileRead:
        return cls(Presence.PRESENT, size=size, last_modified=last_modified, etag=etag)

    @classmethod
    def absent(cls) -> FileRead:
        return cls(Presence.ABSENT)

    @classmethod
    def uncertain(cls, detail: str) -> FileRead:
        return cls(Presence.UNCERTAIN, detail=detail)


class UploadsState(StrEnum):
    OPEN = "open"
    NONE = "none"
    UNCERTAIN = "uncertain"  # an error, a timeout, throttling, a listing cut short


@dataclass(frozen=True)
class UploadsRead:
    """What one listing of the open multipart uploads for the video's key said."""

    state: UploadsState
    upload_ids: tuple[str, ...] = ()
    detail: str = ""

    @classmethod
    def open(cls, *upload_ids: str) -> UploadsRead:
        return cls(UploadsState.OPEN, upload_ids=tuple(upload_ids))

    @classmethod
    def none(cls) -> UploadsRead:
        return cls(UploadsState.NONE)

    @classmethod
    def uncertain(cls, detail: str) -> UploadsRead:
        return cls(UploadsState.UNCERTAIN, detail=detail)


class RetireReason(StrEnum):
    STALE_FILE = "stale_file"  # the file is there, over a day old, and was never recorded
    NEVER_UPLOADED = "never_uploaded"  # no file and no open upload


class LeaveReason(StrEnum):
    UPLOAD_OPEN = "upload_open"
    FILE_RECENT = "file_recent"  # a file younger than the minimum age: a completion may be recording it
    STORAGE_UNCERTAIN = "storage_uncertain"
    STORAGE_CHANGED = "storage_changed"  # the reads under the lock disagree: something happened between them
    CLAIM_FRESH = "claim_fresh"  # a completion claimed it less than the claim's stale age ago
    ROW_LOCKED = "row_locked"  # another transaction holds the row (an initiate, a completion): next run
    NO_LONGER_CANDIDATE = "no_longer_candidate"  # recorded, retired or deleted since the survey
    SAFETY_VALVE = "safety_valve"  # the run stopped before retiring anything
    DRY_RUN = "dry_run"  # would have been retired


@dataclass(frozen=True)
class Retire:
    reason: RetireReason
    remove_file: bool = False
    bytes_removed: int = 0
    abort_uploads: tuple[str, ...] = ()


@dataclass(frozen=True)
class Leave:
    reason: LeaveReason
    detail: str = ""


Decision = Retire | Leave


def retire_decision(file: FileRead, uploads: UploadsRead, *, now: datetime, min_age: timedelta) -> Decision:
    """SPEC section 5's table, for one look at storage: file, then open uploads."""
    if file.presence is Presence.UNCERTAIN or uploads.state is UploadsState.UNCERTAIN:
        # when storage cannot say for certain, leave it: a guess must never delete
        return Leave(LeaveReason.STORAGE_UNCERTAIN, file.detail or uploads.detail)
    if file.presence is Presence.PRESENT:
        if file.last_modified is None:
            return Leave(LeaveReason.STORAGE_UNCERTAIN, "the file's age is unknown")
        if now - file.last_modified >= min_age:
            return Retire(RetireReason.STALE_FILE, remove_file=True, bytes_removed=file.size,
                          abort_uploads=uploads.upload_ids)
        return Leave(LeaveReason.FILE_RECENT)
    if uploads.state is UploadsState.OPEN:
        return Leave(LeaveReason.UPLOAD_OPEN)
    return Retire(RetireReason.NEVER_UPLOADED)


@dataclass(frozen=True)
class Confirm:
    """The survey found no open upload: retired, unless the reads under the row lock say otherwise."""

    reason: str = "no_open_upload"


def survey_decision(uploads: UploadsRead, file: FileRead | None, *, now: datetime,
                    min_age: timedelta) -> Decision | Confirm:
    """The survey's look, without locks: what to leave now, and what to lock and read again.

    With no open upload a candidate is retired whatever its file says (stale_file or never_uploaded) unless that file
    is recent; the survey leaves the file to the three reads under the lock and counts the candidate towards the
    safety valve (which can only make the valve stop sooner). With an open upload only a file over a day old retires
    it, so that file is read now (`file`).
    """
    if uploads.state is UploadsState.UNCERTAIN:
        return Leave(LeaveReason.STORAGE_UNCERTAIN, uploads.detail)
    if uploads.state is UploadsState.NONE:
        return Confirm()
    if file is None:
        raise ValueError("with an open upload, the survey reads the file")
    return retire_decision(file, uploads, now=now, min_age=min_age)


def confirmed_decision(
    first: FileRead, uploads: UploadsRead, second: FileRead, *, now: datetime, min_age: timedelta
) -> Decision:
    """The reads under the row lock, in this order: file, open uploads, file again.

    The second file read catches an upload assembled between the first two reads (the listing no longer shows
    it, the file now does): a video is retired only when all three reads agree, definitely.
    """
    for read in (first, second):
        if read.presence is Presence.UNCERTAIN:
            return Leave(LeaveReason.STORAGE_UNCERTAIN, read.detail)
    before = retire_decision(first, uploads, now=now, min_age=min_age)
    after = retire_decision(second, uploads, now=now, min_age=min_age)
    if isinstance(before, Leave) and isinstance(after, Leave) and before.reason == after.reason:
        return after
    if isinstance(before, Retire) and isinstance(after, Retire) and before.reason == after.reason \
            and same_file(first, second):
        return after
    return Leave(LeaveReason.STORAGE_CHANGED, f"first read {first.presence}, second read {second.presence}")


def same_file(a: FileRead, b: FileRead) -> bool:
    """Both reads saw nothing, or the same object (not one replaced between them)."""
    if a.presence is not b.presence:
        return False
    if a.presence is Presence.ABSENT:
        return True
    return (a.size, a.etag, a.last_modified) == (b.size, b.etag, b.last_modified)


def claim_protects(claimed_at: datetime | None, *, now: datetime, stale_after: timedelta) -> bool:
    """A completion claim younger than `stale_after` keeps the video: its upload may be assembling right now.

    A claim left by a completion that died before assembling keeps it only until the claim is that old.
    """
    return claimed_at is not None and now - claimed_at < stale_after


def candidate_cutoff(now: datetime, min_age: timedelta) -> datetime:
    """Videos created before this are old enough to be candidates (the rule itself: `shared.videos`)."""
    return now - min_age


# ------------------------------------------------------------------------------------------ the valve


@dataclass(frozen=True)
class ValveVerdict:
    stop: bool
    share: float
    message: str = ""


def safety_valve(candidates: int, would_retire: int, *, max_share: float, min_candidates: int,
                 force: bool) -> ValveVerdict:
    """A run that would retire more than `max_share` of its candidates stops before retiring anything.

    A bug in storage listing must not retire a fleet; a small deployment (fewer than `min_candidates`) is not held.
    """
    share = would_retire / candidates if candidates else 0.0
    if force or candidates < min_candidates or share <= max_share:
        return ValveVerdict(stop=False, share=share)
    return ValveVerdict(
        stop=True, share=share,
        message=(f"would retire up to {would_retire} of {candidates} candidates ({share:.0%}), more than the "
                 f"{max_share:.0%} allowed; nothing was retired (run with --force to proceed)"),
    )


# ----------------------------------------------------------------------------------------- the daily slot


def parse_daily_at(daily_at: str) -> time:
    hours, _, minutes = daily_at.partition(":")
    return time(int(hours), int(minutes), tzinfo=UTC)


def daily_slot(day: date, daily_at: str) -> datetime:
    return datetime.combine(day, parse_daily_at(daily_at))


def due_daily_run(now: datetime, daily_at: str, *, done_today: bool) -> date | None:
    """The day whose daily run is due now (today's, once its time has come and until it has run), or None."""
    today = now.astimezone(UTC).date()
    if now >= daily_slot(today, daily_at) and not done_today:
        return today
    return None


def next_daily_slot(now: datetime, daily_at: str) -> datetime:
    """The first daily slot strictly after `now`."""
    today = now.astimezone(UTC).date()
    slot = daily_slot(today, daily_at)
    return slot if slot > now else daily_slot(today + timedelta(days=1), daily_at)


# ------------------------------------------------------------------------------------------ the tally


class Outcome(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"  # by the safety valve
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # its process died; found by the next run


@dataclass
class Tally:
    """What a run did with its candidates: every examined candidate is retired, left alone, or an error."""

    examined: int = 0
    retired: Counter[str] = field(default_factory=Counter)
    left_alone: Counter[str] = field(default_factory=Counter)
    would_retire: Counter[str] = field(default_factory=Counter)  # the survey's count, which the valve judges
    dry_run_retire: Counter[str] = field(default_factory=Counter)  # what a dry run would retire, by reason
    errors: int = 0
    bytes_removed: int = 0

    def retire(self, reason: RetireReason, bytes_removed: int) -> None:
        self.retired[reason.value] += 1
        self.bytes_removed += bytes_removed

    def leave(self, reason: LeaveReason, n: int = 1) -> None:
        self.left_alone[reason.value] += n

    def would_have_retired(self, reason: RetireReason) -> None:
        """A dry run: left alone, and counted by the reason it would have been retired for."""
        self.left_alone[LeaveReason.DRY_RUN.value] += 1
        self.dry_run_retire[reason.value] += 1

    @property
    def accounted(self) -> int:
        return sum(self.retired.values()) + sum(self.left_alone.values()) + self.errors


class Trigger(StrEnum):
    DAILY = "daily"
    ON_DEMAND = "on_demand"


@dataclass
class RunReport:
    """One run as the ledger keeps it and the CLI shows it."""

    id: str
    trigger: Trigger
    dry_run: bool
    force: bool
    started_at: datetime
    daily_for: date | None = None
    outcome: Outcome = Outcome.RUNNING
    finished_at: datetime | None = None
    duration_seconds: float | None = None
    tally: Tally = field(default_factory=Tally)
    note: str = ""
