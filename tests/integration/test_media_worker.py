"""A media worker as a process on the session's real NATS, PostgreSQL and S3, with real ffmpeg; the test plays encode.

It sends offers on the worker's subject, answers its results on `farm.result`, and reads its heartbeats.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from shared.bus import connect
from shared.events import Envelope
from shared.media.content import syncsafe
from shared.media.protocol import (
    HEARTBEAT_SUBJECT,
    RESULT_SUBJECT,
    Cancel,
    Heartbeat,
    JobKey,
    Offer,
    OfferAnswer,
    OutputResult,
    ResultAck,
    cancel_subject,
    offer_subject,
)
from shared.messaging import error_in, error_reply
from shared.settings import CommonSettings
from tests.integration.test_encode_helpers import (
    Procs,
    Source,
    clean_encode_state,
    decode,
    fast_farm,
    get_object,
    make_sources,
    processes,
    put_object,
    stream_info,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SMALL = Source(240, 1)
CLIP = Source(720, 1)
HOLD = Source(240, 20, fps=5)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[Source, Path]:
    return make_sources(tmp_path_factory.mktemp("worker-sources"), SMALL, CLIP, HOLD)


@pytest.fixture(scope="module")
async def stored(sources: dict[Source, Path], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, str]:
    """The sources in S3; and the 720p clip behind two ID3v2 tags (a file some tools tag like an MP3)."""
    keys = {}
    for name, source in (("small", SMALL), ("clip", CLIP), ("hold", HOLD)):
        keys[name] = f"sources/worker-test/{uuid.uuid4()}-{name}"
        await put_object(prepared, keys[name], sources[source])
    tagged = tmp_path_factory.mktemp("tagged") / "id3.mp4"
    tags = b"ID3\x04\x00\x00" + syncsafe(1000) + b"\x00" * 1000 + b"ID3\x03\x00\x00" + syncsafe(333) + b"\x00" * 333
    tagged.write_bytes(tags + sources[CLIP].read_bytes())
    keys["tagged"] = f"sources/worker-test/{uuid.uuid4()}-tagged"
    await put_object(prepared, keys["tagged"], tagged)
    return keys


@dataclass
class Encode:
    """The test in encode's place: results answered (or not), heartbeats and progress kept."""

    nc: NATS
    _results_sub: Any = None
    offered: dict[tuple[str, int], Offer] = field(default_factory=dict)
    results: list[OutputResult] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    progress: list[Envelope] = field(default_factory=list)
    progress_headers: list[dict[str, str]] = field(default_factory=list)  # each progress message's, in order
    refuse: set[str] = field(default_factory=set)  # videos whose results it refuses (`{"error": ...}`)
    refused: list[OutputResult] = field(default_factory=list)

    async def answer_results(self, on: bool) -> None:
        """Encode up (answering `farm.result`) or down (nobody listens: the worker keeps its results)."""
        if on and self._results_sub is None:
            self._results_sub = await self.nc.subscribe(RESULT_SUBJECT, cb=self.on_result)
        elif not on and self._results_sub is not None:
            await self._results_sub.unsubscribe()
            self._results_sub = None

    async def on_result(self, msg: Msg) -> None:
        result = OutputResult.model_validate_json(msg.data)
        if result.video_id in self.refuse:
            self.refused.append(result)
            await msg.respond(error_reply(400, "validation_error", "refused by the test").model_dump_json().encode())
            return
        self.results.append(result)
        await msg.respond(ResultAck(recorded=True, applied=True).model_dump_json().encode())

    async def on_heartbeat(self, msg: Msg) -> None:
        self.heartbeats.append(Heartbeat.model_validate_json(msg.data))

    async def on_progress(self, msg: Msg) -> None:
        self.progress.append(Envelope.from_bytes(msg.data))
        self.progress_headers.append(dict(msg.headers or {}))

    async def instance_of(self, name: str) -> str:
        hb = await wait_for(lambda: next((h for h in self.heartbeats if h.worker == name), None), 10,
                            f"a heartbeat from {name}")
        return hb.instance

    def last_heartbeat(self, instance: str) -> Heartbeat | None:
        return next((h for h in reversed(self.heartbeats) if h.instance == instance), None)

    async def offer(self, instance: str, key: str, height: int, job_class: str = "developer",
                    nc: NATS | None = None, account_id: str | None = None,
                    headers: dict[str, str] | None = None) -> OfferAnswer:
        offer = Offer(video_id=str(uuid.uuid4()), output=height, attempt=1, job_class=job_class,  # type: ignore[arg-type]
                      object_key=key, account_id=account_id)
        reply = await (nc or self.nc).request(offer_subject(instance), offer.model_dump_json().encode(), timeout=5,
                                              headers=headers)
        answer = OfferAnswer.model_validate_json(reply.data)
        if answer.accepted:
            self.offered[(offer.video_id, height)] = offer
        return answer

    async def cancel_all(self, instance: str) -> None:
        """Cancel every accepted job, and wait for a heartbeat sent since that shows the worker empty."""
        jobs = [JobKey(video_id=o.video_id, output=o.output, attempt=o.attempt) for o in self.offered.values()]
        self.offered.clear()
        seen = len(self.heartbeats)
        await self.nc.publish(cancel_subject(instance), Cancel(jobs=jobs).model_dump_json().encode())
        await wait_for(lambda: any(h.instance == instance and not h.running for h in self.heartbeats[seen:]), 10,
                       "the worker to be empty")


