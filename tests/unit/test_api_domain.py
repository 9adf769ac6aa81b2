"""The api's pure decisions: upload rules by state, metadata limits, cursors, and the status projection."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.api import domain
from services.api.domain import Projection, UploadRefusal
from shared.events import (
    DispatchBusy,
    EncodeCompleted,
    EncodeFailed,
    EncodeProgress,
    EncodeStarted,
    Event,
    EventData,
    new_event,
)
from shared.media.playback import Artwork
from shared.videos import VideoStatus as Status

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("recorded", [False, True])
def test_initiate_refusal_by_state(status: Status, recorded: bool) -> None:
    refusal = domain.initiate_refusal(status, recorded)
    if status in (Status.RETIRED, Status.DELETED):
        assert refusal is UploadRefusal.GONE  # retired or deleted answers 409 whatever else holds
    elif recorded or status not in (Status.CREATED, Status.UPLOADING):
        assert refusal is UploadRefusal.HAS_FILE
    else:
        assert refusal is None


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("upload_id", [None, "u1"])
def test_upload_refusal_by_state(status: Status, upload_id: str | None) -> None:
    refusal = domain.upload_refusal(status, upload_id)
    if status in (Status.RETIRED, Status.DELETED):
        assert refusal is UploadRefusal.GONE
    elif upload_id is None:
        assert refusal is UploadRefusal.NOT_OPEN
    else:
        assert refusal is None


def test_metadata_limit_is_measured_on_compact_utf8_json() -> None:
    limit = domain.METADATA_MAX_BYTES
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")))
    assert not domain.metadata_too_large({"k": "x" * (limit - overhead)})
    assert domain.metadata_too_large({"k": "x" * (limit - overhead + 1)})
    assert domain.metadata_too_large({"k": "é" * (limit // 2)})  # two bytes each in UTF-8
    assert not domain.metadata_too_large(None)


@pytest.mark.parametrize("value", ["a\x00b", {"k": "\x00"}, {"\x00": 1}, "\udb27", {"k": ["ok", "\ud800"]}])
def test_text_postgres_cannot_store_is_refused(value: object) -> None:
    assert domain.storable_text_problem(value) is not None


@pytest.mark.parametrize("value", ["plain", {"k": "ünïcødé 🎬"}, {"n": [1, 2.5, None, True]}, None])
def test_storable_text_passes(value: object) -> None:
    assert domain.storable_text_problem(value) is None


def test_cursor_round_trip_and_garbage() -> None:
    cursor = domain.Cursor(NOW, "0197a1b2-0000-7000-8000-000000000001")
    assert domain.decode_cursor(domain.encode_cursor(cursor)) == cursor
    not_an_id = domain.encode_cursor(domain.Cursor(NOW, "zzz"))  # well-formed, made by hand
    for garbage in ("", "abc", "!!!", domain.encode_cursor(cursor)[:-3], "W10", "WyJ4IiwgMV0", not_an_id):
        assert domain.decode_cursor(garbage) is None


def test_object_keys_are_per_app_and_video() -> None:
    assert domain.object_key("a", "v") == "sources/a/v"


def _start(status: Status = Status.UPLOADED) -> Projection:
    return Projection(status, None, (), None)


def _event(data: EventData, at: datetime = NOW) -> domain.EncodeEvent:
    """An encode event as the api's consumer receives it: read from the wire as the typed event."""
    wire = new_event(data, source="encode", subject="v", time=at).to_bytes()
    typed: Any = Event[type(data)]  # type: ignore[misc]
    event: domain.EncodeEvent = typed.model_validate_json(wire)
    return event


def _started(output: int, worker: str, at: datetime = NOW) -> domain.EncodeEvent:
    return _event(EncodeStarted(video_id="v", output=output, worker=worker), at)


def _completed(output: int, worker: str, size: int, remaining: int | None, at: datetime = NOW) -> domain.EncodeEvent:
    return _event(EncodeCompleted(video_id="v", output=output, worker=worker, object_key=f"r/{output}", size=size,
                                  outputs_remaining=remaining), at)


def test_projection_follows_an_encode_to_ready() -> None:
    p = domain.project(_start(), _started(360, "w1"))
    assert p.status is Status.PROCESSING and p.processing is not None
    assert domain.shown_processing(p.processing) == {
        "deadline_at": None, "busy_at": None,
        "outputs": [{"height": 360, "state": "encoding", "worker": "w1", "started_at": NOW.isoformat()}]}
    p = domain.project(p, _started(720, "w2"))
    p = domain.project(p, _completed(360, "w1", 10, 1))
    assert p.status is Status.PROCESSING and [r["height"] for r in p.renditions] == [360]
    busy_at = datetime(2026, 11, 29, 12, 0, 5, tzinfo=UTC)
    p = domain.project(p, _event(DispatchBusy(video_id="v", outputs_offered=[1080], workers_answered=["w3"],
                                              busy_at=busy_at)))
    assert p.processing is not None and p.processing["busy_at"] == "2026-11-29T12:00:05+00:00"
    p = domain.project(p, _event(EncodeProgress(video_id="v", output=720, worker="w2", progress=0.5)))
    p = domain.project(p, _completed(720, "w2", 20, 0, NOW + timedelta(seconds=1)))
    assert p.status is Status.READY
    assert [r["height"] for r in p.renditions] == [360, 720]
    assert p.renditions[1] == {"height": 720, "object_key": "r/720", "size": 20}


