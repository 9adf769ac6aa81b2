"""encode and media as processes on the session's real NATS, PostgreSQL and S3, with real ffmpeg (SPEC section 6).

Durations are shrunk through settings (`fast_farm`); sources are made at test time. Uploads are announced as the api
announces them (upload.completed on JetStream); tests/e2e/test_encode_e2e.py goes through the HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import ValidationError

from services.api.videos import ENCODE_STATUS_TIMEOUT_S
from services.encode.domain import DEADLINE_MESSAGE, AnswerKind
from services.encode.farm import Farm, Registry
from services.encode.settings import EncodeSettings
from shared.bus import subscriptions_in_place
from shared.media.protocol import (
    CANCEL_PATTERN,
    HEARTBEAT_SUBJECT,
    OFFER_PATTERN,
    RESULT_SUBJECT,
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
    Heartbeat,
    Offer,
    OfferAnswer,
    Outcome,
    OutputResult,
    ProcessingStatus,
    ResultAck,
    cancel_subject,
    offer_subject,
)
from shared.messaging import error_in, error_reply, make_broker
from shared.settings import CommonSettings
from tests.integration.test_encode_helpers import (
    Events,
    FakeWorker,
    Proc,
    Procs,
    Source,
    asyncapi_channels,
    asyncapi_replies,
    encode_rows,
    fast_farm,
    make_sources,
    publish_recording,
    publish_upload,
    put_object,
    status,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


SHORT_720 = Source(720, 1)
SHORT_240 = Source(240, 1)
MID_720 = Source(720, 2, fps=10)
MID_240 = Source(240, 3, fps=10)
HOLD_240 = Source(240, 12, fps=5)  # read at real time: holds a slot past a restart of encode on a busy machine
LONG_720 = Source(720, 20, fps=5)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[Source, Path]:
    return make_sources(tmp_path_factory.mktemp("sources"), SHORT_720, SHORT_240, MID_720, MID_240, HOLD_240,
                        LONG_720)


async def announce(prepared: CommonSettings, nc: NATS, source: Path, *, height: int | None) -> str:
    video_id = str(uuid.uuid4())
    key = f"sources/test/{video_id}"
    size = await put_object(prepared, key, source)
    await publish_upload(nc, video_id=video_id, object_key=key, size=size, source_height=height)
    return video_id


async def opened(nc: NATS, video_id: str) -> ProcessingStatus:
    """encode's state of the video once it has consumed the upload."""

    async def found() -> ProcessingStatus | None:
        st = await status(nc, video_id)
        return st if st.found else None

    return await wait_for(found, 10, "encode to open the video")


def fast_farm_failures() -> int:
    from services.encode.settings import EncodeSettings

    return EncodeSettings().output_max_failures


def ready(events: Events, video_id: str) -> bool:
    return any(e.data.get("outputs_remaining") == 0 for e in events.of(video_id, "encode.completed"))


def failed(events: Events, video_id: str) -> dict[str, object] | None:
    done = [e.data for e in events.of(video_id, "encode.failed") if e.data.get("output") is None]
    return done[0] if done else None


# ------------------------------------------------------------------------------------------------------ tests


async def test_a_720p_source_of_unknown_height_is_probed_and_encoded_to_360p_and_720p(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path], tmp_path: Path
) -> None:
    settings = fast_farm(media_slots=3)
    farm.start("encode", "media-1", **settings)
    video_id = await announce(prepared, nc, sources[SHORT_720], height=None)  # encode probes it
    text = tmp_path / "notes.txt"
    text.write_text("not a video\n" * 100)
    unreadable = await announce(prepared, nc, text, height=None)
    missing = str(uuid.uuid4())  # a source deleted before it was encoded: every worker fails it
    await publish_upload(nc, video_id=missing, object_key=f"sources/test/{missing}", size=1, source_height=240)
    await wait_for(lambda: ready(events, video_id), 60, "the video to be ready")
    completed = events.of(video_id, "encode.completed")
    assert sorted(e.data["output"] for e in completed) == [360, 720]
    assert [e.data["outputs_remaining"] for e in sorted(completed, key=lambda e: e.time)] == [1, 0]
    st = await status(nc, video_id)
    assert st.status == "ready" and [o.state for o in st.outputs] == ["done", "done"]
    assert (await wait_for(lambda: failed(events, unreadable), 10, "the text file to fail"))["reason"] == \
        "unreadable_source"
    gone = await wait_for(lambda: failed(events, missing), 20, "the missing source to fail")
    assert gone["reason"] == "encode_error"
    per_output = [e.data["reason"] for e in events.of(missing, "encode.failed") if e.data["output"] == 240]
    assert per_output == ["source_missing"] * fast_farm_failures()


