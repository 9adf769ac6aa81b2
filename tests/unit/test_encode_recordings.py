"""Whether encode takes a team's recording (SPEC 12): `recording_decision` over every combination of subject,
object key, what encode knows of the video and the time, without a server or a clock."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from services.encode.domain import (
    RecordingCode,
    RecordingDecision,
    RecordingOrigin,
    RecordingVerdict,
    VideoFacts,
    object_in_prefix,
    recording_decision,
    recording_retry_in,
)
from services.encode.settings import EncodeSettings
from shared.videos import JobClass

NOW = datetime(2026, 12, 9, 12, 0, tzinfo=UTC)
WAIT = EncodeSettings().recording_owner_wait_seconds
A, B = "acct-a", "acct-b"
LEGACY = RecordingOrigin()
KEYS = {"own": f"recordings/{A}/r1.mp4", "other": f"recordings/{B}/r1.mp4", "outside": "sources/x/r1.mp4",
        "dotdot": f"recordings/{A}/../{B}/r1.mp4", "empty": f"recordings/{A}//r1.mp4", "bare": f"recordings/{A}/"}
JOB_CLASSES = (JobClass.DEVELOPER.value, JobClass.FIRST_PARTY.value, "gold", "")
OWNERS = (None, A, B)
TIMES = {"fresh": NOW, "waited": NOW - timedelta(seconds=WAIT), "old": NOW - timedelta(days=1),
         "ahead": NOW + timedelta(seconds=WAIT / 2), "far_ahead": NOW + timedelta(seconds=WAIT * 2)}


def decide(origin: RecordingOrigin, key: str, facts: VideoFacts, published_at: datetime = NOW) -> RecordingDecision:
    return recording_decision(origin, key, facts, published_at=published_at, now=NOW, owner_wait_seconds=WAIT)


def team(job_class: str = JobClass.DEVELOPER.value, account: str = A) -> RecordingOrigin:
    return RecordingOrigin(account=account, publisher="team-a", job_class=job_class)


def test_the_bare_legacy_subject_is_taken_as_first_party_whatever_encode_knows() -> None:
    for key, owner, has_source, deleted in itertools.product(KEYS.values(), OWNERS, (False, True), (False, True)):
        d = decide(LEGACY, key, VideoFacts(owner, has_source, deleted))
        assert d == RecordingDecision(RecordingVerdict.ACCEPT, job_class=JobClass.FIRST_PARTY)


@pytest.mark.parametrize("key", ["own", "other", "outside", "dotdot", "empty", "bare"])
def test_only_objects_under_the_subjects_account_prefix(key: str) -> None:
    d = decide(team(), KEYS[key], VideoFacts(owner=A))
    if key == "own":
        assert d.verdict == RecordingVerdict.ACCEPT
    else:
        assert (d.verdict, d.code) == (RecordingVerdict.REFUSE, RecordingCode.OBJECT_OUTSIDE_PREFIX)


def test_object_in_prefix() -> None:
    assert object_in_prefix(f"recordings/{A}/x/y.mp4", A)
    assert not object_in_prefix(f"recordings/{A}x/y.mp4", A)
    assert not object_in_prefix(f"recordings/{A}/./y.mp4", A)
    assert not object_in_prefix(f"recordings/{A}", A)


def test_every_combination_keeps_the_rules() -> None:
    """Over every subject, key, owner, source, deletion and time: what is accepted, what waits, what is refused and
    with which code (the first rule broken, in the order of the docstring)."""
    for job_class, key, owner, has_source, deleted, when in itertools.product(
            JOB_CLASSES, KEYS, OWNERS, (False, True), (False, True), TIMES):
        facts = VideoFacts(owner, has_source, deleted)
        d = decide(team(job_class), KEYS[key], facts, TIMES[when])
        case = (job_class, key, owner, has_source, deleted, when, d)
        if job_class not in (JobClass.DEVELOPER.value, JobClass.FIRST_PARTY.value):
            expected = RecordingCode.UNKNOWN_JOB_CLASS
        elif key != "own":
            expected = RecordingCode.OBJECT_OUTSIDE_PREFIX
        elif owner == B:
            expected = RecordingCode.NOT_YOUR_VIDEO
        elif deleted:
            expected = RecordingCode.VIDEO_DELETED
        elif has_source:
            expected = RecordingCode.HAS_SOURCE
        elif owner == A or job_class == JobClass.FIRST_PARTY.value:
            assert d.verdict == RecordingVerdict.ACCEPT, case
            assert d.job_class == JobClass(job_class), case  # the job class follows the subject
            assert d.remember_owner == (A if owner is None else None), case
            continue
        elif when == "far_ahead":
            expected = RecordingCode.TIME_IN_FUTURE
        elif when in ("fresh", "ahead"):
            assert d.verdict == RecordingVerdict.WAIT and d.code is None, case
            continue
        else:
            expected = RecordingCode.UNKNOWN_VIDEO
        assert (d.verdict, d.code, d.job_class, d.remember_owner) == (RecordingVerdict.REFUSE, expected, None,
                                                                      None), case
        assert d.reason, case


def test_a_developer_recording_never_opens_a_video_of_unknown_owner() -> None:
    """The squatting race: whatever the time, a developer-class recording of a video encode cannot place waits or is
    refused; it never becomes the owner."""
    for when in TIMES.values():
        d = decide(team(), KEYS["own"], VideoFacts(), when)
        assert d.verdict != RecordingVerdict.ACCEPT and d.remember_owner is None


def test_another_accounts_video_is_refused_before_its_source_or_deletion_is_told() -> None:
    """A team learns nothing of another account's video but that it is not its own."""
    for has_source, deleted in itertools.product((False, True), repeat=2):
        d = decide(team(JobClass.FIRST_PARTY.value), KEYS["own"], VideoFacts(B, has_source, deleted))
        assert d.code == RecordingCode.NOT_YOUR_VIDEO


def test_the_wait_ends_exactly_at_the_setting() -> None:
    just_before = NOW - timedelta(seconds=WAIT) + timedelta(microseconds=1)
    assert decide(team(), KEYS["own"], VideoFacts(), just_before).verdict == RecordingVerdict.WAIT
    assert decide(team(), KEYS["own"], VideoFacts(), NOW - timedelta(seconds=WAIT)).code == RecordingCode.UNKNOWN_VIDEO


def test_retry_in_is_the_nak_delay_but_never_past_the_end_of_the_wait() -> None:
    delay = EncodeSettings().consumer_nak_delay_seconds
    assert recording_retry_in(NOW, NOW, WAIT, delay) == min(delay, WAIT)
    almost = NOW - timedelta(seconds=WAIT - delay / 4)
    assert recording_retry_in(almost, NOW, WAIT, delay) == pytest.approx(delay / 4)
    assert recording_retry_in(NOW - timedelta(days=1), NOW, WAIT, delay) == 0.0


def test_a_refusal_is_told_under_one_id_a_uuid7_of_the_refused_events_time() -> None:
    import uuid

    import uuid6

    from services.encode.processing import rejection_id

    refused = str(uuid6.uuid7())
    told = rejection_id(refused)
    assert told is not None and told == rejection_id(refused) and told != refused
    assert uuid.UUID(told).version == 7 and uuid.UUID(told).bytes[:6] == uuid.UUID(refused).bytes[:6]
    assert rejection_id(str(uuid6.uuid7())) != told
    assert rejection_id(None) is None and rejection_id("not-an-id") is None and rejection_id(str(uuid.uuid4())) is None
