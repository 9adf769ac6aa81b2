"""video.deleted reaches encode and the farm (SPEC sections 4, 6, 7): processing stops for good.

encode and media run as processes on the session's real NATS, PostgreSQL and S3, with real ffmpeg; the deletion is
announced as the api announces it (video.deleted on JetStream). Durations come from settings (`fast_farm`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.bus import HDR_MSG_ID
from shared.events import Envelope
from shared.media.protocol import (
    CANCEL_PREFIX,
    OFFER_PREFIX,
    RESULT_SUBJECT,
    Cancel,
    Offer,
    OutputResult,
    ResultAck,
)
from shared.media.protocol import rendition_key as rendition
from shared.messaging import tool_broker
from shared.publishers import EventPublishers
from shared.replay import replay
from shared.settings import CommonSettings
from tests.integration.test_encode_farm import announce, failed, opened, ready
from tests.integration.test_encode_helpers import (
    Events,
    FakeWorker,
    Procs,
    Source,
    encode_rows,
    fast_farm,
    ffmpeg_children,
    make_sources,
    metric,
    objects_under,
    publish_deleted,
    publish_upload,
    put_object,
    status,
)
from tests.stored import object_exists
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

HOLD_720 = Source(720, 20, fps=5)  # read at real time: its 360p output holds a worker's developer slot for 20 s
SHORT_720 = Source(720, 1)
SHORT_240 = Source(240, 1)
CONSUMER = "encode_deletions"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[Source, Path]:
    return make_sources(tmp_path_factory.mktemp("deleted-sources"), HOLD_720, SHORT_720, SHORT_240)


@dataclass
class FarmTraffic:
    """Every offer and cancel encode sends to any worker (a core subscription beside the workers' own)."""

    offers: list[Offer] = field(default_factory=list)
    cancels: list[tuple[str, Cancel]] = field(default_factory=list)  # (worker instance, message)

    def offered(self, video_id: str, height: int | None = None) -> list[Offer]:
        return [o for o in self.offers if o.video_id == video_id and (height is None or o.output == height)]

    def cancelled(self, video_id: str) -> list[tuple[str, int, int, str | None]]:
        return [(instance, j.output, j.attempt, c.reason) for instance, c in self.cancels for j in c.jobs
                if j.video_id == video_id]


@pytest.fixture
async def traffic(nc: NATS) -> AsyncIterator[FarmTraffic]:
    seen = FarmTraffic()

    async def on_offer(msg: Msg) -> None:
        seen.offers.append(Offer.model_validate_json(msg.data))

    async def on_cancel(msg: Msg) -> None:
        seen.cancels.append((msg.subject.rsplit(".", 1)[1], Cancel.model_validate_json(msg.data)))

    subs = [await nc.subscribe(f"{OFFER_PREFIX}.*", cb=on_offer),
            await nc.subscribe(f"{CANCEL_PREFIX}.*", cb=on_cancel)]
    yield seen
    for sub in subs:
        await sub.unsubscribe()


async def put_bytes(prepared: CommonSettings, key: str, data: bytes, tmp_path: Path) -> None:
    path = tmp_path / uuid.uuid4().hex
    path.write_bytes(data)
    await put_object(prepared, key, path)


async def deleted_rows(prepared: CommonSettings, video_id: str) -> dict[str, Any] | None:
    """encode's rows of the video once it recorded the deletion: the video, its outputs, its tombstone.

    The tombstone is read first: once it shows, the deletion's transaction has committed, so the rows read after it
    are the deletion's (read the other way round, a commit between the reads shows a tombstone beside old rows)."""
    conn = await asyncpg.connect(prepared.database_url)
    try:
        tombstone = await conn.fetchrow("SELECT * FROM encode.deletions WHERE video_id = $1", video_id)
    finally:
        await conn.close()
    if tombstone is None:
        return None
    video, outputs = await encode_rows(prepared, video_id)
    return {"video": dict(video) if video else None, "outputs": [dict(o) for o in outputs],
            "deletion": dict(tombstone)}


async def inbox_times(prepared: CommonSettings, consumer: str, event_id: str) -> int | None:
    conn = await asyncpg.connect(prepared.database_url)
    try:
        times: int | None = await conn.fetchval(
            "SELECT times FROM encode.inbox WHERE consumer = $1 AND event_id = $2::uuid", consumer, event_id)
        return times
    finally:
        await conn.close()


async def outbox_of(prepared: CommonSettings, video_id: str) -> list[str]:
    """The types of the events encode wrote about the video, in order: committed with each change, so what a
    delivery or a result caused is here once encode has answered it (the relay publishes them soon after)."""
    conn = await asyncpg.connect(prepared.database_url)
    try:
        rows = await conn.fetch("SELECT payload FROM encode.outbox ORDER BY seq")
    finally:
        await conn.close()
    return [e.type for e in (Envelope.from_bytes(bytes(r["payload"])) for r in rows) if e.subject == video_id]


async def deliver(nc: NATS, result: OutputResult) -> ResultAck:
    """A worker's delivery of a result to encode (`farm.result`), as `media` sends it."""
    reply = await nc.request(RESULT_SUBJECT, result.model_dump_json().encode(), timeout=5)
    return ResultAck.model_validate_json(reply.data)


# ------------------------------------------------------------------------------------------------------ tests


async def test_a_video_deleted_mid_encode_stops_its_job_leaves_nothing_in_storage_and_publishes_nothing(
    farm: Procs, events: Events, traffic: FarmTraffic, nc: NATS, prepared: CommonSettings,
    sources: dict[Source, Path], tmp_path: Path,
) -> None:
    # 2 slots: one for developer jobs (the other is kept for first-party ones). 360p takes it and is read at real
    # time for 20 s; 720p answers busy round after round.
    settings = fast_farm(media_slots=2, media_read_rate=1)
    [encode, worker] = farm.start("encode", "media-1", **settings)
    video_id = await announce(prepared, nc, sources[HOLD_720], height=720)
    started = await wait_for(lambda: events.of(video_id, "encode.started"), 20, "360p to start")
    assert [e.data["output"] for e in started] == [360]
    await wait_for(lambda: len(traffic.offered(video_id, 720)) >= 2, 10, "720p offered (and busy) twice")
    await wait_for(lambda: ffmpeg_children(worker), 10, "the job's ffmpeg")
    _, outputs = await encode_rows(prepared, video_id)
    running = {o["height"]: o["attempt"] for o in outputs}
    # what a partly written upload of the running attempt would leave in storage
    await put_bytes(prepared, rendition(video_id, 360, running[360]), b"partial", tmp_path)

    # counted from here: this encode may have caught up on other tests' deletions in the stream when it started
    deleted_before = metric(encode, "videos_deleted_total")
    await publish_deleted(nc, video_id=video_id)
    rows = await wait_for(lambda: deleted_rows(prepared, video_id), 10, "encode to record the deletion")
    at_deletion = {o["height"]: o["attempt"] for o in rows["outputs"]}
    assert rows["video"]["state"] == "deleted"
    assert [(o["height"], o["state"]) for o in rows["outputs"]] == [(360, "cancelled"), (720, "cancelled")]
    assert rows["deletion"]["known"] is True
    # the running job is told to stop, on the worker that runs it; its ffmpeg ends
    on = next(o["worker_instance"] for o in outputs if o["height"] == 360)
    assert traffic.cancelled(video_id)[0] == (on, 360, running[360], "deleted")
    await wait_for(lambda: not ffmpeg_children(worker), 10, "the job's ffmpeg to end")
    assert metric(worker, "cancels_total", reason="deleted") == 1

    # the slot is free again: another video takes it, long before the deleted job would have ended
    other = await announce(prepared, nc, sources[SHORT_240], height=240)
    await wait_for(lambda: ready(events, other), HOLD_720.seconds, "another video to take the slot")
    other_started = events.of(other, "encode.started")[0]
    assert other_started.data["worker"] == "media-1"
    assert other_started.time < started[0].time + timedelta(seconds=HOLD_720.seconds), "the slot was freed early"

    # nothing of the deleted video remains in storage, and nothing of it was reported
    assert await wait_for(lambda: _nothing_under(prepared, f"renditions/{video_id}/"), 10, "its renditions gone")
    assert not events.of(video_id, "encode.failed") and not events.of(video_id, "encode.completed")
    assert set(await outbox_of(prepared, video_id)) == {"encode.started", "dispatch.busy"}
    conn = await asyncpg.connect(prepared.database_url)
    try:
        recorded = await conn.fetchval("SELECT count(*) FROM media.results WHERE video_id = $1", video_id)
    finally:
        await conn.close()
    assert recorded == 0, "a cancelled job reports no result"
    # never offered again: every offer ever sent is of an attempt committed before the deletion, and none since
    _, final = await encode_rows(prepared, video_id)
    assert {o["height"]: o["attempt"] for o in final} == at_deletion
    assert all(o.attempt <= at_deletion[o.output] for o in traffic.offered(video_id))
    # the running attempt was the last one offered (a loaded machine may need several offers before one is taken)
    assert max(o.attempt for o in traffic.offered(video_id, 360)) == running[360]
    st = await status(nc, video_id)
    assert st.status == "deleted" and [o.state for o in st.outputs] == ["cancelled", "cancelled"]
    assert metric(encode, "videos_deleted_total") == deleted_before + 1


async def _nothing_under(prepared: CommonSettings, prefix: str) -> bool:
    return not await objects_under(prepared, prefix)


async def test_a_deleted_videos_finished_renditions_go_its_late_results_are_ignored_and_cancels_repeat(
    farm: Procs, events: Events, traffic: FarmTraffic, nc: NATS, prepared: CommonSettings,
    sources: dict[Source, Path], tmp_path: Path,
) -> None:
    # the attempts read below must stay current: on a loaded machine a late answer to an offer (or a late heartbeat)
    # would make encode offer again or declare the worker dead, and this test is about deletion, not those
    settings = fast_farm(dispatch_answer_timeout_ms=3000, media_heartbeat_timeout_seconds=5)
    [encode] = farm.start("encode", **settings)
    async with FakeWorker(nc, heartbeat_seconds=settings["media_heartbeat_seconds"]) as worker:
        video_id = await announce(prepared, nc, sources[SHORT_720], height=720)
        await wait_for(lambda: len(events.of(video_id, "encode.started")) == 2, 10, "360p and 720p to start")
        _, outputs = await encode_rows(prepared, video_id)
        attempt = {o["height"]: o["attempt"] for o in outputs}
        # 360p finishes: its rendition is stored and its result applied
        del worker.running[(video_id, 360)]
        done = rendition(video_id, 360, attempt[360])
        await put_bytes(prepared, done, b"rendition", tmp_path)
        finished = OutputResult(video_id=video_id, output=360, attempt=attempt[360], worker=worker.name,
                                instance=worker.instance, outcome="completed", object_key=done, size=9,
                                finished_at=datetime.now(UTC))
        assert (await deliver(nc, finished)).applied
        await wait_for(lambda: events.of(video_id, "encode.completed"), 10, "360p completed")

        worker.obey_cancels = False  # every cancel is lost: the job keeps running, and heartbeats keep listing it
        await publish_deleted(nc, video_id=video_id)
        await wait_for(lambda: deleted_rows(prepared, video_id), 10, "encode to record the deletion")
        assert await wait_for(lambda: _gone(prepared, done), 10, "the finished rendition to be removed")
        repeated = await wait_for(lambda: len(traffic.cancelled(video_id)) >= 3 and traffic.cancelled(video_id), 10,
                                  "the cancel to be sent again while the worker lists the job")
        assert {c[:3] for c in repeated} == {(worker.instance, 720, attempt[720])}
        worker.obey_cancels = True
        await wait_for(lambda: (video_id, 720) not in worker.running, 10, "the worker to stop the job")

        # results of the deleted video's job arriving late (completed, with its object; failed; handed back)
        late = rendition(video_id, 720, attempt[720])
        await put_bytes(prepared, late, b"late", tmp_path)
        for outcome in ("completed", "failed", "handed_back"):
            result = OutputResult(video_id=video_id, output=720, attempt=attempt[720], worker=worker.name,
                                  instance=worker.instance, outcome=outcome,
                                  object_key=late if outcome == "completed" else None,
                                  size=4 if outcome == "completed" else None,
                                  reason="source_missing" if outcome == "failed" else None,
                                  finished_at=datetime.now(UTC))
            assert await deliver(nc, result) == ResultAck(recorded=True, applied=False)
        assert not await object_exists(prepared, late)
        assert (await deliver(nc, finished)) == ResultAck(recorded=True, applied=False)  # delivered again
        assert not await object_exists(prepared, done)

    # encode answers a result after its commit: whatever the late ones caused would be in its outbox now
    assert await outbox_of(prepared, video_id) == ["encode.started", "encode.started", "encode.completed"]
    assert [e.data["output"] for e in events.of(video_id, "encode.completed")] == [360]
    assert not events.of(video_id, "encode.failed")
    assert metric(encode, "results_total", verdict="stale") == 4
    _, final = await encode_rows(prepared, video_id)
    assert [(o["height"], o["state"], o["attempt"]) for o in final] == [
        (360, "cancelled", attempt[360]), (720, "cancelled", attempt[720])]


async def _gone(prepared: CommonSettings, key: str) -> bool:
    return not await object_exists(prepared, key)


async def test_a_video_deleted_twice_changes_nothing_twice_and_no_deadline_fails_it(
    farm: Procs, events: Events, traffic: FarmTraffic, nc: NATS, prepared: CommonSettings,
    sources: dict[Source, Path],
) -> None:
    # no worker: every round is unreachable, and an undeleted video fails at its deadline (farm_unreachable)
    deadline = 2.0
    [encode] = farm.start("encode", **fast_farm(processing_deadline_seconds=deadline))
    video_id = await announce(prepared, nc, sources[SHORT_240], height=240)
    await opened(nc, video_id)
    since = datetime.now(UTC) - timedelta(seconds=1)
    deleted_before = metric(encode, "videos_deleted_total")  # other tests' deletions it caught up on at start
    deleted = await publish_deleted(nc, video_id=video_id)
    first = await wait_for(lambda: deleted_rows(prepared, video_id), 10, "encode to record the deletion")
    control = await announce(prepared, nc, sources[SHORT_240], height=240)  # its deadline is later than the video's
    until = datetime.now(UTC)

    # redelivered: the same event again past the stream's duplicate window (another Nats-Msg-Id), and replayed
    js = nc.jetstream()
    await js.publish(deleted.type, deleted.to_bytes(), headers={HDR_MSG_ID: f"{deleted.id}-again"})
    async with tool_broker(prepared, "test-replay") as tool:  # as `weir replay` publishes its copies
        publishers = EventPublishers(tool, replay=True, timeout=prepared.bus_publish_timeout_seconds)
        report = await replay(publishers, stream="VIDEOS", subject="video.deleted", since=since, until=until,
                              to=[CONSUMER])
        assert report.delivered[CONSUMER] >= 1
        await wait_for(lambda: metric(encode, "consumer_messages_total", consumer=CONSUMER, outcome="duplicate")
                       >= 1 + report.delivered[CONSUMER], 10, "both deliveries handled as duplicates")
        assert await inbox_times(prepared, CONSUMER, deleted.id) == 1
        assert await deleted_rows(prepared, video_id) == first

        # replayed to be reprocessed on purpose: the handler runs again, and a deleted video stays as it was
        report = await replay(publishers, stream="VIDEOS", subject="video.deleted", since=since, until=until,
                              to=[CONSUMER], reprocess=True)
    await wait_for(lambda: _times_at_least(prepared, deleted.id, 2), 10, "the reprocessed delivery")
    assert await deleted_rows(prepared, video_id) == first

    # the control video, announced after it, fails at its deadline; the deleted one never does
    end = await wait_for(lambda: failed(events, control), deadline + 10, "the control video to fail")
    assert end["reason"] == "farm_unreachable"
    assert not events.of(video_id) and not await outbox_of(prepared, video_id)
    assert await deleted_rows(prepared, video_id) == first
    assert metric(encode, "consumer_messages_total", consumer=CONSUMER, outcome="retry") == 0
    assert metric(encode, "videos_deleted_total") == deleted_before + 1
    assert not traffic.cancelled(video_id)  # nothing ran: nothing to stop


async def _times_at_least(prepared: CommonSettings, event_id: str, n: int) -> bool:
    return (await inbox_times(prepared, CONSUMER, event_id) or 0) >= n


async def test_deleting_a_video_encode_never_heard_of_is_recorded_and_its_later_upload_opens_nothing(
    farm: Procs, events: Events, traffic: FarmTraffic, nc: NATS, prepared: CommonSettings,
    sources: dict[Source, Path],
) -> None:
    [encode, _] = farm.start("encode", "media-1", **fast_farm(media_slots=2))  # one developer slot
    video_id = str(uuid.uuid4())
    deleted = await publish_deleted(nc, video_id=video_id)
    rows = await wait_for(lambda: deleted_rows(prepared, video_id), 10, "encode to record the deletion")
    assert rows["video"] is None and rows["outputs"] == [] and rows["deletion"]["known"] is False
    assert await inbox_times(prepared, CONSUMER, deleted.id) == 1
    assert metric(encode, "consumer_messages_total", consumer=CONSUMER, outcome="handled") >= 1
    for outcome in ("retry", "parked"):
        assert metric(encode, "consumer_messages_total", consumer=CONSUMER, outcome=outcome) == 0
    assert not (await status(nc, video_id)).found

    # its upload.completed handled after the deletion (another consumer, or a replay): encode opens nothing
    key = f"sources/test/{video_id}"
    size = await put_object(prepared, key, sources[SHORT_240])
    upload = await publish_upload(nc, video_id=video_id, object_key=key, size=size, source_height=240)
    await wait_for(lambda: inbox_times(prepared, "encode_uploads", upload.id), 10, "encode to handle the upload")
    assert not (await status(nc, video_id)).found
    # a video uploaded after it is encoded by the same farm (so the first would have been too)
    control = await announce(prepared, nc, sources[SHORT_240], height=240)
    await wait_for(lambda: ready(events, control), 30, "the control video to be ready")
    assert not events.of(video_id) and not traffic.offered(video_id) and not await outbox_of(prepared, video_id)
