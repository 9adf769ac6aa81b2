"""Encode's decisions as plain functions (SPEC section 6): the ladder, the deadline, stuck encodes, results, heartbeats,
what a deletion does to each output, and whether a team's recording is taken (SPEC section 12).

No I/O and no clock: time comes in as a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from shared.videos import JobClass, OutputState, ProcessingState

LADDER: Final = (360, 720, 1080, 1440, 2160)
DEADLINE_MESSAGE: Final = "Processing took too long"


class FailureReason(StrEnum):
    DEADLINE = "deadline"  # the farm answered, but the video was not done in time
    FARM_UNREACHABLE = "farm_unreachable"  # the last round got no answer from any worker
    ENCODE_ERROR = "encode_error"  # an output failed on workers output_max_failures times
    UNREADABLE_SOURCE = "unreadable_source"  # ffmpeg finds no video stream in the source


def ladder_side(display_width: int, display_height: int) -> int:
    """The side of a source its ladder is chosen by: the shorter one as shown (after rotation). A rendition's "p" is
    its shorter side, as at Mux and YouTube: a 1920x1080 source and a 1080x1920 phone video are both 1080p."""
    return min(display_width, display_height)


def known_ladder_side(width: int | None, height: int | None) -> int | None:
    """The ladder's side from what an event says of its source: the shorter side when both are known; the height
    alone from a publisher that sends no width (release 1.0.0: a portrait source's ladder then starts too
    high, and its top rungs come out at the source's own size); None when the height is not known (encode probes)."""
    if height is None:
        return None
    return height if width is None else ladder_side(width, height)


def ladder(source_side: int) -> tuple[int, ...]:
    """The outputs of a source by its shorter side (`ladder_side`): 360p to 2160p never above it; a source whose
    shorter side is below 360 gets one output at that side.

    An output h is a picture whose shorter side is h (landscape and square: h lines tall; portrait: h pixels wide),
    the other side keeping the aspect ratio (`services.media.domain.scale_filter`). Rungs are even (H.264 in 4:2:0
    needs it), so a source 241 pixels on its shorter side gets a 240p output.
    """
    if source_side < LADDER[0]:
        return (max(2, source_side - source_side % 2),)
    return tuple(h for h in LADDER if h <= source_side)


def artwork_output(heights: Iterable[int]) -> int | None:
    """The output whose job also makes the video's poster and storyboard (one job per video, SPEC 14): its lowest,
    the cheapest to decode and the first done. Every attempt of it is asked; None for a video with no ladder yet."""
    return min(heights, default=None)


# ------------------------------------------------------------------------------------------------ answers


class AnswerKind(StrEnum):
    ACCEPTED = "accepted"  # a worker took the output; it is now encoding
    BUSY = "busy"  # every live worker answered busy
    UNREACHABLE = "unreachable"  # a live worker gave no answer (timeout, no responders, no connection), or none lives


@dataclass(frozen=True, slots=True)
class FarmAnswer:
    """The farm's answer to one offer of one output."""

    kind: AnswerKind
    busy_workers: tuple[str, ...] = ()  # the workers that answered busy
    worker: str | None = None  # accepted: who
    instance: str | None = None
    in_doubt: bool = False  # a worker that was asked never answered: it may have accepted

    @property
    def heard(self) -> bool:
        """Some worker answered (accepted or busy), so the farm is not down, even if this answer is unreachable."""
        return self.kind == AnswerKind.ACCEPTED or bool(self.busy_workers)


def farm_answer(busy_workers: Sequence[str], silent: int, in_doubt: bool) -> FarmAnswer:
    """The answer of an offer that no worker accepted: busy only if every live worker said so.

    A connection failure, a timeout or "no responders" is never busy (the reviewer's P1: an outage reported as busy
    restarts the deadline forever); a farm with no live worker at all is unreachable.
    """
    if busy_workers and silent == 0:
        return FarmAnswer(AnswerKind.BUSY, tuple(busy_workers))
    return FarmAnswer(AnswerKind.UNREACHABLE, tuple(busy_workers), in_doubt=in_doubt)


class LastRound(StrEnum):
    HEARD = "heard"  # some worker answered
    SILENT = "silent"  # no worker answered any offer of the round


@dataclass(frozen=True, slots=True)
class Deadline:
    """A video's deadline state, as kept in its row."""

    deadline_at: datetime
    busy_at: datetime | None = None
    last_round: LastRound | None = None  # the last round that offered anything


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    deadline: Deadline
    dispatch_busy: bool  # publish dispatch.busy (every answer of the round was busy)
    restarted: bool  # the deadline restarted


def deadline_after_round(
    current: Deadline, answers: Sequence[AnswerKind], *, heard: bool, encoding: bool, now: datetime,
    deadline_seconds: float,
) -> RoundOutcome:
    """THE deadline rule (SPEC section 6), after each dispatch round: one answer per output offered; `heard`: some
    worker answered; `encoding`: an output was accepted before this round.

    The deadline restarts only after a round whose every answer was busy with nothing encoding (waiting out a full farm
    spends no deadline, an outage still does); each busy answer records busy_at; an all-busy round publishes
    dispatch.busy.
    """
    if not answers:
        return RoundOutcome(current, dispatch_busy=False, restarted=False)
    any_busy = any(a == AnswerKind.BUSY for a in answers)
    all_busy = all(a == AnswerKind.BUSY for a in answers)
    restart = all_busy and not encoding
    return RoundOutcome(
        Deadline(
            deadline_at=now + timedelta(seconds=deadline_seconds) if restart else current.deadline_at,
            busy_at=now if any_busy else current.busy_at,
            last_round=LastRound.HEARD if heard else LastRound.SILENT,
        ),
        dispatch_busy=all_busy,
        restarted=restart,
    )


def any_encoding(outputs: Iterable[Output], offered_now: Iterable[int] = ()) -> bool:
    """Whether an output of the video counts as encoding for the deadline rule: one a worker accepted, or one offered
    in an earlier round whose answer never came (it may be running on a worker that hangs: waiting on it must not
    restart the deadline either). Outputs offered in the round itself are judged by their answers."""
    now = set(offered_now)
    return any(o.state in (OutputState.ENCODING, OutputState.OFFERED) and o.height not in now for o in outputs)


def expired(current: Deadline, now: datetime) -> FailureReason | None:
    """Past the deadline the video fails: `farm_unreachable` when the last round got no answer, else `deadline`."""
    if now < current.deadline_at:
        return None
    return FailureReason.FARM_UNREACHABLE if current.last_round == LastRound.SILENT else FailureReason.DEADLINE


# ------------------------------------------------------------------------------------------------ outputs


@dataclass(frozen=True, slots=True)
class Output:
    height: int
    state: OutputState
    attempt: int = 0
    offered_at: datetime | None = None
    worker: str | None = None
    instance: str | None = None
    started_at: datetime | None = None
    failures: int = 0
    object_key: str | None = None  # done: its rendition in storage


@dataclass(frozen=True, slots=True)
class TickPlan:
    """What a round of one video does before it offers anything."""

    fail: FailureReason | None = None
    settle: tuple[int, ...] = ()  # offered outputs whose answer never came and whose doubt is over: pending again
    offer: tuple[int, ...] = ()  # outputs to offer now, lowest first


def doubt_over(offered_at: datetime | None, now: datetime, window_seconds: float) -> bool:
    """An offer whose answer never came may have been accepted; after a heartbeat timeout every live worker has said
    (by heartbeat) whether it runs it, and a worker that said nothing is dead, so it may be offered again."""
    return offered_at is None or now - offered_at >= timedelta(seconds=window_seconds)


def plan_tick(deadline: Deadline, outputs: Iterable[Output], now: datetime, *, doubt_seconds: float) -> TickPlan:
    """A round of one video: fail it past its deadline; else settle old doubts and offer every pending output."""
    reason = expired(deadline, now)
    if reason is not None:
        return TickPlan(fail=reason)
    outs = sorted(outputs, key=lambda o: o.height)
    settle = tuple(o.height for o in outs
                   if o.state == OutputState.OFFERED and doubt_over(o.offered_at, now, doubt_seconds))
    offer = tuple(o.height for o in outs if o.state == OutputState.PENDING or o.height in settle)
    return TickPlan(settle=settle, offer=offer)


def is_stuck(started_at: datetime, busy_at: datetime | None, now: datetime, threshold_seconds: float) -> bool:
    """An output encoding longer than the threshold, measured from the later of its start and the video's busy_at.

    A video that waited hours on a busy farm and then started is not restarted while it encodes; if encode itself
    stops, busy answers stop too, and the restart comes a threshold after the last of them.
    """
    since = max(started_at, busy_at) if busy_at is not None else started_at
    return now - since > timedelta(seconds=threshold_seconds)


def stuck_outputs(outputs: Iterable[Output], busy_at: datetime | None, now: datetime, threshold_seconds: float
                  ) -> tuple[int, ...]:
    return tuple(
        o.height for o in outputs
        if o.state == OutputState.ENCODING and o.started_at is not None
        and is_stuck(o.started_at, busy_at, now, threshold_seconds)
    )


# ------------------------------------------------------------------------------------------------ results


class Verdict(StrEnum):
    APPLY = "apply"
    DUPLICATE = "duplicate"  # this result was applied before (a delivery repeated after a lost acknowledgement)
    STALE = "stale"  # not the output's current attempt, or no longer wanted: ignored


def judge_result(video_state: ProcessingState | None, output: Output | None, attempt: int) -> Verdict:
    """Whether a worker's result for `attempt` of an output counts.

    Only the current attempt of an output that is offered or encoding counts: once a worker is declared dead (or an
    output is restarted) its output goes back to pending, so that worker's late result is ignored, never applied twice.
    """
    if output is None or video_state is None:
        return Verdict.STALE
    if output.attempt != attempt:
        return Verdict.STALE
    if output.state == OutputState.DONE:
        return Verdict.DUPLICATE
    if video_state != ProcessingState.PROCESSING:
        return Verdict.STALE
    if output.state in (OutputState.OFFERED, OutputState.ENCODING):
        return Verdict.APPLY
    return Verdict.STALE


# ---------------------------------------------------------------------------------------------- heartbeats


@dataclass(frozen=True, slots=True)
class Reported:
    """A job a worker says it runs."""

    video_id: str
    height: int
    attempt: int


@dataclass(frozen=True, slots=True)
class Known:
    """What encode knows of the output a reported job belongs to."""

    video_state: ProcessingState
    output: Output


def may_declare_dead(listened_seconds: float, timeout_seconds: float) -> bool:
    """Whether silence past the timeout says a worker is dead: only once this instance has been hearing and recording
    heartbeats for a whole timeout without a break. Heartbeats missed while encode was down, off the bus, or could
    not write them (its database away) say nothing of the workers, which went on meanwhile."""
    return listened_seconds >= timeout_seconds


@dataclass(frozen=True, slots=True)
class Reconciliation:
    adopt: tuple[Reported, ...] = ()  # the worker runs an offer whose answer was lost: it is encoding there
    cancel: tuple[Reported, ...] = ()  # the worker runs something encode does not want: stop it


def reconcile(instance: str, reported: Iterable[Reported], known: Mapping[tuple[str, int], Known]) -> Reconciliation:
    """Compare a heartbeat's running jobs with encode's outputs: adopt lost acceptances, cancel what is not wanted."""
    adopt: list[Reported] = []
    cancel: list[Reported] = []
    for job in reported:
        k = known.get((job.video_id, job.height))
        if k is None or k.video_state != ProcessingState.PROCESSING or k.output.attempt != job.attempt:
            cancel.append(job)
        elif k.output.state == OutputState.OFFERED:
            adopt.append(job)
        elif k.output.state == OutputState.ENCODING and k.output.instance == instance:
            continue
        else:
            cancel.append(job)
    return Reconciliation(tuple(adopt), tuple(cancel))


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A live worker as its last heartbeat showed it (and this instance's acceptances since)."""

    name: str
    instance: str
    slots: int
    developer_running: int = 0
    first_party_running: int = 0
    large_developer_running: bool = False
    leaving: bool = False
    running: frozenset[tuple[str, int, int]] = field(default_factory=frozenset)

    def room_for(self, job_class: JobClass, large: bool) -> bool:
        """Whether the worker probably accepts (the worker decides; this only orders the offers). `large`: the job
        is a large developer output (`shared.videos.is_large_output`)."""
        total = self.developer_running + self.first_party_running
        if total >= self.slots:
            return False
        if job_class == JobClass.FIRST_PARTY:
            return True
        if self.developer_running >= self.slots - 1:
            return False
        return not (large and self.large_developer_running)

    def with_accepted(self, job_class: JobClass, large: bool) -> WorkerView:
        if job_class == JobClass.FIRST_PARTY:
            return replace(self, first_party_running=self.first_party_running + 1)
        return replace(self, developer_running=self.developer_running + 1,
                       large_developer_running=self.large_developer_running or large)


def offer_order(workers: Iterable[WorkerView], job_class: JobClass, large: bool) -> list[WorkerView]:
    """Every live worker is asked (busy means all of them said busy); those with room first, the emptiest first."""
    live = [w for w in workers if not w.leaving]
    return sorted(live, key=lambda w: (not w.room_for(job_class, large),
                                       w.developer_running + w.first_party_running - w.slots, w.name))


def free_developer_slots(worker: WorkerView) -> int:
    return max(0, min(worker.slots - 1 - worker.developer_running,
                      worker.slots - worker.developer_running - worker.first_party_running))


# ------------------------------------------------------------------------------------------------ deletion


class OnDeletion(StrEnum):
    """What video.deleted does to one output (besides cancelling it: it is never offered again)."""

    NOTHING = "nothing"  # pending, or cancelled already: nothing runs, nothing was written
    STOP_WHEN_SEEN = "stop_when_seen"  # offered, its answer not in: a worker that turns out to run it (its answer,
    # heartbeat or result) is told to stop then, since no worker is known to tell now
    STOP = "stop"  # encoding: its worker is told to stop now (it kills ffmpeg and removes what it wrote)
    REMOVE = "remove"  # done: its rendition is removed from storage


def output_on_deletion(output: Output) -> OnDeletion:
    if output.state == OutputState.ENCODING:
        return OnDeletion.STOP if output.instance is not None else OnDeletion.STOP_WHEN_SEEN
    if output.state == OutputState.OFFERED:
        return OnDeletion.STOP_WHEN_SEEN
    if output.state == OutputState.DONE:
        return OnDeletion.REMOVE if output.object_key is not None else OnDeletion.NOTHING
    return OnDeletion.NOTHING


@dataclass(frozen=True, slots=True)
class Stop:
    """A job to stop: the worker instance running it and the output's attempt."""

    instance: str
    height: int
    attempt: int


@dataclass(frozen=True, slots=True)
class DeletionPlan:
    delete: bool  # the video's processing becomes deleted (False: encode never had it, or it is deleted already)
    cancel: tuple[int, ...] = ()  # outputs that become cancelled
    stop: tuple[Stop, ...] = ()  # jobs whose workers are told to stop now
    remove: tuple[str, ...] = ()  # rendition objects removed from storage


def deletion_plan(video_state: ProcessingState | None, outputs: Iterable[Output]) -> DeletionPlan:
    """video.deleted: every output of the video is cancelled, whatever the video's state (processing, ready or
    failed): a failed video's jobs were told to stop when it failed, and telling them again costs nothing.

    Deleting twice (a replay asked to reprocess) does nothing the second time; a video encode never had is only
    remembered (by the caller), so that an upload.completed handled after it does not start one.
    """
    if video_state is None or video_state == ProcessingState.DELETED:
        return DeletionPlan(delete=False)
    outs = sorted(outputs, key=lambda o: o.height)
    stop: list[Stop] = []
    remove: list[str] = []
    for o in outs:
        action = output_on_deletion(o)
        if action == OnDeletion.STOP:
            assert o.instance is not None
            stop.append(Stop(o.instance, o.height, o.attempt))
        elif action == OnDeletion.REMOVE:
            assert o.object_key is not None
            remove.append(o.object_key)
    return DeletionPlan(
        delete=True, cancel=tuple(o.height for o in outs if o.state != OutputState.CANCELLED), stop=tuple(stop),
        remove=tuple(remove),
    )


# ---------------------------------------------------------------------------------------------- recordings


RECORDINGS_PREFIX: Final = "recordings"  # a team's objects are under recordings/<account>/ (SPEC 12)


class RecordingCode(StrEnum):
    """Why a team's recording.completed is refused: stable codes, told to the team on publisher.<name>.rejected."""

    UNKNOWN_JOB_CLASS = "unknown_job_class"  # the subject's job class is neither developer nor first_party
    OBJECT_OUTSIDE_PREFIX = "object_outside_prefix"  # the object is not under recordings/<its account>/
    NOT_YOUR_VIDEO = "not_your_video"  # the video id is another account's
    HAS_SOURCE = "has_source"  # the video already has a source (an upload or a recording was taken)
    VIDEO_DELETED = "video_deleted"  # the video was deleted
    UNKNOWN_VIDEO = "unknown_video"  # no account owns the video id, after waiting recording_owner_wait_seconds
    TIME_IN_FUTURE = "time_in_future"  # the envelope's time is further ahead than the wait: it would wait for ever


class RecordingVerdict(StrEnum):
    ACCEPT = "accept"  # open the video with `job_class`
    REFUSE = "refuse"  # parked, and the team told (`code`, `reason`)
    WAIT = "wait"  # not decided yet: the video's account may not be known yet (video.created read by another durable)


@dataclass(frozen=True, slots=True)
class RecordingOrigin:
    """What a recording's subject says, the only part its publisher's NATS rights vouch for: `account` None for the
    bare legacy subject `recording.completed` (only first-party identities may publish it)."""

    account: str | None = None
    publisher: str | None = None
    job_class: str = JobClass.FIRST_PARTY.value


@dataclass(frozen=True, slots=True)
class VideoFacts:
    """What encode knows of the video id a recording names."""

    owner: str | None = None  # its account, learned from video.created, upload.completed, or an accepted recording
    has_source: bool = False  # encode has its processing state (an upload or a recording was taken)
    deleted: bool = False  # its video.deleted was handled


@dataclass(frozen=True, slots=True)
class RecordingDecision:
    verdict: RecordingVerdict
    job_class: JobClass | None = None  # ACCEPT: the job class it runs as
    code: RecordingCode | None = None  # REFUSE: why
    reason: str = ""  # REFUSE: why, for people; WAIT: what it waits for
    remember_owner: str | None = None  # ACCEPT: the account to record as the video's (it had none)


def object_in_prefix(object_key: str, account: str) -> bool:
    """The key is under recordings/<account>/ with no empty, `.` or `..` segment after it (keys are literal in S3,
    but a proxy or a copy tool may normalise them)."""
    prefix = f"{RECORDINGS_PREFIX}/{account}/"
    if not object_key.startswith(prefix):
        return False
    rest = object_key[len(prefix):].split("/")
    return all(part not in ("", ".", "..") for part in rest)


def recording_decision(origin: RecordingOrigin, object_key: str, facts: VideoFacts, *, published_at: datetime,
                       now: datetime, owner_wait_seconds: float) -> RecordingDecision:
    """Whether a recording.completed is taken (SPEC 12). The bare legacy subject is first-party and taken as before.
    On `recording.completed.<account>.<publisher>.<job_class>`: the job class must be known, the object under the
    account's prefix, the video the account's and without a source. A video whose owner is not known yet is taken by
    a first-party identity (and becomes the account's); a developer-class one waits for video.created to be read, up
    to `owner_wait_seconds` after the event's time, then is refused: a team cannot squat a video id it read."""
    if origin.account is None:
        return RecordingDecision(RecordingVerdict.ACCEPT, job_class=JobClass.FIRST_PARTY)
    account = origin.account
    if origin.job_class not in (JobClass.DEVELOPER.value, JobClass.FIRST_PARTY.value):
        return _refuse(RecordingCode.UNKNOWN_JOB_CLASS, f"job class {origin.job_class!r} in the subject is neither "
                       f"{JobClass.DEVELOPER.value} nor {JobClass.FIRST_PARTY.value}")
    job_class = JobClass(origin.job_class)
    if not object_in_prefix(object_key, account):
        return _refuse(RecordingCode.OBJECT_OUTSIDE_PREFIX,
                       f"the object must be under {RECORDINGS_PREFIX}/{account}/ (the subject's account)")
    if facts.owner is not None and facts.owner != account:
        return _refuse(RecordingCode.NOT_YOUR_VIDEO, f"the video is not one of account {account}'s")
    if facts.deleted:
        return _refuse(RecordingCode.VIDEO_DELETED, "the video was deleted")
    if facts.has_source:
        return _refuse(RecordingCode.HAS_SOURCE, "the video already has a source")
    if facts.owner == account:
        return RecordingDecision(RecordingVerdict.ACCEPT, job_class=job_class)
    if job_class == JobClass.FIRST_PARTY:
        return RecordingDecision(RecordingVerdict.ACCEPT, job_class=job_class, remember_owner=account)
    wait = timedelta(seconds=owner_wait_seconds)
    if published_at > now + wait:
        return _refuse(RecordingCode.TIME_IN_FUTURE, f"the event's time {published_at.isoformat()} is more than "
                       f"{owner_wait_seconds:g} s ahead")
    if now < published_at + wait:
        return RecordingDecision(RecordingVerdict.WAIT, reason="the video's account is not known yet")
    return _refuse(RecordingCode.UNKNOWN_VIDEO, f"no video of account {account} has this id")


def _refuse(code: RecordingCode, reason: str) -> RecordingDecision:
    return RecordingDecision(RecordingVerdict.REFUSE, code=code, reason=reason)


def recording_retry_in(published_at: datetime, now: datetime, owner_wait_seconds: float, nak_delay: float) -> float:
    """When a WAIT recording is looked at again: after the consumer's usual delay, but not past the wait's end."""
    left = (published_at + timedelta(seconds=owner_wait_seconds) - now).total_seconds()
    return max(0.0, min(nak_delay, left))