@pytest.fixture
async def encode(nc: NATS, prepared: CommonSettings) -> AsyncIterator[Encode]:
    await clean_encode_state(prepared)  # no undelivered result of an earlier test comes here
    e = Encode(nc)
    await e.answer_results(True)
    subs = [await nc.subscribe(HEARTBEAT_SUBJECT, cb=e.on_heartbeat),
            await nc.subscribe("encode.progress", cb=e.on_progress),  # an offer without its account
            await nc.subscribe("encode.progress.*", cb=e.on_progress)]  # and with it
    yield e
    await e.answer_results(False)
    for s in subs:
        await s.unsubscribe()


@pytest.fixture
def farm(stack_env: dict[str, str], tmp_path: Path) -> Iterator[Procs]:
    with processes(stack_env, tmp_path) as procs:
        yield procs


# ------------------------------------------------------------------------------------------------------ tests


async def test_a_worker_encodes_at_the_output_height_never_above_the_source_with_progress_and_a_result(
    farm: Procs, encode: Encode, stored: dict[str, str], prepared: CommonSettings, tmp_path: Path
) -> None:
    farm.start("media-1", **fast_farm(media_slots=3))
    instance = await encode.instance_of("media-1")
    # a 720p output of a 240p source stays 240p; a 360p output of a 720p source behind ID3 tags (read through subfile)
    assert (await encode.offer(instance, stored["small"], 720)).accepted
    assert (await encode.offer(instance, stored["tagged"], 360, "first_party")).accepted
    await wait_for(lambda: len(encode.results) >= 2, 30, "both results")
    by_height = {r.output: r for r in encode.results}
    for height, expected_size in ((720, "426x240"), (360, "640x360")):
        result = by_height[height]
        assert result.outcome == "completed" and result.worker == "media-1" and result.instance == instance
        assert result.object_key == f"renditions/{result.video_id}/{height}p-1.mp4"
        local = await get_object(prepared, result.object_key, tmp_path / f"{height}.mp4")
        assert local.stat().st_size == result.size
        assert decode(local) == (0, ""), "ffmpeg decodes every frame"
        info = stream_info(local)
        assert "Video: h264" in info and "Audio: aac" in info and expected_size in info, info
    def progress() -> list[float]:
        return [e.data["progress"] for e in encode.progress if e.data["video_id"] == by_height[360].video_id]

    await wait_for(lambda: 1.0 in progress(), 5, "the last progress event")
    assert progress() == sorted(progress()) and all(0 <= p <= 1 for p in progress())
    conn = await asyncpg.connect(prepared.database_url)
    try:
        rows = await conn.fetch("SELECT delivered_at FROM media.results WHERE video_id = ANY($1::text[])",
                                [r.video_id for r in encode.results])
    finally:
        await conn.close()
    assert len(rows) == 2 and all(r["delivered_at"] is not None for r in rows)


