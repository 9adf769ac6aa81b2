"""Encode's decisions (SPEC section 6) as plain functions: every combination of answers, no server, no clock."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from services.encode.domain import (
    DEADLINE_MESSAGE,
    LADDER,
    AnswerKind,
    Deadline,
    FailureReason,
    FarmAnswer,
    Known,
    LastRound,
    OnDeletion,
    Output,
    Reported,
    Stop,
    Verdict,
    WorkerView,
    any_encoding,
    artwork_output,
    deadline_after_round,
    deletion_plan,
    doubt_over,
    expired,
    farm_answer,
    free_developer_slots,
    is_stuck,
    judge_result,
    ladder,
    ladder_side,
    may_declare_dead,
    offer_order,
    output_on_deletion,
    plan_tick,
    reconcile,
    stuck_outputs,
)
from services.encode.settings import EncodeSettings
from shared.videos import JobClass, OutputState, ProcessingState, is_large_output

SETTINGS = EncodeSettings()
DEADLINE = SETTINGS.processing_deadline_seconds
STUCK = SETTINGS.stuck_restart_seconds
T0 = datetime(2026, 11, 13, 0, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)
KINDS = tuple(AnswerKind)
STATES = tuple(OutputState)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


# ------------------------------------------------------------------------------------------------- the ladder


@pytest.mark.parametrize(("source", "outputs"), [
    (2, (2,)), (144, (144,)), (240, (240,)), (241, (240,)), (359, (358,)),
    (360, (360,)), (480, (360,)), (719, (360,)), (720, (360, 720)), (1079, (360, 720)),
    (1080, (360, 720, 1080)), (1440, (360, 720, 1080, 1440)), (2159, (360, 720, 1080, 1440)),
    (2160, LADDER), (4320, LADDER),
])  # fmt: skip
def test_the_ladder_never_goes_above_the_source(source: int, outputs: tuple[int, ...]) -> None:
    assert ladder(source) == outputs
    assert all(h <= source for h in ladder(source)) and all(h % 2 == 0 for h in ladder(source))


def test_the_ladder_over_every_shorter_side_up_to_past_2160() -> None:
    """360p to 2160p never above the shorter side; below 360 one output at that side made even (at least 2)."""
    for side in range(1, 4400):
        got = ladder(side)
        if side < 360:
            assert got == (max(2, side // 2 * 2),), side
        else:
            assert got == tuple(h for h in LADDER if h <= side) and got[0] == 360, side
        assert list(got) == sorted(set(got)) and all(h % 2 == 0 and h <= max(side, 2) for h in got), side


# (display width, display height) -> the ladder: by the shorter side, whatever the orientation
SIZES = [
    # landscape: by the height, as it always was
    ((640, 360), (360,)), ((854, 480), (360,)), ((1280, 720), (360, 720)), ((1920, 1080), (360, 720, 1080)),
    ((2560, 1440), (360, 720, 1080, 1440)), ((3840, 2160), LADDER), ((7680, 4320), LADDER),
    ((1920, 800), (360, 720)), ((426, 240), (240,)), ((427, 241), (240,)), ((641, 359), (358,)), ((3, 1), (2,)),
    # square
    ((360, 360), (360,)), ((359, 359), (358,)), ((720, 720), (360, 720)), ((1080, 1080), (360, 720, 1080)),
    ((2, 2), (2,)),
    # portrait: by the width (a phone's video); never the height
    ((360, 640), (360,)), ((480, 854), (360,)), ((720, 1280), (360, 720)), ((1080, 1920), (360, 720, 1080)),
    ((1440, 2560), (360, 720, 1080, 1440)), ((2160, 3840), LADDER), ((1081, 1921), (360, 720, 1080)),
    ((719, 1279), (360,)), ((240, 426), (240,)), ((241, 427), (240,)), ((359, 641), (358,)), ((202, 360), (202,)),
    ((1, 3), (2,)),
]  # fmt: skip


@pytest.mark.parametrize(("size", "outputs"), SIZES)
def test_the_ladder_goes_by_the_shorter_display_side(size: tuple[int, int], outputs: tuple[int, ...]) -> None:
    width, height = size
    assert ladder_side(width, height) == min(width, height)
    assert ladder(ladder_side(width, height)) == outputs
    assert ladder(ladder_side(height, width)) == outputs  # turned a quarter: the same ladder


def test_a_portrait_source_is_served_at_its_own_size_and_a_landscape_one_as_before() -> None:
    assert ladder(ladder_side(360, 640)) == (360,)  # not one 202x360 output
    assert ladder(ladder_side(1080, 1920))[-1] == 1080  # up to 1080x1920, not 608x1080
    for height in range(1, 2400):  # landscape and square: the ladder of the height, unchanged
        assert ladder(ladder_side(height * 16 // 9, height)) == ladder(ladder_side(height, height)) == ladder(height)


@pytest.mark.parametrize("source", [240, 719, 720, 1080, 2160])
def test_one_output_of_each_video_makes_its_artwork_the_lowest(source: int) -> None:
    heights = ladder(source)
    assert artwork_output(heights) == heights[0]
    assert artwork_output(reversed(heights)) == heights[0]  # whatever order the outputs are read in
    assert artwork_output(()) is None  # a ladder not known yet (a source still to probe)


# ------------------------------------------------------------------------------------- the deadline rule


ANSWER_SEQUENCES = [seq for n in range(len(LADDER) + 1) for seq in itertools.product(KINDS, repeat=n)]
"""Every sequence of answers a round can get: 0 to 5 outputs offered (the whole ladder), each of the three answers."""


@pytest.mark.parametrize("encoding", [False, True])
@pytest.mark.parametrize("heard", [False, True])
@pytest.mark.parametrize("busy_before", [None, T0 + s(60)])
@pytest.mark.parametrize("last", [None, *LastRound])
def test_the_deadline_rule_over_every_combination_of_answers(
    encoding: bool, heard: bool, busy_before: datetime | None, last: LastRound | None
) -> None:
    assert len(ANSWER_SEQUENCES) == sum(3**n for n in range(6))
    for answers in ANSWER_SEQUENCES:
        check_round(answers, encoding, heard, busy_before, last)


def check_round(answers: tuple[AnswerKind, ...], encoding: bool, heard: bool, busy_before: datetime | None,
                last: LastRound | None) -> None:
    current = Deadline(deadline_at=T0 + s(DEADLINE), busy_at=busy_before, last_round=last)
    out = deadline_after_round(current, answers, heard=heard, encoding=encoding, now=NOW, deadline_seconds=DEADLINE)
    # SPEC: restarts after a round in which at least one output was offered, every answer was busy, none was
    # unreachable, and no output of the video is encoding
    restart = len(answers) > 0 and set(answers) == {AnswerKind.BUSY} and not encoding
    assert out.restarted is restart
    assert out.deadline.deadline_at == (NOW + s(DEADLINE) if restart else current.deadline_at)
    if AnswerKind.UNREACHABLE in answers:
        assert out.deadline.deadline_at == current.deadline_at, "an unreachable answer never restarts the deadline"
    # each busy answer records busy_at; each all-busy round publishes dispatch.busy (encoding or not)
    assert out.deadline.busy_at == (NOW if AnswerKind.BUSY in answers else busy_before)
    assert out.dispatch_busy is (len(answers) > 0 and set(answers) == {AnswerKind.BUSY})
    # the reason kept for the deadline: whether any worker answered the last round that offered something
    if answers:
        assert out.deadline.last_round == (LastRound.HEARD if heard else LastRound.SILENT)
    else:
        assert out.deadline == current


def test_an_outage_never_moves_the_deadline_and_ends_in_farm_unreachable() -> None:
    """The reviewer's P1: connection failures reported as busy kept uploads waiting forever."""
    state = Deadline(T0 + s(DEADLINE))
    now = T0
    while expired(state, now) is None:
        state = deadline_after_round(state, [AnswerKind.UNREACHABLE] * 2, heard=False, encoding=False, now=now,
                                     deadline_seconds=DEADLINE).deadline
        assert state.deadline_at == T0 + s(DEADLINE) and state.busy_at is None
        now += s(SETTINGS.dispatch_retry_seconds)
    assert now >= T0 + s(DEADLINE) and expired(state, now) == FailureReason.FARM_UNREACHABLE


