"""`weir trace`'s pure parts (weir/trace.py): OTLP JSON lines -> spans -> a video's trees -> text and JSON."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from shared import tracing
from tests.spans import Kept
from weir import trace as traces

MS = 1_000_000
T0 = 1_796_000_000_000_000_000


def journey_lines() -> tuple[list[str], str, str]:
    """Trace files of a small journey: the create (its own trace), the completion across api, encode and media, an
    unrelated request, and a replay that links to the completion's trace. Returns the lines (one per service) and the
    completion's and replay's trace ids."""
    kept = Kept()
    providers = {name: TracerProvider(resource=Resource.create({"service.name": name}))
                 for name in ("api", "encode", "media")}
    for provider in providers.values():
        provider.add_span_processor(SimpleSpanProcessor(kept))
    api, encode, media = (providers[n].get_tracer("weir") for n in ("api", "encode", "media"))

    def at(ms: float) -> int:
        return T0 + int(ms * MS)

    create = api.start_span("POST /v1/videos", kind=SpanKind.SERVER, start_time=at(0),
                            attributes={"weir.video_id": "v1"})
    create.end(at(20))
    complete = api.start_span("POST /v1/videos/{video_id}/upload/complete", kind=SpanKind.SERVER, start_time=at(100),
                              attributes={"weir.video_id": "v1"})
    in_complete = otel.set_span_in_context(complete)
    query = api.start_span("UPDATE", kind=SpanKind.CLIENT, context=in_complete, start_time=at(101),
                           attributes={"db.system": "postgresql"})
    query.end(at(102))
    complete.end(at(110))
    relay = api.start_span("outbox relay upload.completed", context=in_complete, start_time=at(112),
                           attributes={"weir.video_id": "v1"})
    marker = api.start_span("upload.completed create", context=otel.set_span_in_context(relay), start_time=at(113))
    marker.end(at(113))
    handled = encode.start_span("upload.completed process", context=otel.set_span_in_context(marker),
                                kind=SpanKind.CONSUMER, start_time=at(120), attributes={"weir.video_id": "v1"})
    handled.end(at(130))
    relay.end(at(115))
    job = media.start_span("media job 360p", context=otel.set_span_in_context(handled), start_time=at(150),
                           attributes={"weir.video_id": "v1", "weir.outcome": "failed"})
    job.set_status(Status(StatusCode.ERROR, "ffmpeg_failed"))
    job.end(at(2150))
    other = api.start_span("POST /v1/videos", kind=SpanKind.SERVER, start_time=at(5),
                           attributes={"weir.video_id": "v2"})
    other.end(at(6))
    replay = encode.start_span("upload.completed process", kind=SpanKind.CONSUMER, start_time=at(9000),
                               links=[Link(complete.get_span_context(), {"weir.replayed_from": "x"})],
                               attributes={"weir.video_id": "v1", "weir.replayed": True})
    replay.end(at(9001))
    by_service: dict[str, list[ReadableSpan]] = {}
    for span in kept.spans:
        by_service.setdefault(span.resource.attributes["service.name"], []).append(span)  # type: ignore[arg-type]
    lines = [json.dumps(tracing.otlp_json(spans)) for spans in by_service.values()]
    return lines, f"{complete.get_span_context().trace_id:032x}", f"{replay.get_span_context().trace_id:032x}"


def test_a_videos_traces_are_found_whole_and_in_the_order_they_began() -> None:
    lines, completion, replayed = journey_lines()
    spans = traces.parse_lines([*lines, "", "{not json", '{"partial": '])  # a file being written: skipped
    assert len(spans) == 9
    trees = traces.journey(spans, "v1")
    assert [t.trace_id for t in trees][1:] == [completion, replayed]
    create, upload, replay = trees
    assert [r.span.name for r in create.roots] == ["POST /v1/videos"]
    assert upload.services == ["api", "encode", "media"]
    (root,) = upload.roots
    # the query and FastStream's create marker are left out; the consumer hangs under the relay
    assert [c.span.name for c in root.children] == ["outbox relay upload.completed"]
    (relay,) = root.children
    assert [c.span.name for c in relay.children] == ["upload.completed process"]
    assert [c.span.name for c in relay.children[0].children] == ["media job 360p"]
    assert replay.roots[0].span.links[0].trace_id == completion
    assert traces.journey(spans, "nope") == []


def test_everything_shows_the_queries_and_plumbing_too() -> None:
    lines, completion, _ = journey_lines()
    trees = traces.journey(traces.parse_lines(lines), "v1", everything=True)
    upload = next(t for t in trees if t.trace_id == completion)
    names = sorted(s.name for s in upload.spans())
    assert "UPDATE" in names and "upload.completed create" in names


def test_the_drawing_shows_each_span_with_its_service_offset_and_duration() -> None:
    lines, completion, replayed = journey_lines()
    text = traces.render(traces.journey(traces.parse_lines(lines), "v1"), "v1")
    assert text.splitlines()[0] == "video v1: 3 traces"
    assert f"trace {completion}" in text and "[api, encode, media]" in text
    assert "POST /v1/videos/{video_id}/upload/complete  api  +0.0 ms  10 ms" in text
    assert "└─ outbox relay upload.completed  api  +12 ms  3.0 ms" in text
    assert "upload.completed process  encode  +20 ms  10 ms" in text
    assert "media job 360p  media  +50 ms  2.00 s  ✗ ffmpeg_failed" in text
    assert f"↪ link to trace {completion}" in text and "(replayed from)" in text
    order = [text.index(s) for s in ("POST /v1/videos  api", "upload/complete", "outbox relay", "media job",
                                      f"trace {replayed}")]
    assert order == sorted(order)
    assert traces.render([], "v9") == "no spans of video v9"


def test_the_json_form_nests_the_same_trees() -> None:
    lines, completion, _ = journey_lines()
    doc = traces.as_json(traces.journey(traces.parse_lines(lines), "v1"), "v1")
    json.dumps(doc)  # serialisable
    upload = next(t for t in doc["traces"] if t["trace_id"] == completion)
    (root,) = upload["spans"]
    relay = root["children"][0]
    job = relay["children"][0]["children"][0]
    assert (job["name"], job["service"], job["status"], job["offset_ms"], job["duration_ms"]) == (
        "media job 360p", "media", "error", 50.0, 2000.0)
    assert job["attributes"] == {"weir.video_id": "v1", "weir.outcome": "failed"}


def test_ids_are_read_in_hex_and_in_protobufs_base64() -> None:
    trace_id, span_id = bytes(range(1, 17)), bytes(range(1, 9))
    line = json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "api"}}]},
        "scopeSpans": [{"spans": [
            {"traceId": base64.b64encode(trace_id).decode(), "spanId": base64.b64encode(span_id).decode(),
             "name": "GET /x", "kind": "SPAN_KIND_SERVER", "startTimeUnixNano": "1", "endTimeUnixNano": "3000001",
             "status": {"code": "STATUS_CODE_ERROR"},
             "attributes": [{"key": "weir.video_id", "value": {"stringValue": "v1"}},
                            {"key": "n", "value": {"intValue": "7"}}, {"key": "ok", "value": {"boolValue": True}},
                            {"key": "l", "value": {"arrayValue": {"values": [{"doubleValue": 0.5}]}}}]},
            {"traceId": trace_id.hex(), "spanId": "00" * 7 + "09", "parentSpanId": span_id.hex(), "name": "child",
             "kind": 3},
            {"traceId": "not-an-id", "spanId": "x", "name": "dropped"},
        ]}]}]})
    spans = traces.parse_lines([line])
    assert [(s.trace_id, s.span_id, s.parent_id) for s in spans] == [
        (trace_id.hex(), span_id.hex(), None), (trace_id.hex(), "0000000000000009", span_id.hex())]
    first = spans[0]
    assert (first.kind, first.status, first.duration_ms, first.service) == ("server", "error", 3.0, "api")
    assert first.attributes == {"weir.video_id": "v1", "n": 7, "ok": True, "l": [0.5]}
    assert spans[1].kind == "client"


def test_reading_a_directory_of_trace_files(tmp_path: Path) -> None:
    lines, _, _ = journey_lines()
    for i, line in enumerate(lines):
        (tmp_path / f"svc-{i}.jsonl").write_text(line + "\n")
    (tmp_path / "notes.txt").write_text("not a trace file")
    assert len(traces.read_spans(tmp_path)) == 9
    assert traces.read_spans(tmp_path / "missing") == []