def test_progress_changes_nothing_shown() -> None:
    p = domain.project(_start(Status.PROCESSING), _started(360, "w1"))
    assert domain.project(p, _event(EncodeProgress(video_id="v", output=360, worker="w1", progress=0.5))) == p


def test_projection_of_a_failure_and_of_a_gone_video() -> None:
    failed = domain.project(_start(Status.PROCESSING), _event(EncodeFailed(
        video_id="v", output=None, worker=None, reason="deadline", message="Processing took too long")))
    assert failed.status is Status.FAILED and failed.failure == ("deadline", "Processing took too long")
    one_output = domain.project(_start(Status.PROCESSING), _event(EncodeFailed(
        video_id="v", output=720, worker="w1", reason="x", message="")))
    assert one_output.status is Status.PROCESSING
    assert one_output.processing is not None and one_output.processing["outputs"][0]["state"] == "failed"
    for gone in (Status.RETIRED, Status.DELETED):
        assert domain.project(_start(gone), _started(360, "w1")) == _start(gone)


def test_a_repeated_completion_keeps_one_rendition_per_height() -> None:
    p = _start(Status.PROCESSING)
    for _ in range(3):
        p = domain.project(p, _completed(360, "w1", 1, None))
    assert len(p.renditions) == 1


@pytest.mark.parametrize("status", list(Status))
def test_a_rebuild_starts_a_video_where_it_was_before_encodes_first_event(status: Status) -> None:
    base = domain.rebuild_base(status)
    if status in (Status.RETIRED, Status.DELETED):
        assert base is None  # gone: no event changes it, nothing to rebuild
    elif status in (Status.CREATED, Status.UPLOADING, Status.UPLOADED):
        assert base == Projection(status, None, (), None, None)
    else:  # processing, ready, failed: what encode's events made of an uploaded video
        assert base == Projection(Status.UPLOADED, None, (), None, None)


def test_a_rebuilt_projection_is_the_live_one() -> None:
    events = [_started(360, "w1"), _started(720, "w2"), _completed(360, "w1", 10, 1), _completed(720, "w2", 20, 0)]
    live = _start()
    for event in events:
        live = domain.project(live, event)
    base = domain.rebuild_base(Status.READY)
    assert base is not None and domain.rebuilt(base, events) == live


def _failed(output: int | None, worker: str | None, at: datetime) -> domain.EncodeEvent:
    return _event(EncodeFailed(video_id="v", output=output, worker=worker, reason="x", message="m"), at)


def _busy(at: datetime) -> domain.EncodeEvent:
    return _event(DispatchBusy(video_id="v", outputs_offered=[720], workers_answered=["w3"], busy_at=at), at)


def _art_completed(output: int, remaining: int, at: datetime) -> domain.EncodeEvent:
    artwork = Artwork(poster_key="a/poster.jpg", poster_time=1.0, poster_width=320, poster_height=180,
                      sprite_key="a/sprite.jpg", storyboard_key="a/storyboard.vtt", tile_width=80, tile_height=45,
                      tiles=4, interval=1.0, duration=4.0)
    return _event(EncodeCompleted(video_id="v", output=output, worker="w1", object_key=f"r/{output}", size=1,
                                  outputs_remaining=remaining, artwork=artwork), at)


def _at(second: int) -> datetime:
    return NOW + timedelta(seconds=second)


# An encode as it happens: 360 fails once and is offered again; the farm is busy a moment; 360 carries the artwork;
# the started and completed of an adopted job share their time (the tie goes to done).
AN_ENCODE = [_started(360, "w1", _at(0)), _started(720, "w2", _at(0)), _busy(_at(1)), _failed(360, "w1", _at(2)),
             _started(360, "w3", _at(3)), _art_completed(360, 1, _at(4)), _started(720, "w4", _at(5)),
             _completed(720, "w4", 2, 0, _at(5))]
A_FAILED_ENCODE = [_started(360, "w1", _at(0)), _completed(360, "w1", 1, 1, _at(1)), _started(720, "w2", _at(1)),
                   _failed(720, "w2", _at(2)), _failed(None, None, _at(3)), _busy(_at(2))]