async def test_progress_is_published_in_the_trace_of_its_job(
    farm: Procs, encode: Encode, stored: dict[str, str], tmp_path: Path
) -> None:
    """With tracing on, each encode.progress (a hint sent straight to its stream, not from an outbox) carries its
    job's trace context, as media's results and the events from encode's outbox carry theirs: in the envelope's
    `traceparent` and in its header, on the account's subject and on the legacy copy."""
    [media] = farm.start("media-1", **fast_farm(media_slots=2, events_legacy_subjects=True),
                         traces_dir=str(tmp_path / "traces"))
    async with httpx.AsyncClient() as http:  # what the running worker's document says of it
        channels = (await http.get(f"{media.url}/asyncapi.json")).raise_for_status().json()["channels"]
    for channel in ("encode.progress", "encode.progress:copy"):
        assert "A hint, published by its publisher straight into stream ENCODE" in channels[channel]["description"]
        assert "from its publisher's outbox" not in channels[channel]["description"]
    instance = await encode.instance_of("media-1")
    trace_id = uuid.uuid4().hex  # encode's dispatch round, which the offer's headers carry
    offered = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    assert (await encode.offer(instance, stored["small"], 240, account_id="acme1",
                                headers={"traceparent": offered})).accepted
    (video_id,) = [v for v, _ in encode.offered]

    def progress() -> list[tuple[Envelope, dict[str, str]]]:
        return [(e, h) for e, h in zip(encode.progress, encode.progress_headers, strict=True)
                if e.data["video_id"] == video_id]

    await wait_for(lambda: sum(e.data["progress"] == 1.0 for e, _ in progress()) == 2, 30,
                   "the last progress event, on both subjects")
    copies = [h.get("Weir-Legacy-Copy") for _, h in progress()]
    assert copies.count("1") == copies.count(None) > 0
    for event, headers in progress():
        assert event.traceparent is not None and event.traceparent.split("-")[1] == trace_id, event.traceparent
        assert event.traceparent != offered  # the job's own span, a child in the offer's trace
        assert headers.get("traceparent") == event.traceparent, headers
    assert len({event.traceparent for event, _ in progress()}) == 1  # one job, one span


@pytest.mark.parametrize("large", [CommonSettings().large_output_height, 720])
async def test_the_reserved_slot_and_one_large_developer_output_per_worker(
    farm: Procs, encode: Encode, stored: dict[str, str], large: int
) -> None:
    # 3 slots: developer jobs fill at most 2; one large developer output at a time (large_output_height and up, the
    # default and a lower one); jobs held at real time (20 s)
    farm.start("media-1", **fast_farm(media_slots=3, media_read_rate=1, large_output_height=large))
    instance = await encode.instance_of("media-1")
    hold, small = stored["hold"], large // 4
    answers = [
        (await encode.offer(instance, hold, large)).accepted,
        (await encode.offer(instance, hold, large * 2)).reason,  # a second large developer output
        (await encode.offer(instance, hold, small)).accepted,
        (await encode.offer(instance, hold, small * 2)).reason,  # developer jobs fill slots - 1
        (await encode.offer(instance, hold, large * 2, "first_party")).accepted,  # the kept slot, large or not
        (await encode.offer(instance, hold, small, "first_party")).reason,  # every slot taken
    ]
    assert answers == [True, "large_running", True, "reserved", True, "full"]
    hb = await wait_for(lambda: (h := encode.last_heartbeat(instance)) and len(h.running) == 3 and h, 5,
                        "a heartbeat with three jobs")
    assert sorted((j.job_class, j.output) for j in hb.running) == [
        ("developer", small), ("developer", large), ("first_party", large * 2)]
    await encode.cancel_all(instance)
    assert (await encode.offer(instance, hold, large * 2)).accepted  # cancelled jobs free their slots at once