def test_a_full_farm_waits_without_spending_the_deadline() -> None:
    state = Deadline(T0 + s(DEADLINE))
    now = T0
    for _ in range(int(3 * DEADLINE / SETTINGS.dispatch_retry_seconds)):  # three deadlines' worth of busy rounds
        now += s(SETTINGS.dispatch_retry_seconds)
        assert expired(state, now) is None
        state = deadline_after_round(state, [AnswerKind.BUSY], heard=True, encoding=False, now=now,
                                     deadline_seconds=DEADLINE).deadline
    assert state.busy_at == now and state.deadline_at == now + s(DEADLINE)


def test_one_output_encoding_and_one_busy_still_stops_at_the_deadline() -> None:
    state = Deadline(T0 + s(DEADLINE))
    now = T0
    while expired(state, now) is None:
        state = deadline_after_round(state, [AnswerKind.BUSY], heard=True, encoding=True, now=now,
                                     deadline_seconds=DEADLINE).deadline
        now += s(SETTINGS.dispatch_retry_seconds)
    assert state.deadline_at == T0 + s(DEADLINE) and expired(state, now) == FailureReason.DEADLINE


@pytest.mark.parametrize("states", list(itertools.product(STATES, repeat=2)))
@pytest.mark.parametrize("offered_now", [(), (360,), (360, 720)])
def test_what_counts_as_encoding_for_the_deadline(states: tuple[OutputState, OutputState],
                                                  offered_now: tuple[int, ...]) -> None:
    outputs = [Output(360, states[0]), Output(720, states[1])]
    holding = {OutputState.ENCODING, OutputState.OFFERED}  # accepted, or an earlier offer still in doubt
    assert any_encoding(outputs, offered_now) is any(o.state in holding and o.height not in offered_now
                                                     for o in outputs)