@pytest.mark.parametrize("events", [AN_ENCODE, A_FAILED_ENCODE], ids=["ready", "failed"])
def test_the_projection_ends_the_same_whatever_order_the_events_come_in(events: list[domain.EncodeEvent]) -> None:
    """Several api instances share the status durable and replays come late: every order of one video's events
    (each once, or one of them twice) gives what the order they happened in gives."""
    def fold(order: Iterable[domain.EncodeEvent]) -> Projection:
        p = _start()
        for event in order:
            p = domain.project(p, event)
        return p

    expected = fold(events)
    orders = 0
    for order in itertools.permutations(events):
        assert fold(order) == expected, [e.data for e in order]
        orders += 1
    assert orders == math.factorial(len(events))
    for i, again in enumerate(events):  # a redelivery after the rest
        assert fold([*events, again]) == expected, i


def test_the_projection_of_an_encode_shows_its_last_events() -> None:
    """What the order-free fold of AN_ENCODE comes to, as the API shows it."""
    p = _start()
    for event in AN_ENCODE:
        p = domain.project(p, event)
    assert p.status is Status.READY and p.artwork is not None and [r["height"] for r in p.renditions] == [360, 720]
    assert domain.shown_processing(p.processing) == {"deadline_at": None, "busy_at": _at(1).isoformat(), "outputs": [
        {"height": 360, "state": "done", "worker": "w1", "started_at": _at(3).isoformat()},
        {"height": 720, "state": "done", "worker": "w4", "started_at": _at(5).isoformat()}]}


# --- what the api announces of a projection's change (video.ready, video.failed) ------------------------------------

IDS = ("0197a1b2-0000-7000-8000-00000000000a", "app-1", "acc-1")


def _hls(height: int, width: int, duration: float) -> dict[str, Any]:
    return {"playlist_key": f"k/{height}/index.m3u8", "bandwidth": 1, "average_bandwidth": 1, "codecs": "avc1",
            "width": width, "height": height, "segments": 1, "duration": duration}


@pytest.mark.parametrize(("before", "after"), list(itertools.product(Status, Status)))
def test_only_an_arrival_at_ready_or_failed_is_announced(before: Status, after: Status) -> None:
    announced = domain.outcome(*IDS, Projection(before, None, (), None), Projection(after, None, (), None))
    if before == after or after not in (Status.READY, Status.FAILED):
        assert announced is None
    else:
        assert announced is not None and announced.event_type == f"video.{after.value}"


def test_ready_says_what_plays() -> None:
    renditions = ({"height": 720, "hls": _hls(720, 1280, 12.5)}, {"height": 360, "hls": _hls(360, 640, 12.4)},
                  {"height": 1080})  # a rendition without HLS (an older encode's) counts among the outputs only
    ready = domain.outcome(*IDS, Projection(Status.PROCESSING, None, (), None),
                           Projection(Status.READY, None, renditions, None))
    assert ready is not None and ready.model_dump() == {
        "video_id": IDS[0], "app_id": IDS[1], "account_id": IDS[2], "outputs": [360, 720, 1080],
        "duration_seconds": 12.5, "max_width": 1280, "max_height": 720}
    bare = domain.outcome(*IDS, Projection(Status.PROCESSING, None, (), None),
                          Projection(Status.READY, None, ({"height": 360},), None))
    assert bare is not None and bare.model_dump()["duration_seconds"] is None


def test_failed_says_why() -> None:
    failed = domain.outcome(*IDS, Projection(Status.PROCESSING, None, (), None),
                            Projection(Status.FAILED, None, (), ("deadline", "Processing took too long")))
    assert failed is not None and (failed.reason, failed.message) == ("deadline", "Processing took too long")


# ------------------------------------------------------------------------------------------------ idempotency keys


@pytest.mark.parametrize(("key", "fine"), [
    ("a", True), ("0190c3e2-7b1a-7cc0-8f00-3b7f4d0e2a11", True), ("order:1234/retry", True),
    ("x" * domain.IDEMPOTENCY_KEY_MAX, True), ("~!@#$%^&*()_+{}|:<>?", True),
    ("", False), ("x" * (domain.IDEMPOTENCY_KEY_MAX + 1), False), ("a b", False), ("a\tb", False),
    ("café", False), ("a\x7fb", False), ("a\nb", False),
])
def test_an_idempotency_key_is_printable_ascii_of_1_to_255(key: str, fine: bool) -> None:
    assert (domain.idempotency_key_problem(key) is None) is fine


def test_a_requests_fingerprint_is_what_it_asked_whatever_the_order() -> None:
    asked = {"name": "clip", "metadata": {"a": 1, "b": [1, 2]}, "playback_policy": "public"}
    same = {"playback_policy": "public", "metadata": {"b": [1, 2], "a": 1}, "name": "clip"}
    assert domain.request_fingerprint(asked) == domain.request_fingerprint(same)
    for changed in ({**asked, "name": "clip2"}, {**asked, "metadata": None}, {**asked, "metadata": {"a": 2}},
                    {**asked, "playback_policy": "signed"}, {**asked, "metadata": {"a": 1, "b": [2, 1]}}):
        assert domain.request_fingerprint(changed) != domain.request_fingerprint(asked), changed
    assert len(domain.request_fingerprint(asked)) == 64