async def test_an_offer_from_a_newer_encode_is_read_and_an_unknown_job_class_is_a_developer_job(
    farm: Procs, encode: Encode, stored: dict[str, str], nc: NATS
) -> None:
    farm.start("media-1", **fast_farm(media_slots=2, media_read_rate=1))  # one developer slot, one kept
    instance = await encode.instance_of("media-1")
    offer = Offer(video_id=str(uuid.uuid4()), output=240, attempt=1, job_class="first_party", object_key=stored["hold"])
    newer = {**offer.model_dump(mode="json"), "job_class": "vip", "priority": 9, "hints": {"gpu": True}}
    reply = await nc.request(offer_subject(instance), json.dumps(newer).encode(), timeout=5)
    assert OfferAnswer.model_validate_json(reply.data).accepted, reply.data
    encode.offered[(offer.video_id, offer.output)] = offer
    hb = await wait_for(lambda: (h := encode.last_heartbeat(instance)) and h.running and h, 5, "a heartbeat")
    assert [j.job_class for j in hb.running] == ["developer"]  # it holds the developer slot, not the kept one
    assert (await encode.offer(instance, stored["hold"], 240)).reason == "reserved"
    assert (await encode.offer(instance, stored["hold"], 240, "first_party")).accepted
    await encode.cancel_all(instance)


async def test_two_dispatchers_racing_for_the_last_slot_cannot_both_get_it(
    farm: Procs, encode: Encode, stored: dict[str, str], prepared: CommonSettings
) -> None:
    farm.start("media-1", **fast_farm(media_slots=2, media_read_rate=1))
    instance = await encode.instance_of("media-1")
    others = [await connect(prepared, name="test") for _ in range(4)]  # four dispatchers, four connections

    async def race(job_class: str) -> list[OfferAnswer]:
        return list(await asyncio.gather(*(encode.offer(instance, stored["hold"], 360, job_class, nc=c)
                                           for c in others)))

    try:
        for _ in range(3):  # 2 slots: the one developer slot
            answers = await race("developer")
            assert sum(a.accepted for a in answers) == 1, answers
            assert {a.reason for a in answers if not a.accepted} == {"reserved"}
            await encode.cancel_all(instance)
        assert (await encode.offer(instance, stored["hold"], 360)).accepted
        answers = await race("first_party")  # the kept slot, the last one free
        assert sum(a.accepted for a in answers) == 1, answers
        assert {a.reason for a in answers if not a.accepted} == {"full"}
    finally:
        for c in others:
            await c.close()


async def test_sigterm_stops_taking_offers_and_hands_back_unfinished_outputs(
    farm: Procs, encode: Encode, stored: dict[str, str], nc: NATS
) -> None:
    [worker] = farm.start("media-1", **fast_farm(media_slots=2, media_read_rate=1, media_drain_seconds=0.5))
    instance = await encode.instance_of("media-1")
    assert (await encode.offer(instance, stored["hold"], 360)).accepted
    await wait_for(lambda: (h := encode.last_heartbeat(instance)) and h.running, 5, "the job to run")
    worker.signal(signal.SIGTERM)
    await wait_for(lambda: any(h.instance == instance and h.leaving for h in encode.heartbeats), 5, "leaving")
    result = await wait_for(lambda: encode.results, 15, "the hand-back")
    assert [(r.outcome, r.reason) for r in result] == [("handed_back", "worker_stopping")]
    assert await asyncio.to_thread(worker.popen.wait, 20) == 0
    with pytest.raises(NoRespondersError):
        await nc.request(offer_subject(instance), b"{}", timeout=2)


