"""A team's recording.completed is checked against its subject (SPEC 12, issue 29): encode takes a recording only for
objects under its account's prefix and videos of its account that have no source yet, as a job of the subject's
class; what it refuses is parked and told to the team on `publisher.<name>.rejected`.

encode (and media where a video encodes) run as processes on the session's real NATS, PostgreSQL and S3; events are
published with the test's privileged connection on the exact subjects a team's or the api's would use (what NATS
lets a team publish is tested with the permissions). Durations come from settings (`fast_farm`, WAIT).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.bus import HDR_LEGACY_COPY, HDR_MSG_ID
from shared.contracts import contract, dlq_subject, subject_of
from shared.events import Envelope, RecordingCompleted, UploadCompleted, VideoCreated, VideoDeleted, new_event
from shared.settings import CommonSettings
from shared.videos import JobClass
from tests.integration.test_encode_helpers import (
    Procs,
    Source,
    encode_rows,
    fast_farm,
    make_sources,
    put_object,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SHORT_240 = Source(240, 1)
WAIT = 2.0  # recording_owner_wait_seconds: short, so that an unknown video is refused within the test
SETTINGS = fast_farm(recording_owner_wait_seconds=WAIT, media_slots=3)  # one slot is kept for first-party jobs
RECORDING = "recording.completed"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[Source, Path]:
    return make_sources(tmp_path_factory.mktemp("recording-sources"), SHORT_240)


@dataclass
class Heard:
    """What the bus carried while the test listened (core subscriptions): encode's events with the subject each came
    on and whether it was the legacy copy, every publisher.<name>.rejected, and what was parked of recordings."""

    encode: list[tuple[str, bool, Envelope]] = field(default_factory=list)
    rejected: list[tuple[str, Envelope, float]] = field(default_factory=list)  # (subject, event, monotonic time)
    parked: list[Msg] = field(default_factory=list)

    def rejections(self, publisher: str) -> list[Envelope]:
        return [e for s, e, _ in self.rejected if s == f"publisher.{publisher}.rejected"]

    def rejection_of(self, publisher: str, event_id: str) -> Envelope | None:
        return next((e for e in self.rejections(publisher) if e.data["event_id"] == event_id), None)

    def encode_of(self, video_id: str, type_: str) -> list[tuple[str, bool, Envelope]]:
        return [(s, legacy, e) for s, legacy, e in self.encode if e.subject == video_id and e.type == type_]


@pytest.fixture
async def heard(nc: NATS) -> AsyncIterator[Heard]:
    seen = Heard()

    async def on_encode(msg: Msg) -> None:
        legacy = (msg.headers or {}).get(HDR_LEGACY_COPY) == "1"
        seen.encode.append((msg.subject, legacy, Envelope.from_bytes(msg.data)))

    async def on_rejected(msg: Msg) -> None:
        seen.rejected.append((msg.subject, Envelope.from_bytes(msg.data), time.monotonic()))

    async def on_parked(msg: Msg) -> None:
        seen.parked.append(msg)

    subs = [await nc.subscribe("encode.>", cb=on_encode),
            await nc.subscribe(contract("publisher.rejected").wildcard, cb=on_rejected),
            await nc.subscribe(dlq_subject(RECORDING), cb=on_parked)]
    yield seen
    for sub in subs:
        await sub.unsubscribe()


# ------------------------------------------------------------------------------------- publishing as each party


async def publish(nc: NATS, subject: str, event: Envelope) -> Envelope:
    await nc.jetstream().publish(subject, event.to_bytes(), headers={HDR_MSG_ID: event.id})
    return event


async def video_created(nc: NATS, account: str) -> str:
    """The api creates a video of the account: video.created on video.created.<account>."""
    video_id = str(uuid.uuid4())
    data = VideoCreated(video_id=video_id, app_id=str(uuid.uuid4()), account_id=account)
    await publish(nc, _subject(data), new_event(data, source="api", subject=video_id))
    return video_id


async def video_deleted(nc: NATS, account: str, video_id: str) -> None:
    data = VideoDeleted(video_id=video_id, app_id=str(uuid.uuid4()), account_id=account)
    await publish(nc, _subject(data), new_event(data, source="api", subject=video_id))


async def upload_completed(prepared: CommonSettings, nc: NATS, account: str, video_id: str, source: Path) -> str:
    """The video's file is uploaded: upload.completed on upload.completed.<account>; returns its object key."""
    key = f"sources/{account}/{video_id}"
    size = await put_object(prepared, key, source)
    data = UploadCompleted(video_id=video_id, app_id=str(uuid.uuid4()), account_id=account, key_id=str(uuid.uuid4()),
                           object_key=key, size=size, content_type="video/mp4", source_height=240)
    await publish(nc, _subject(data), new_event(data, source="api", subject=video_id))
    return key