@pytest.mark.parametrize("last", [None, *LastRound])
@pytest.mark.parametrize("offset", [-1.0, -0.001, 0.0, 0.001, 3600.0])
def test_past_the_deadline_the_reason_depends_on_the_last_round(last: LastRound | None, offset: float) -> None:
    state = Deadline(T0, last_round=last)
    reason = expired(state, T0 + s(offset))
    if offset < 0:
        assert reason is None
    else:
        assert reason == (FailureReason.FARM_UNREACHABLE if last == LastRound.SILENT else FailureReason.DEADLINE)
    assert DEADLINE_MESSAGE == "Processing took too long"


@pytest.mark.parametrize("silent", [0, 1, 3])
@pytest.mark.parametrize("busy", [(), ("w1",), ("w1", "w2")])
@pytest.mark.parametrize("in_doubt", [False, True])
def test_busy_only_when_every_live_worker_answered_busy(silent: int, busy: tuple[str, ...], in_doubt: bool) -> None:
    answer = farm_answer(busy, silent, in_doubt)
    if busy and silent == 0:
        assert answer == FarmAnswer(AnswerKind.BUSY, busy)
    else:  # no live worker, or one that gave no answer (timeout, no responders, no connection): never busy
        assert answer.kind == AnswerKind.UNREACHABLE and answer.busy_workers == busy
        assert answer.in_doubt is in_doubt
    assert answer.heard is bool(busy)
    assert FarmAnswer(AnswerKind.ACCEPTED, worker="w", instance="i").heard


# ------------------------------------------------------------------------------------------- a round's plan