async def test_a_result_waits_in_the_workers_table_until_encode_takes_it(
    farm: Procs, encode: Encode, stored: dict[str, str], prepared: CommonSettings
) -> None:
    await encode.answer_results(False)  # encode is down
    farm.start("media-1", **fast_farm(media_slots=2))
    instance = await encode.instance_of("media-1")
    assert (await encode.offer(instance, stored["small"], 240)).accepted
    [(video_id, _)] = encode.offered

    async def row() -> asyncpg.Record | None:
        conn = await asyncpg.connect(prepared.database_url)
        try:
            return await conn.fetchrow("SELECT payload, delivered_at FROM media.results WHERE video_id = $1",
                                       video_id)
        finally:
            await conn.close()

    waiting = await wait_for(row, 30, "the result to be recorded")
    recorded = datetime.now(UTC)
    assert waiting["delivered_at"] is None
    # the slot is free once the result cannot be lost: the first heartbeat sent after it was recorded says so (the
    # last one received when the row appears may have left before)
    hb = await wait_for(lambda: encode.last_heartbeat(instance), 10 * fast_farm()["media_heartbeat_seconds"],
                        "a heartbeat sent after the result was recorded",
                        until=lambda h: h is not None and h.sent_at >= recorded)
    assert hb is not None and hb.running == []
    await encode.answer_results(True)  # encode is back: the worker's retries deliver it
    delivered = await wait_for(lambda: encode.results, 10, "the delivery")
    assert delivered[0].video_id == video_id and delivered[0].outcome == "completed"
    assert (await wait_for(lambda: _delivered(row), 5, "delivered_at"))
    assert datetime.now(UTC) >= delivered[0].finished_at


async def _delivered(row):  # type: ignore[no-untyped-def]
    r = await row()
    return r is not None and r["delivered_at"] is not None


async def test_an_offer_that_does_not_validate_is_refused_at_once_and_takes_no_slot(
    farm: Procs, encode: Encode, stored: dict[str, str], nc: NATS
) -> None:
    settings = fast_farm(media_slots=2)
    farm.start("media-1", **settings)
    instance = await encode.instance_of("media-1")
    good = Offer(video_id=str(uuid.uuid4()), output=240, attempt=1, job_class="developer", object_key=stored["small"])
    bad = [{**good.model_dump(), "output": 0}, {**good.model_dump(), "job_class": 7},
           {k: v for k, v in good.model_dump().items() if k != "object_key"}]
    for body in [*(json.dumps(b).encode() for b in bad), b"not json"]:
        t0 = time.monotonic()
        reply = await nc.request(offer_subject(instance), body, timeout=5)  # silence would end in a timeout here
        elapsed = time.monotonic() - t0
        refused = error_in(reply.data)  # what encode's farm reads: a refusal, neither accepted nor busy
        assert refused is not None, reply.data
        assert (refused.error.status, refused.error.code) == (400, "validation_error")
        assert elapsed < settings["dispatch_answer_timeout_ms"] / 1000, f"{body!r} answered after {elapsed:.3f} s"
    hb = await wait_for(lambda: encode.last_heartbeat(instance), 5, "a heartbeat")
    assert hb.running == []  # nothing taken
    assert (await encode.offer(instance, stored["small"], 240)).accepted  # the worker takes good offers as before


async def test_a_result_encode_refuses_stays_undelivered_and_holds_back_no_other(
    farm: Procs, encode: Encode, stored: dict[str, str], prepared: CommonSettings
) -> None:
    await encode.answer_results(False)  # encode is down while both results are recorded
    farm.start("media-1", **fast_farm(media_slots=3))
    instance = await encode.instance_of("media-1")
    for _ in range(2):
        assert (await encode.offer(instance, stored["small"], 240, "first_party")).accepted
    videos = [video_id for video_id, _ in encode.offered]

    async def rows() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(prepared.database_url)
        try:
            return list(await conn.fetch("SELECT video_id, delivered_at FROM media.results WHERE video_id = ANY($1)"
                                         " ORDER BY recorded_at", videos))
        finally:
            await conn.close()

    recorded = await wait_for(lambda: _all_recorded(rows, len(videos)), 30, "both results to be recorded")
    first, second = (r["video_id"] for r in recorded)
    encode.refuse = {first}  # the result the worker tries first is refused, every time
    await encode.answer_results(True)
    await wait_for(lambda: [r for r in encode.results if r.video_id == second], 10, "the second to be delivered")
    await wait_for(lambda: len(encode.refused) >= 2, 10, "the refused one to be tried again")
    assert {r["video_id"]: r["delivered_at"] is not None for r in await rows()} == {first: False, second: True}
    assert all(r.video_id == first for r in encode.refused)


async def _all_recorded(rows, n):  # type: ignore[no-untyped-def]
    found = await rows()
    return found if len(found) == n else None