async def team_recording(prepared: CommonSettings, nc: NATS, *, account: str, publisher: str, job_class: str,
                         video_id: str, source: Path, key: str | None = None) -> Envelope:
    """A team's recording.completed on recording.completed.<account>.<publisher>.<job_class>, its object stored."""
    key = key or f"recordings/{account}/{video_id}.mp4"
    size = await put_object(prepared, key, source)
    event = new_event(RecordingCompleted(recording_id=video_id, object_key=key, size=size, source_height=240),
                      source=publisher, subject=video_id)
    return await publish(nc, team_subject(account, publisher, job_class), event)


def team_subject(account: str, publisher: str, job_class: str) -> str:
    subject = contract(RECORDING).fill({"account_id": account, "publisher": publisher, "job_class": job_class})
    assert subject is not None
    return subject


def _subject(data: VideoCreated | VideoDeleted | UploadCompleted) -> str:
    subject = subject_of(data.event_type, data.model_dump())
    assert subject is not None and subject != data.event_type
    return subject


def names() -> tuple[str, str, str, str]:
    """Two accounts and their teams' identities, fresh for each test."""
    tag = uuid.uuid4().hex[:8]
    return f"acct-a-{tag}", f"acct-b-{tag}", f"team-a-{tag}", f"team-b-{tag}"


# ------------------------------------------------------------------------------------------------ reading encode


async def owner(prepared: CommonSettings, video_id: str) -> str | None:
    conn = await asyncpg.connect(prepared.database_url)
    try:
        found: str | None = await conn.fetchval(
            "SELECT account_id FROM encode.video_accounts WHERE video_id = $1", video_id)
        return found
    finally:
        await conn.close()


async def deleted_here(prepared: CommonSettings, video_id: str) -> bool:
    conn = await asyncpg.connect(prepared.database_url)
    try:
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM encode.deletions WHERE video_id = $1)",
                                        video_id))
    finally:
        await conn.close()


def ready(heard: Heard, video_id: str) -> bool:
    return any(e.data.get("outputs_remaining") == 0 for _, _, e in heard.encode_of(video_id, "encode.completed"))


def assert_on_account_subjects(heard: Heard, video_id: str, account: str) -> None:
    """Every encode.* event of the video went on `encode.<x>.<account>` once, and no copy on the bare type (progress
    too: media had the account from the offer; WEIR_EVENTS_LEGACY_SUBJECTS is off by default)."""
    mine = [(s, legacy, e) for s, legacy, e in heard.encode if e.subject == video_id]
    assert mine
    for subject, legacy, e in mine:
        assert subject == (e.type if legacy else f"{e.type}.{account}"), (subject, legacy, e.type)
        assert e.data.get("account_id") == account
    by_id: dict[str, set[bool]] = {}
    for _, legacy, e in mine:
        by_id.setdefault(e.id, set()).add(legacy)
    assert all(copies == {False} for copies in by_id.values()), by_id


# ------------------------------------------------------------------------------------------------------- tests