@pytest.mark.parametrize("states", list(itertools.product(STATES, repeat=2)))
@pytest.mark.parametrize("offered_ago", [0.0, 14.9, 15.0, 60.0])
def test_a_round_offers_pending_outputs_and_settles_old_doubts(
    states: tuple[OutputState, OutputState], offered_ago: float
) -> None:
    doubt = SETTINGS.media_heartbeat_timeout_seconds
    outputs = [Output(360, states[0], attempt=1, offered_at=NOW - s(offered_ago)),
               Output(720, states[1], attempt=1, offered_at=NOW - s(offered_ago))]
    plan = plan_tick(Deadline(NOW + s(10)), reversed(outputs), NOW, doubt_seconds=doubt)
    over = offered_ago >= doubt
    assert plan.fail is None
    assert plan.settle == tuple(o.height for o in outputs if o.state == OutputState.OFFERED and over)
    assert plan.offer == tuple(o.height for o in outputs
                               if o.state == OutputState.PENDING or (o.state == OutputState.OFFERED and over))
    assert list(plan.offer) == sorted(plan.offer)
    assert doubt_over(None, NOW, doubt)


def test_a_round_past_the_deadline_fails_and_offers_nothing() -> None:
    plan = plan_tick(Deadline(NOW, last_round=LastRound.HEARD), [Output(360, OutputState.PENDING)], NOW,
                     doubt_seconds=1)
    assert plan.fail == FailureReason.DEADLINE and plan.offer == ()


# ------------------------------------------------------------------------------------------------ stuck


@pytest.mark.parametrize(("started_ago", "busy_ago", "stuck"), [
    (STUCK + 1, None, True),
    (STUCK - 1, None, False),
    (STUCK, None, False),  # more than the threshold
    (STUCK + 1, STUCK - 1, False),  # started long ago, a recent busy answer: not restarted
    (STUCK + 1, STUCK + 0.5, True),  # busy answers stopped long ago too
    (STUCK - 1, STUCK + 100, False),  # busy_at before the start: the start counts
    (2 * STUCK, 5 * 3600, False),  # SPEC: waited five hours, then started encoding: not restarted while it encodes
])  # fmt: skip
def test_the_stuck_clock_runs_from_the_later_of_start_and_busy_at(
    started_ago: float, busy_ago: float | None, stuck: bool
) -> None:
    busy_at = NOW - s(busy_ago) if busy_ago is not None else None
    assert is_stuck(NOW - s(started_ago), busy_at, NOW, STUCK) is stuck


def test_only_encoding_outputs_are_restarted() -> None:
    long_ago = NOW - s(STUCK + 1)
    outputs = [Output(h, st, started_at=long_ago) for h, st in zip(LADDER, STATES, strict=False)]
    assert stuck_outputs(outputs, None, NOW, STUCK) == (LADDER[STATES.index(OutputState.ENCODING)],)
    assert stuck_outputs([Output(360, OutputState.ENCODING)], None, NOW, STUCK) == ()  # no start known


# ---------------------------------------------------------------------------------------------- results


@pytest.mark.parametrize("video_state", [None, *ProcessingState])
@pytest.mark.parametrize("output_state", [None, *OutputState])
@pytest.mark.parametrize("same_attempt", [True, False])
def test_a_result_counts_only_for_the_current_attempt(
    video_state: ProcessingState | None, output_state: OutputState | None, same_attempt: bool
) -> None:
    output = Output(360, output_state, attempt=2) if output_state is not None else None
    verdict = judge_result(video_state, output, 2 if same_attempt else 1)
    if video_state is None or output_state is None or not same_attempt:
        assert verdict == Verdict.STALE  # a late result from a worker declared dead: ignored
    elif output_state == OutputState.DONE:
        assert verdict == Verdict.DUPLICATE  # a repeated delivery: nothing twice
    elif video_state == ProcessingState.PROCESSING and output_state in (OutputState.OFFERED, OutputState.ENCODING):
        assert verdict == Verdict.APPLY
    else:
        assert verdict == Verdict.STALE  # back to pending (dead worker, restart), or the video is over