async def test_a_full_farm_answers_busy_moves_the_deadline_and_the_video_encodes_once_a_slot_frees(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    # 2 slots: 1 for developer jobs, 1 kept for first-party ones. A 12 s source read at real time holds the first,
    # announced while encode ran with a long deadline; encode then restarts with a short one for the waiting video.
    settings = fast_farm(media_slots=2, media_read_rate=1)
    [encode, _] = farm.start("encode", "media-1", **settings, processing_deadline_seconds=60)
    holder = await announce(prepared, nc, sources[HOLD_240], height=240)
    await wait_for(lambda: events.of(holder, "encode.started"), 20, "the first video to start")
    # the developer slot is held, the kept one is not: a first-party recording is taken at once
    recording = str(uuid.uuid4())
    key = f"sources/test/{recording}"
    await publish_recording(nc, recording_id=recording, object_key=key,
                            size=await put_object(prepared, key, sources[SHORT_240]), source_height=240)
    await wait_for(lambda: events.of(recording, "encode.started"), 10, "the recording to start")
    farm.stop(encode)
    farm.start("encode", **settings, processing_deadline_seconds=1.5)
    waiter = await announce(prepared, nc, sources[SHORT_240], height=240)
    first = await wait_for(lambda: _status_with_busy(nc, waiter), 10, "a busy answer")
    assert first.status == "processing" and first.busy_at is not None
    original_deadline = first.deadline_at
    assert original_deadline is not None
    busy = await wait_for(lambda: len(events.of(waiter, "dispatch.busy")) >= 3 and events.of(waiter, "dispatch.busy"),
                          10, "dispatch.busy events")
    assert busy[0].data["outputs_offered"] == [240] and busy[0].data["workers_answered"] == ["media-1"]
    later = await status(nc, waiter)
    assert later.deadline_at is not None and later.deadline_at > original_deadline  # waiting spends no deadline

    assert later.busy_at is not None and later.busy_at > first.busy_at  # type: ignore[operator]
    await wait_for(lambda: ready(events, waiter), 40, "the waiting video to be ready")
    held_until = events.of(holder, "encode.completed")[-1].time
    assert held_until > original_deadline, "the premise: the developer slot was still held at the original deadline"
    done_at = events.of(waiter, "encode.completed")[-1].time
    assert done_at > original_deadline, "it encoded past its original deadline"
    assert failed(events, waiter) is None
    await wait_for(lambda: ready(events, holder) and ready(events, recording), 10, "the others to be ready")
    assert events.of(recording, "encode.started")[0].time < events.of(holder, "encode.completed")[0].time


async def _status_with_busy(nc: NATS, video_id: str):  # type: ignore[no-untyped-def]
    st = await status(nc, video_id)
    return st if st.busy_at is not None else None


async def test_no_worker_at_all_is_unreachable_and_the_video_fails_at_its_deadline(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    deadline = 1.5
    [encode] = farm.start("encode", **fast_farm(processing_deadline_seconds=deadline))
    video_id = await announce(prepared, nc, sources[SHORT_240], height=240)
    first = await opened(nc, video_id)
    end = await wait_for(lambda: failed(events, video_id), deadline + 10, "the video to fail")
    end = dict(end)
    account = end.pop("account_id")
    assert end == {"video_id": video_id, "output": None, "worker": None, "reason": "farm_unreachable",
                   "message": DEADLINE_MESSAGE}
    assert account is not None  # the upload's: on encode.failed.<account> (SPEC 12)
    final = await status(nc, video_id)
    assert final.status == "failed" and final.deadline_at == first.deadline_at  # never moved
    assert final.busy_at is None and not events.of(video_id, "dispatch.busy")
    fail_event = next(e for e in events.of(video_id, "encode.failed") if e.data["output"] is None)
    assert first.deadline_at is not None and fail_event.time >= first.deadline_at
    assert _answers(encode)["unreachable"] >= 2 and _answers(encode)["busy"] == 0


async def test_workers_killed_or_hung_before_the_round_are_unreachable_not_busy(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    # the workers stay "live" (a long heartbeat timeout) while one is killed and the other hung: no answer comes
    settings = fast_farm(media_slots=2, processing_deadline_seconds=2, media_heartbeat_timeout_seconds=30)
    [encode, killed, hung] = farm.start("encode", "media-1", "media-2", **settings)
    await wait_for(lambda: _live_workers(prepared, 2), 10, "both workers registered")
    killed.kill9()
    hung.signal(signal.SIGSTOP)
    video_id = await announce(prepared, nc, sources[SHORT_240], height=240)
    first = await opened(nc, video_id)
    end = await wait_for(lambda: failed(events, video_id), 15, "the video to fail")
    assert end["reason"] == "farm_unreachable"
    final = await status(nc, video_id)
    assert final.deadline_at == first.deadline_at and final.busy_at is None
    assert not events.of(video_id, "dispatch.busy") and not events.of(video_id, "encode.started")
    answers = _answers(encode)
    assert answers["unreachable"] >= 1 and answers["busy"] == 0 and answers["accepted"] == 0


async def test_one_output_encoding_and_one_busy_keeps_the_deadline_and_fails_at_it(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    # 2 slots: the 360p output takes the only developer slot and encodes at real time for 20 s; 720p answers busy
    settings = fast_farm(media_slots=2, media_read_rate=1, processing_deadline_seconds=2)
    farm.start("encode", "media-1", **settings)
    video_id = await announce(prepared, nc, sources[LONG_720], height=720)
    started = await wait_for(lambda: events.of(video_id, "encode.started"), 10, "360p to start")
    assert [e.data["output"] for e in started] == [360]
    first = await opened(nc, video_id)
    await wait_for(lambda: events.of(video_id, "dispatch.busy"), 10, "a busy round")
    end = await wait_for(lambda: failed(events, video_id), 15, "the video to fail")
    assert end["reason"] == "deadline" and end["message"] == DEADLINE_MESSAGE
    final = await status(nc, video_id)
    assert final.deadline_at == first.deadline_at, "an encoding output keeps the deadline running"
    assert final.busy_at is not None
    assert not events.of(video_id, "encode.completed")


def _answers(proc) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import httpx

    text = httpx.get(f"{proc.url}/metrics").text
    found = {"accepted": 0.0, "busy": 0.0, "unreachable": 0.0}
    for line in text.splitlines():
        if line.startswith("weir_dispatch_answers_total{"):
            kind = line.split('answer="', 1)[1].split('"', 1)[0]
            found[kind] = float(line.rsplit(" ", 1)[1])
    return found


async def _live_workers(prepared: CommonSettings, n: int) -> bool:
    import asyncpg

    conn = await asyncpg.connect(prepared.database_url)
    try:
        count = await conn.fetchval("SELECT count(*) FROM encode.workers WHERE dead_at IS NULL AND NOT leaving")
    finally:
        await conn.close()
    return bool(count >= n)


async def test_the_stuck_rule_runs_from_the_later_of_start_and_busy_at(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    threshold = 1.5
    settings = fast_farm(stuck_restart_seconds=threshold, processing_deadline_seconds=120)
    farm.start("encode", **settings)
    async with FakeWorker(nc) as worker:
        worker.busy_heights = {720}  # 360p runs (and never ends); 720p answers busy round after round
        video_id = await announce(prepared, nc, sources[SHORT_720],
                                  height=720)
        started = await wait_for(lambda: events.of(video_id, "encode.started"), 10, "360p to start")
        since = started[0].time
        # started long ago (past the threshold), but busy_at keeps being recent: never restarted while asked
        while datetime.now(UTC) < since + timedelta(seconds=threshold * 1.7):
            st = await status(nc, video_id)
            assert st.restarted == [] and st.busy_at is not None
            await asyncio.sleep(0.1)
        assert [o.state for o in st.outputs] == ["encoding", "pending"]
        # the busy answers stop (720p is accepted too): a threshold after the last of them, 360p is restarted
        worker.busy_heights = set()
        await wait_for(lambda: len(events.of(video_id, "encode.started")) >= 2, 10, "720p to start")
        last_busy = (await status(nc, video_id)).busy_at
        assert last_busy is not None
        restarted = await wait_for(lambda: _restarted(nc, video_id), 10, "the stuck restart")
        assert 360 in restarted.restarted
        assert datetime.now(UTC) - last_busy > timedelta(seconds=threshold)
        published = await wait_for(
            lambda: [e.data for e in events.of(video_id, "encode.failed") if e.data["output"] == 360], 5,
            "the restart to be published")
        assert published[0]["reason"] == "stuck_restarted" and published[0]["worker"] == "fake-1"
        await wait_for(lambda: any(c.video_id == video_id and c.output == 360 and c.attempt == 1
                                   for c in worker.cancelled), 5, "the hung job to be cancelled")
        # offered again (a new attempt) and counted
        again = await wait_for(lambda: [o for o in worker.offers if o.output == 360 and o.attempt == 2], 10,
                               "360p offered again")
        assert again
        st = await status(nc, video_id)
        assert next(o for o in st.outputs if o.height == 360).restarts == 1


async def _restarted(nc: NATS, video_id: str) -> ProcessingStatus | None:
    st = await status(nc, video_id)
    return st if st.restarted else None


async def test_a_worker_killed_mid_encode_has_its_output_completed_by_another(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    settings = fast_farm(media_slots=2, media_read_rate=1)
    farm.start("encode", "media-1", "media-2", **settings)
    video_id = await announce(prepared, nc, sources[MID_240],
                              height=240)
    started = await wait_for(lambda: events.of(video_id, "encode.started"), 10, "the output to start")
    victim = next(p for p in farm.procs if p.name == started[0].data["worker"])
    victim.kill9()
    await wait_for(lambda: ready(events, video_id), 30, "the video to be ready")
    completed = events.of(video_id, "encode.completed")
    assert len(completed) == 1 and completed[0].data["worker"] != victim.name
    started_on = [e.data["worker"] for e in events.of(video_id, "encode.started")]
    assert started_on == [victim.name, completed[0].data["worker"]]
    _, outputs = await encode_rows(prepared, video_id)
    assert outputs[0]["state"] == "done" and outputs[0]["attempt"] == 2 and outputs[0]["returns"] == 1


async def test_a_late_result_from_a_worker_declared_dead_is_ignored(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    settings = fast_farm(media_slots=2, media_read_rate=1)
    farm.start("encode", "media-1", "media-2", **settings)
    video_id = await announce(prepared, nc, sources[MID_240],
                              height=240)
    started = await wait_for(lambda: events.of(video_id, "encode.started"), 10, "the output to start")
    hung = next(p for p in farm.procs if p.name == started[0].data["worker"])
    hung.signal(signal.SIGSTOP)  # silent: declared dead; its ffmpeg goes on, and its result comes late
    await wait_for(lambda: ready(events, video_id), 30, "the video to be ready on the other worker")
    hung.signal(signal.SIGCONT)
    # whatever the woken worker sends for attempt 1 is ignored; a repeated delivery of it too
    late = OutputResult(video_id=video_id, output=240, attempt=1, worker=hung.name, instance="gone",
                        outcome="completed", object_key=f"renditions/{video_id}/240p-1.mp4", size=1,
                        finished_at=datetime.now(UTC))
    reply = await nc.request(RESULT_SUBJECT, late.model_dump_json().encode(), timeout=5)
    assert ResultAck.model_validate_json(reply.data) == ResultAck(recorded=True, applied=False)
    await wait_for(lambda: _woken_and_quiet(hung, prepared, video_id), 15, "the woken worker to settle")
    completed = events.of(video_id, "encode.completed")
    assert len(completed) == 1 and completed[0].data["worker"] != hung.name
    assert sum(1 for e in completed if e.data["outputs_remaining"] == 0) == 1
    st = await status(nc, video_id)
    assert st.status == "ready" and st.outputs[0].worker == completed[0].data["worker"]


async def _woken_and_quiet(proc: Proc, prepared: CommonSettings, video_id: str) -> bool:
    """The woken worker either had its stale job cancelled or delivered its stale result: nothing of it is left."""
    import asyncpg
    import httpx

    try:
        async with httpx.AsyncClient(timeout=1) as http:
            if (await http.get(f"{proc.url}/readyz")).status_code != 200:
                return False
    except httpx.HTTPError:
        return False
    conn = await asyncpg.connect(prepared.database_url)
    try:
        undelivered = await conn.fetchval(
            "SELECT count(*) FROM media.results WHERE video_id = $1 AND delivered_at IS NULL", video_id)
    finally:
        await conn.close()
    return bool(undelivered == 0)


async def test_kill_9_of_an_encode_instance_resumes_and_each_video_is_ready_exactly_once(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    settings = fast_farm(media_slots=4, media_read_rate=2)
    encodes = farm.start("encode-a", "encode-b", "media-1", "media-2", **settings)[:2]
    source = sources[MID_720]
    videos = [await announce(prepared, nc, source, height=720) for _ in range(3)]
    await wait_for(lambda: len(events.of(videos[0], "encode.started")) >= 1, 10, "encoding to start")
    encodes[0].kill9()  # mid-round for some video, most likely
    await wait_for(lambda: len([e for v in videos for e in events.of(v, "encode.started")]) >= 3, 10,
                   "more outputs to start")
    encodes[1].kill9()  # now no encode runs: the workers keep their results until one is back
    farm.start("encode-c", **settings)
    for v in videos:
        await wait_for(lambda v=v: ready(events, v), 40, f"video {v} to be ready")
    for v in videos:
        started = sorted(e.data["output"] for e in events.of(v, "encode.started"))
        completed = sorted(e.data["output"] for e in events.of(v, "encode.completed"))
        assert completed == [360, 720], f"{v}: each output completed exactly once"
        assert started == [360, 720], f"{v}: each output dispatched once (no second worker at once)"
        assert sum(1 for e in events.of(v, "encode.completed") if e.data["outputs_remaining"] == 0) == 1
        assert (await status(nc, v)).status == "ready"


# ------------------------------------------------------------------------------------- the subjects, as declared


async def test_encode_and_media_document_their_request_reply_subjects_and_publishers(farm: Procs, nc: NATS) -> None:
    heartbeats: list[Heartbeat] = []

    async def on_heartbeat(msg: Msg) -> None:
        heartbeats.append(Heartbeat.model_validate_json(msg.data))

    sub = await nc.subscribe(HEARTBEAT_SUBJECT, cb=on_heartbeat)
    try:
        [encode, media] = farm.start("encode", "media-1", **fast_farm())
        hb = await wait_for(lambda: next((h for h in heartbeats if h.worker == "media-1"), None), 10, "a heartbeat")
    finally:
        await sub.unsubscribe()
    async with httpx.AsyncClient() as http:
        encode_doc = (await http.get(f"{encode.url}/asyncapi.json")).raise_for_status().json()
        media_doc = (await http.get(f"{media.url}/asyncapi.json")).raise_for_status().json()
    assert asyncapi_channels(encode_doc) >= {
        (STATUS_SUBJECT, "receive", "StatusRequest"),  # from the api of release 1.0.0 (v1)
        (STATUS_V2_SUBJECT, "receive", "StatusesRequest"),  # from the api (v2, beside v1)
        (RESULT_SUBJECT, "receive", "OutputResult"),  # from the workers
        (HEARTBEAT_SUBJECT, "receive", "Heartbeat"),
        (OFFER_PATTERN, "send", "Offer"),  # one subject per worker: the pattern
        (CANCEL_PATTERN, "send", "Cancel"),
    }
    assert asyncapi_channels(media_doc) >= {
        (offer_subject(hb.instance), "receive", "Offer"),  # this worker's own subjects
        (cancel_subject(hb.instance), "receive", "Cancel"),
        (RESULT_SUBJECT, "send", "OutputResult"),
        (HEARTBEAT_SUBJECT, "send", "Heartbeat"),
        ("encode.progress", "send", "EncodeProgressEvent"),  # the runtime's event publisher: the envelope, typed
    }
    # what each request is answered with (FastStream documents only what a subscriber receives): the reply model, or
    # the error reply of a request that does not validate
    assert asyncapi_replies(encode_doc) == {
        STATUS_SUBJECT: {"ProcessingStatus", "ErrorReply"},
        STATUS_V2_SUBJECT: {"ProcessingStatuses", "ErrorReply"},
        RESULT_SUBJECT: {"ResultAck", "ErrorReply"},
    }
    assert asyncapi_replies(media_doc) == {OFFER_PATTERN: {"OfferAnswer", "ErrorReply"}}  # a cancel has no answer
    queues = {c["address"]: c["bindings"]["nats"].get("queue") for c in encode_doc["channels"].values()}
    assert queues[STATUS_SUBJECT] == queues[STATUS_V2_SUBJECT] == queues[RESULT_SUBJECT] == "encode"
    assert queues[HEARTBEAT_SUBJECT] is None
    assert encode_doc["components"]["schemas"]["StatusRequest"]["required"] == ["video_id"]
    assert encode_doc["components"]["schemas"]["StatusesRequest"]["required"] == ["video_ids"]
    assert media_doc["components"]["schemas"]["Offer"]["required"] == [
        "video_id", "output", "attempt", "job_class", "object_key"]


async def test_a_status_request_that_does_not_validate_is_refused_at_once(farm: Procs, nc: NATS) -> None:
    farm.start("encode", **fast_farm())
    for body in (b"{}", b'{"video_id": 12}', b"not json"):
        t0 = time.monotonic()
        reply = await nc.request(STATUS_SUBJECT, body, timeout=5)  # silence would end in a timeout here
        elapsed = time.monotonic() - t0
        refused = error_in(reply.data)
        assert refused is not None, reply.data
        assert (refused.error.status, refused.error.code) == (400, "validation_error")
        assert "video_id" in refused.error.detail or body == b"not json"  # it names what is wrong
        assert elapsed < ENCODE_STATUS_TIMEOUT_S, f"{body!r} answered after {elapsed:.3f} s, past the api's wait"
        with pytest.raises(ValidationError):  # what the api's GET catches: it shows its own projection instead
            ProcessingStatus.model_validate_json(reply.data)
    assert (await status(nc, str(uuid.uuid4()))).found is False  # and a good request is answered as before


async def test_encode_reads_a_refused_offer_as_neither_accepted_nor_busy(prepared: CommonSettings, nc: NATS) -> None:
    """A worker that refuses an offer (`{"error": ...}`) did not take it, and did not say busy: with every other
    worker busy, the answer is unreachable (the deadline keeps running), and not in doubt (it is known not taken)."""
    settings = EncodeSettings(nats_url=prepared.nats_url, nats_nkey_seed_dir=prepared.nats_nkey_seed_dir,
                              nats_identity=prepared.nats_identity)
    broker = make_broker(settings, name="encode-test")
    await broker.connect()
    busy, refusing = uuid.uuid4().hex, uuid.uuid4().hex

    async def answer_busy(msg: Msg) -> None:
        await msg.respond(OfferAnswer(accepted=False, worker="busy-1", instance=busy, reason="full")
                          .model_dump_json().encode())

    async def refuse(msg: Msg) -> None:
        await msg.respond(error_reply(400, "validation_error", "output: must be greater than 0")
                          .model_dump_json().encode())

    subs = [await nc.subscribe(offer_subject(busy), cb=answer_busy),
            await nc.subscribe(offer_subject(refusing), cb=refuse)]
    await subscriptions_in_place(nc)
    try:
        registry = Registry(settings.media_heartbeat_timeout_seconds, settings.large_output_height)
        farm = Farm.declare(broker, registry, settings.dispatch_answer_timeout_ms / 1000)
        offer = Offer(video_id=str(uuid.uuid4()), output=360, attempt=1, job_class="developer", object_key="k")
        now = datetime.now(UTC)
        registry.heard(Heartbeat(worker="busy-1", instance=busy, slots=2, sent_at=now))
        assert (await farm.offer(offer)).kind == AnswerKind.BUSY  # the control: a busy answer alone is busy
        registry.heard(Heartbeat(worker="refusing-1", instance=refusing, slots=2, sent_at=now))
        t0 = time.monotonic()
        answer = await farm.offer(offer)
        assert answer.kind == AnswerKind.UNREACHABLE and not answer.in_doubt and answer.busy_workers == ("busy-1",)
        assert time.monotonic() - t0 < settings.dispatch_answer_timeout_ms / 1000  # read at once, no timeout
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await broker.stop()


async def test_a_result_from_a_newer_worker_is_read_and_an_unknown_outcome_counts_as_a_failure(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, sources: dict[Source, Path]
) -> None:
    farm.start("encode", **fast_farm())
    async with FakeWorker(nc) as worker:
        video_id = await announce(prepared, nc, sources[SHORT_240], height=240)
        job = await wait_for(lambda: worker.running.get((video_id, 240)), 10, "the fake worker to take 240p")
        result = OutputResult(video_id=video_id, output=240, attempt=job.attempt, worker=worker.name,
                              instance=worker.instance, outcome=Outcome.COMPLETED, finished_at=datetime.now(UTC))
        newer = {**result.model_dump(mode="json"), "outcome": "transcoded_elsewhere", "gpu_seconds": 3}
        reply = await nc.request(RESULT_SUBJECT, json.dumps(newer).encode(), timeout=5)
        assert ResultAck.model_validate_json(reply.data) == ResultAck(recorded=True, applied=True), reply.data
        failed_output = await wait_for(
            lambda: [e.data for e in events.of(video_id, "encode.failed") if e.data.get("output") == 240], 10,
            "encode.failed of 240p")
        assert failed_output[0]["worker"] == worker.name
        _, outputs = await encode_rows(prepared, video_id)
        assert outputs[0]["failures"] == 1  # a failure counted towards output_max_failures, offered again