async def test_a_team_cannot_squat_another_accounts_video_and_its_upload_then_encodes(
    farm: Procs, heard: Heard, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    """The squatting race of issue 29: team B reads A's video.created and publishes a recording of that id before
    A's upload completes. Before, encode opened the video with B's object as a first-party job and A's
    upload.completed opened nothing; now B's recording is refused `not_your_video` (told on B's subject only) and
    A's upload opens and encodes the video from A's object."""
    account_a, account_b, team_a, team_b = names()
    farm.start("encode", "media-1", **SETTINGS)
    video_id = await video_created(nc, account_a)
    squat = await team_recording(prepared, nc, account=account_b, publisher=team_b, job_class=JobClass.DEVELOPER,
                                 video_id=video_id, source=sources[SHORT_240])


    async def handled() -> Envelope | asyncpg.Record | None:  # refused and told, or (the bug) opened from B's object
        return heard.rejection_of(team_b, squat.id) or (await encode_rows(prepared, video_id))[0]

    await wait_for(handled, 10 + WAIT, "encode to handle B's recording")
    assert (await encode_rows(prepared, video_id))[0] is None  # nothing opened: A's upload still can
    told = heard.rejection_of(team_b, squat.id)
    assert told is not None and told.data["code"] == "not_your_video"
    assert told.data["subject"] == team_subject(account_b, team_b, JobClass.DEVELOPER)
    assert told.data["event_type_refused"] == RECORDING and told.data["publisher"] == team_b
    assert any(squat.id.encode() in m.data for m in heard.parked)  # as received, on the dead-letter queue

    key = await upload_completed(prepared, nc, account_a, video_id, sources[SHORT_240])
    await wait_for(lambda: ready(heard, video_id), 60, "A's video to be ready")
    video, outputs = await encode_rows(prepared, video_id)
    assert video is not None and video["object_key"] == key and video["job_class"] == JobClass.DEVELOPER
    assert [o["state"] for o in outputs] == ["done"]
    assert await owner(prepared, video_id) == account_a
    assert_on_account_subjects(heard, video_id, account_a)
    assert heard.rejections(team_a) == []  # nobody else hears of B's refusal


async def test_each_refusal_is_parked_and_told_to_its_team_alone(
    farm: Procs, heard: Heard, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    account_a, account_b, team_a, team_b = names()
    farm.start("encode", **SETTINGS)  # nothing is encoded: no worker needed
    src = sources[SHORT_240]
    dev = JobClass.DEVELOPER.value

    gold_video = await video_created(nc, account_a)
    outside_video = await video_created(nc, account_a)
    uploaded = await video_created(nc, account_a)
    await upload_completed(prepared, nc, account_a, uploaded, src)
    gone = await video_created(nc, account_a)
    await video_deleted(nc, account_a, gone)
    await wait_for(lambda: owner(prepared, outside_video), 10, "encode to learn the accounts")
    await wait_for(lambda: deleted_here(prepared, gone), 10, "encode to handle the deletion")
    await wait_for(lambda: encode_rows(prepared, uploaded), 10, "the upload to open its video",
                   until=lambda rows: rows[0] is not None)

    started = time.monotonic()
    expected = {
        (await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class="gold",
                              video_id=gold_video, source=src)).id: "unknown_job_class",
        (await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class=dev, video_id=outside_video,
                              source=src, key=f"recordings/{account_b}/{outside_video}.mp4")).id:
            "object_outside_prefix",
        (await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class=dev, video_id=uploaded,
                              source=src)).id: "has_source",
        (await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class=dev, video_id=gone,
                              source=src)).id: "video_deleted",
        (await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class=dev,
                              video_id=str(uuid.uuid4()), source=src)).id: "unknown_video",
    }
    malformed_id = str(uuid.uuid4())
    await nc.jetstream().publish(team_subject(account_a, team_a, dev),
                                 f'{{"id": "{malformed_id}", "type": "{RECORDING}", "data": {{}}}}'.encode(),
                                 headers={HDR_MSG_ID: malformed_id})
    expected[malformed_id] = "malformed"

    await wait_for(lambda: len(heard.rejections(team_a)) >= len(expected), 10 + WAIT, "every refusal told",
                   until=lambda ok: ok)
    codes = {e.data["event_id"]: e.data["code"] for e in heard.rejections(team_a)}
    assert codes == expected
    unknown = next(t for s, e, t in heard.rejected if e.data["code"] == "unknown_video"
                   and s == f"publisher.{team_a}.rejected")
    assert unknown - started >= WAIT * 0.9  # its account could still come: it waited, then was refused
    for event_id in expected:
        assert any(event_id.encode() in m.data for m in heard.parked), event_id  # as received, on the DLQ
    assert heard.rejections(team_b) == []
    for video_id in (gold_video, outside_video, gone):
        assert (await encode_rows(prepared, video_id))[0] is None
    video, _ = await encode_rows(prepared, uploaded)
    assert video is not None and video["object_key"].startswith("sources/")  # the upload's source, not the recording


async def test_a_teams_recordings_of_its_own_videos_are_encoded_as_the_subjects_job_class(
    farm: Procs, heard: Heard, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    """A developer-class recording of a video the account created, and a first-party one of an id encode has not
    heard of (it becomes the account's): both encode, as their subject's job class, on the account's subjects."""
    account_a, _, team_a, team_b = names()
    farm.start("encode", "media-1", **SETTINGS)
    src = sources[SHORT_240]
    created = await video_created(nc, account_a)
    await wait_for(lambda: owner(prepared, created), 10, "encode to learn the video's account")
    mine = await team_recording(prepared, nc, account=account_a, publisher=team_a, job_class=JobClass.DEVELOPER,
                                video_id=created, source=src)
    fresh = str(uuid.uuid4())
    await team_recording(prepared, nc, account=account_a, publisher=team_b, job_class=JobClass.FIRST_PARTY,
                         video_id=fresh, source=src)
    for video_id in (created, fresh):
        await wait_for(lambda v=video_id: ready(heard, v), 60, f"{video_id} to be ready")
    (video, _), (first, _) = await encode_rows(prepared, created), await encode_rows(prepared, fresh)
    assert video is not None and video["job_class"] == JobClass.DEVELOPER
    assert video["object_key"] == mine.data["object_key"]
    assert first is not None and first["job_class"] == JobClass.FIRST_PARTY
    assert await owner(prepared, fresh) == account_a
    for video_id in (created, fresh):
        assert_on_account_subjects(heard, video_id, account_a)
    assert heard.rejected == []