# -------------------------------------------------------------------------------------------- heartbeats


@pytest.mark.parametrize("video_state", list(ProcessingState))
@pytest.mark.parametrize("output_state", list(OutputState))
@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.parametrize("on_this_instance", [True, False])
def test_a_heartbeat_adopts_lost_acceptances_and_cancels_what_is_not_wanted(
    video_state: ProcessingState, output_state: OutputState, attempt: int, on_this_instance: bool
) -> None:
    known = {("v", 360): Known(video_state, Output(360, output_state, attempt=2,
                                                   instance="w1" if on_this_instance else "w2"))}
    job = Reported("v", 360, attempt)
    plan = reconcile("w1", [job, Reported("unknown", 720, 1)], known)
    assert Reported("unknown", 720, 1) in plan.cancel
    wanted = video_state == ProcessingState.PROCESSING and attempt == 2
    if wanted and output_state == OutputState.OFFERED:
        assert plan.adopt == (job,)
    elif wanted and output_state == OutputState.ENCODING and on_this_instance:
        assert job not in plan.adopt and job not in plan.cancel
    else:
        assert job in plan.cancel and plan.adopt == ()


def test_offers_go_first_to_workers_with_room_and_all_live_workers_are_asked() -> None:
    full = WorkerView("full", "i1", slots=2, developer_running=1)  # its last slot is kept for first party
    empty = WorkerView("empty", "i2", slots=2)
    large = WorkerView("large", "i3", slots=4, developer_running=1, large_developer_running=True)
    leaving = WorkerView("leaving", "i4", slots=8, leaving=True)
    order = offer_order([full, large, empty, leaving], JobClass.DEVELOPER, True)
    assert [w.name for w in order] == ["empty", "large", "full"]  # the emptiest first among the full ones
    assert [w.name for w in offer_order([full, empty], JobClass.FIRST_PARTY, False)] == ["empty", "full"]
    assert full.room_for(JobClass.FIRST_PARTY, True) and not full.room_for(JobClass.DEVELOPER, False)
    assert large.room_for(JobClass.DEVELOPER, False) and not large.room_for(JobClass.DEVELOPER, True)
    assert free_developer_slots(empty) == 1 and free_developer_slots(full) == 0
    assert empty.with_accepted(JobClass.DEVELOPER, True).large_developer_running
    assert not empty.with_accepted(JobClass.DEVELOPER, False).large_developer_running
    assert empty.with_accepted(JobClass.FIRST_PARTY, True).first_party_running == 1


@pytest.mark.parametrize("job_class", list(JobClass))
def test_the_large_output_rule_follows_the_setting(job_class: JobClass) -> None:
    threshold = SETTINGS.large_output_height
    for height in LADDER:
        expected = job_class == JobClass.DEVELOPER and height >= threshold
        assert is_large_output(job_class, height, threshold) is expected
    assert not is_large_output(job_class, threshold - 2, threshold)
    assert is_large_output(job_class, LADDER[0], LADDER[0]) is (job_class == JobClass.DEVELOPER)


# ---------------------------------------------------------------------------------------------- deletion


def _output(height: int, state: OutputState, instance: str | None, object_key: str | None, attempt: int = 2) -> Output:
    return Output(height, state, attempt=attempt, instance=instance, object_key=object_key,
                  worker=None if instance is None else f"name-{instance}")


OUTPUT_CASES = [(state, instance, key) for state in STATES for instance in (None, "w1") for key in (None, "k")]
"""Every output a video can have when it is deleted: each state, with or without a worker and a stored rendition."""


@pytest.mark.parametrize(("state", "instance", "key"), OUTPUT_CASES)
def test_what_a_deletion_does_to_each_output(state: OutputState, instance: str | None, key: str | None) -> None:
    action = output_on_deletion(_output(360, state, instance, key))
    expected = {
        OutputState.PENDING: OnDeletion.NOTHING,  # nothing runs, nothing was written: it is simply never offered
        OutputState.OFFERED: OnDeletion.STOP_WHEN_SEEN,  # in doubt: stopped when a worker turns out to run it
        OutputState.ENCODING: OnDeletion.STOP if instance is not None else OnDeletion.STOP_WHEN_SEEN,
        OutputState.DONE: OnDeletion.REMOVE if key is not None else OnDeletion.NOTHING,
        OutputState.CANCELLED: OnDeletion.NOTHING,  # deleted already
    }[state]
    assert action == expected


@pytest.mark.parametrize("video_state", [None, *ProcessingState])
def test_a_deletion_cancels_every_output_stops_its_jobs_and_removes_its_renditions(
    video_state: ProcessingState | None,
) -> None:
    for first, second in itertools.product(OUTPUT_CASES, repeat=2):
        outputs = [_output(720, *second, attempt=3), _output(360, *first)]
        plan = deletion_plan(video_state, outputs)
        if video_state is None or video_state == ProcessingState.DELETED:  # never had it, or deleted already
            assert (plan.delete, plan.cancel, plan.stop, plan.remove) == (False, (), (), ())
            continue
        # processing, ready or failed alike: every output not cancelled yet is cancelled, lowest first
        assert plan.delete
        ordered = sorted(outputs, key=lambda o: o.height)
        assert plan.cancel == tuple(o.height for o in ordered if o.state != OutputState.CANCELLED)
        assert plan.stop == tuple(Stop(o.instance, o.height, o.attempt) for o in ordered
                                  if o.state == OutputState.ENCODING and o.instance is not None)
        assert plan.remove == tuple(o.object_key for o in ordered
                                    if o.state == OutputState.DONE and o.object_key is not None)


@pytest.mark.parametrize("video_state", [ProcessingState.PROCESSING, ProcessingState.READY, ProcessingState.FAILED])
@pytest.mark.parametrize(("state", "instance", "key"), OUTPUT_CASES)
def test_after_a_deletion_nothing_of_the_video_counts_or_is_offered_again(
    video_state: ProcessingState, state: OutputState, instance: str | None, key: str | None
) -> None:
    """The state a deletion leaves (the video deleted, its outputs cancelled with their attempts) takes no result,
    no round offers anything of it, and every job a worker reports of it is stopped."""
    before = _output(360, state, instance, key)
    plan = deletion_plan(video_state, [before])
    after = Output(360, OutputState.CANCELLED if 360 in plan.cancel else before.state, attempt=before.attempt,
                   instance=before.instance, object_key=before.object_key)
    assert after.state == OutputState.CANCELLED
    for attempt in (before.attempt - 1, before.attempt, before.attempt + 1):  # a late result of any attempt
        assert judge_result(ProcessingState.DELETED, after, attempt) == Verdict.STALE
        for reporter in ("w1", "w2"):
            reported = Reported("v", 360, attempt)
            assert reconcile(reporter, [reported], {("v", 360): Known(ProcessingState.DELETED, after)}).cancel == (
                reported,)
    tick = plan_tick(Deadline(NOW + s(DEADLINE)), [after], NOW, doubt_seconds=0)
    assert tick.offer == () and tick.settle == ()  # (rounds take only processing videos; even so, nothing offered)
    deleted = ProcessingState.DELETED
    assert deletion_plan(deleted, [after]) == deletion_plan(deleted, [])  # twice: nothing


@pytest.mark.parametrize("listened", [0.0, 0.5, 0.999, 1.0, 1.5, 10.0])
def test_silence_says_a_worker_is_dead_only_after_a_whole_timeout_of_listening(listened: float) -> None:
    timeout = SETTINGS.media_heartbeat_timeout_seconds
    assert may_declare_dead(listened * timeout, timeout) == (listened >= 1.0)
