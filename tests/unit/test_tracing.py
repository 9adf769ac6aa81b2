"""shared/tracing.py without servers: the trace files' encoding, the sampler, trace contexts, the spans a consumer
and the relay make, and the envelope's `traceparent`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as official_json
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from shared import tracing
from shared.events import Envelope, Event, UploadCompleted, new_event
from tests.spans import Kept, kept_in_memory

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kept]:
    """Tracing on for this test only, into memory (the process's global provider is left alone)."""
    yield from kept_in_memory(monkeypatch)


def upload_completed(**kw: object) -> object:
    return new_event(UploadCompleted(video_id="v1", app_id="a", account_id="c", key_id="k", object_key="o", size=1,
                                     content_type="video/mp4", source_height=None), source="api", subject="v1",
                     **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the encoding


def varied_spans() -> list[ReadableSpan]:
    """Spans with everything OTLP carries: every attribute type, events, links, statuses, kinds, remote parents,
    trace state, two resources and two scopes."""
    exporter = Kept()
    api = TracerProvider(resource=Resource.create({"service.name": "api", "weir.n": 3}))
    encode = TracerProvider(resource=Resource({"service.name": "encode"}, schema_url="https://example.com/s"))
    for provider in (api, encode):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    weir_tracer = api.get_tracer("weir", "1.0", schema_url="https://opentelemetry.io/schemas/1.11.0")
    other = api.get_tracer("other")
    remote = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "x")]))
    with weir_tracer.start_as_current_span("POST /v1/videos", kind=SpanKind.SERVER, attributes={
        "s": "text", "b": True, "i": 42, "big": 2**62, "f": 1.5, "nan": math.nan, "inf": -math.inf, "neg": -3,
        "list": ["a", "b"], "ints": [1, 2], "bools": [True, False], "floats": [0.25], "empty": "",
    }) as root:
        root.add_event("checked", {"outcome": "allowed", "n": 1})
        root.add_event("bare")
        root.set_status(Status(StatusCode.OK))
        with other.start_as_current_span("INSERT", kind=SpanKind.CLIENT, attributes={"db.system": "postgresql"}):
            pass
        failing = weir_tracer.start_span("outbox relay upload.completed", kind=SpanKind.PRODUCER,
                                         links=[Link(remote, {"weir.replayed_from": "x"}), Link(remote)])
        failing.set_status(Status(StatusCode.ERROR, "no PubAck within 5.0 s"))
        failing.end()
    child = encode.get_tracer("weir").start_span(
        "upload.completed process", kind=SpanKind.CONSUMER,
        context=trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    child.end()
    return exporter.spans


def test_the_trace_files_encoding_is_opentelemetrys_otlp_json() -> None:
    spans = varied_spans()
    assert len(spans) == 4
    assert tracing.otlp_json(spans) == official_json(spans).to_dict()
    assert tracing.otlp_json([]) == official_json([]).to_dict()


def test_the_exporter_writes_one_request_a_line(tmp_path: Path) -> None:
    exporter = tracing.OtlpJsonLines(tmp_path / "traces" / "api-1.jsonl")
    spans = varied_spans()
    assert exporter.export(spans[:2]) is SpanExportResult.SUCCESS
    assert exporter.export(spans[2:]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    lines = (tmp_path / "traces" / "api-1.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [official_json(spans[:2]).to_dict(),
                                                     official_json(spans[2:]).to_dict()]
    assert exporter.export(spans) is SpanExportResult.FAILURE  # closed


def test_tracing_is_on_with_an_otlp_endpoint_or_a_traces_directory_and_off_otherwise() -> None:
    assert tracing.exporter_choice({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "/tmp/t") == "otlp"
    assert tracing.exporter_choice({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "") == "otlp"
    assert tracing.exporter_choice({}, ".weir/traces") == "files"
    assert tracing.exporter_choice({}, "") is None
    assert tracing.setup("test", "", environ={}) is False and not tracing.enabled()
    assert tracing.trace_file(".weir/traces", "encode", pid=7) == Path(".weir/traces/encode-7.jsonl")


# ------------------------------------------------------------------------------------------------- the sampler


def sample(name: str, *, parent: SpanContext | None = None, **attributes: object) -> Decision:
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
    return tracing.WeirSampler().should_sample(context, 1, name, SpanKind.INTERNAL, attributes or None).decision


def test_the_sampler_drops_roots_nobody_asked_for_and_follows_parents() -> None:
    sampled = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    unsampled = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(0))
    assert sample("POST /v1/videos") is Decision.RECORD_AND_SAMPLE
    assert sample("SELECT", **{"db.system": "postgresql"}) is Decision.DROP  # a poll's query
    assert sample("SELECT", parent=sampled, **{"db.system": "postgresql"}) is Decision.RECORD_AND_SAMPLE
    assert sample("farm.heartbeat publish") is Decision.DROP
    assert sample("encode.status process") is Decision.DROP
    assert sample("farm.heartbeat process", parent=unsampled) is Decision.DROP
    assert sample("upload.completed process", parent=sampled) is Decision.RECORD_AND_SAMPLE


@pytest.mark.parametrize("per_second", [0, 1, 3])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_reads_are_recorded_by_a_reservoir_per_second_then_a_ratio(per_second: int, ratio: float) -> None:
    bound = tracing.ratio_bound(ratio)
    below, above = bound - 1 if bound else None, bound  # draws just inside and just outside the ratio
    window, taken = -1, 0
    for second in (10, 11):  # each second starts a new reservoir
        for i in range(per_second):
            recorded, window, taken = tracing.read_decision(second, window, taken, above, per_second, bound)
            assert recorded and (window, taken) == (second, i + 1)
        # the reservoir spent: the draw decides, and the reservoir stays spent
        recorded, window, taken = tracing.read_decision(second, window, taken, above, per_second, bound)
        assert recorded is (ratio == 1.0) and taken == per_second
        if below is not None:
            recorded, window, taken = tracing.read_decision(second, window, taken, below, per_second, bound)
            assert recorded and taken == per_second


def test_the_read_rule_counts_by_the_second() -> None:
    rule = tracing.ReadRule(per_second=1, ratio=0.0)
    outside = 2**64 - 1
    assert [rule.recorded(outside, now=5.1), rule.recorded(outside, now=5.9), rule.recorded(outside, now=6.0)] \
        == [True, False, True]
    assert tracing.ReadRule(per_second=0, ratio=1.0).recorded(outside, now=1.0)
    ratio = tracing.ReadRule(per_second=0, ratio=0.25)  # its own draws: about a quarter
    assert 0.2 < sum(ratio.recorded() for _ in range(4000)) / 4000 < 0.3


# ------------------------------------------------------------------------------------------------ contexts


def test_a_traceparent_round_trips_and_a_malformed_one_is_none() -> None:
    context = tracing.span_context_of(TRACEPARENT)
    assert context is not None and context.is_remote
    assert tracing.traceparent_of(context) == TRACEPARENT
    for bad in (None, "", "garbage", "00-00000000000000000000000000000000-b7ad6b7169203331-01", "x" * 600):
        assert tracing.span_context_of(bad) is None and tracing.context_of(bad) is None
    assert tracing.context_from_headers({"traceparent": TRACEPARENT}) is not None
    assert tracing.context_from_headers({"Nats-Msg-Id": "x"}) is None and tracing.context_from_headers(None) is None


def test_without_tracing_nothing_is_recorded_or_stored() -> None:
    assert not tracing.enabled()
    assert tracing.current_traceparent() is None
    with tracing.span("x", video_id="v1") as span:
        assert not span.is_recording()
    tracing.tag_video("v1")  # no current span, no error


def test_the_envelope_carries_the_traceparent_only_when_there_is_one() -> None:
    plain = upload_completed()
    assert b"traceparent" not in plain.to_bytes()  # type: ignore[attr-defined]
    traced = upload_completed(traceparent=TRACEPARENT)
    raw = traced.to_bytes()  # type: ignore[attr-defined]
    assert Envelope.from_bytes(raw).traceparent == TRACEPARENT
    typed = Event[UploadCompleted].model_validate_json(raw)  # type: ignore[misc]
    assert typed.traceparent == TRACEPARENT and typed.to_bytes() == raw
    # an event from a publisher that knows nothing of tracing, or one with a trace context Weir cannot read, is read
    assert Envelope.from_bytes(plain.to_bytes()).traceparent is None  # type: ignore[attr-defined]
    odd = json.loads(raw)
    odd["traceparent"] = "not-a-w3c-traceparent"
    assert Envelope.from_bytes(json.dumps(odd).encode()).traceparent == "not-a-w3c-traceparent"


# ------------------------------------------------------------------------------------------ spans Weir makes


def test_a_consumer_continues_the_messages_trace_else_the_envelopes(kept: Kept) -> None:
    headers_parent = "00-11111111111111111111111111111111-2222222222222222-01"
    with tracing.handling_span("upload.completed process", headers={"traceparent": headers_parent},
                               envelope_traceparent=TRACEPARENT, replayed=False, video_id="v1",
                               attributes={tracing.EVENT_ID: "e1"}):
        pass
    with tracing.handling_span("upload.completed process", headers={}, envelope_traceparent=TRACEPARENT,
                               replayed=False, video_id="v1", attributes={}):
        pass
    from_headers, from_envelope = kept.spans
    assert from_headers.context is not None and from_headers.parent is not None
    assert f"{from_headers.context.trace_id:032x}" == "1" * 32 and from_headers.parent.span_id == 0x2222222222222222
    assert from_headers.attributes == {tracing.EVENT_ID: "e1", tracing.VIDEO_ID: "v1"}
    assert from_envelope.context is not None and tracing.traceparent_of(from_envelope.context) is not None
    assert from_envelope.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert from_headers.kind is SpanKind.CONSUMER and not from_headers.links


def test_a_replayed_event_starts_a_new_trace_that_links_to_its_original(kept: Kept) -> None:
    with tracing.handling_span("upload.completed process", headers={"Weir-Reprocess": "0"},
                               envelope_traceparent=TRACEPARENT, replayed=True, video_id="v1", attributes={}):
        pass
    (span,) = kept.spans
    assert span.parent is None and span.context is not None
    assert span.context.trace_id != 0x0AF7651916CD43DD8448EB211C80319C
    (link,) = span.links
    assert link.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and link.context.span_id == 0xB7AD6B7169203331
    assert link.attributes == {tracing.REPLAYED_FROM: TRACEPARENT}


def test_a_failure_in_a_span_marks_it_failed(kept: Kept) -> None:
    with pytest.raises(RuntimeError), tracing.span("encode dispatch round", video_id="v1"):
        raise RuntimeError("the database went away")
    (span,) = kept.spans
    assert span.status.status_code is StatusCode.ERROR and span.events[0].name == "exception"


def test_what_is_written_in_a_span_carries_its_trace(kept: Kept) -> None:
    with tracing.span("POST /v1/videos/{video_id}/upload/complete") as span:
        tracing.tag_video("v1")
        current = tracing.current_traceparent()
    assert current == tracing.traceparent_of(span.get_span_context())
    assert kept.spans[0].attributes == {tracing.VIDEO_ID: "v1"}
    with tracing.continued(current):  # later, elsewhere: what is done joins that trace
        assert trace.get_current_span().get_span_context().trace_id == span.get_span_context().trace_id
    assert not trace.get_current_span().get_span_context().is_valid


def test_the_video_of_an_event_is_its_subject_for_the_types_about_videos() -> None:
    assert tracing.video_id_of("upload.completed", "v1") == "v1"
    assert tracing.video_id_of("encode.completed", "v1") == "v1"
    assert tracing.video_id_of("recording.completed", "r1") == "r1"
    assert tracing.video_id_of("key.created", "k1") is None
    assert tracing.video_id_of("credential.rejected", "10.0.0.1") is None


def test_the_server_span_is_named_by_its_route_template(kept: Kept) -> None:
    scope = {"method": "POST", "path": "/v1/videos/v1/upload/complete",
             "headers": [(b"host", b"x"), (b"traceparent", TRACEPARENT.encode())]}
    span, token = tracing.start_server_span(scope)
    assert trace.get_current_span() is span
    tracing.end_server_span(span, token, method="POST", route="/v1/videos/{video_id}/upload/complete", status=503)
    (done,) = kept.spans
    assert done.name == "POST /v1/videos/{video_id}/upload/complete" and done.kind is SpanKind.SERVER
    assert done.parent is not None and done.parent.span_id == 0xB7AD6B7169203331  # the caller's trace
    assert done.attributes is not None and done.attributes["http.response.status_code"] == 503
    assert done.status.status_code is StatusCode.ERROR
    assert not trace.get_current_span().get_span_context().is_valid


def test_a_read_the_rule_leaves_out_makes_no_span_and_turns_the_instrumentation_off_for_its_work(
    kept: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.instrumentation.utils import is_instrumentation_enabled

    monkeypatch.setattr(tracing, "_reads", tracing.ReadRule(per_second=0, ratio=0.0))
    outcomes = {}
    for method, headers in (("GET", []), ("HEAD", []), ("OPTIONS", []), ("POST", []), ("DELETE", []),
                            ("GET", [(b"traceparent", TRACEPARENT.encode())])):  # a caller's sampled trace: followed
        span, token = tracing.start_server_span({"method": method, "path": "/v1/videos/v1", "headers": headers})
        outcomes[(method, bool(headers))] = (span.is_recording(), is_instrumentation_enabled())
        tracing.end_server_span(span, token, method=method, route="/v1/videos/{video_id}", status=200)
        assert is_instrumentation_enabled() and not trace.get_current_span().get_span_context().is_valid
    assert outcomes == {("GET", False): (False, False), ("HEAD", False): (False, False),
                        ("OPTIONS", False): (False, False), ("POST", False): (True, True),
                        ("DELETE", False): (True, True), ("GET", True): (True, True)}
    assert sorted(s.name for s in kept.spans) == ["DELETE /v1/videos/{video_id}", "GET /v1/videos/{video_id}",
                                                  "POST /v1/videos/{video_id}"]
    monkeypatch.setattr(tracing, "_reads", tracing.ReadRule(per_second=2, ratio=0.0))
    recorded = []
    for _ in range(4):  # within a second (or two: then up to four)
        span, token = tracing.start_server_span({"method": "GET", "path": "/v1/videos", "headers": []})
        recorded.append(span.is_recording())
        tracing.end_server_span(span, token, method="GET", route="/v1/videos", status=200)
    assert recorded[:2] == [True, True] and recorded.count(True) in (2, 3, 4)


def test_with_an_otlp_endpoint_spans_are_posted_there(tmp_path: Path) -> None:
    """A service process with OTEL_EXPORTER_OTLP_ENDPOINT posts OTLP (protobuf over HTTP) to it, flushed at shutdown;
    asyncpg is instrumented and the FastStream middleware is on the broker."""
    import os
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = (
        "import asyncpg\n"
        "from shared import tracing\n"
        "from faststream.nats.opentelemetry import NatsTelemetryMiddleware\n"
        "from shared.messaging import make_broker\n"
        "from shared.settings import CommonSettings\n"
        "assert tracing.setup('api', '')\n"
        "assert hasattr(asyncpg.Connection.execute, '__wrapped__')\n"
        "broker = make_broker(CommonSettings(), name='api')\n"
        "assert any(isinstance(m, NatsTelemetryMiddleware) for m in broker.middlewares)\n"
        "with tracing.span('POST /v1/videos', video_id='v1'):\n"
        "    pass\n"
        "tracing.shutdown()\n"
    )
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
           "WEIR_TRACES_DIR": str(tmp_path / "unused"), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr
    assert [path for path, _ in received] == ["/v1/traces"]
    request = ExportTraceServiceRequest.FromString(received[0][1])
    (span,) = [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
    assert span.name == "POST /v1/videos"
    assert not (tmp_path / "unused").exists()  # the endpoint wins over the files


def test_a_ratio_from_opentelemetrys_variables_samples_new_traces_only() -> None:
    assert tracing.root_ratio({}) == 1.0
    assert tracing.root_ratio({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}) \
        == 0.25
    assert tracing.root_ratio({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "nope"}) == 1.0
    assert tracing.root_ratio({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "0.1"}) == 1.0
    sampler = tracing.WeirSampler(0.25)
    roots = [sampler.should_sample(None, trace_id, "POST /v1/videos").decision for trace_id in
             range(1, 2**64, 2**64 // 4000)]
    assert 0.2 < roots.count(Decision.RECORD_AND_SAMPLE) / len(roots) < 0.3
    sampled = SpanContext(1 << 63, 2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    context = trace.set_span_in_context(trace.NonRecordingSpan(sampled))
    # a trace begun elsewhere is followed, whatever the ratio
    assert sampler.should_sample(context, 1 << 63, "upload.completed process").decision is Decision.RECORD_AND_SAMPLE
    assert tracing.WeirSampler(0.0).should_sample(None, 5, "POST /v1/videos").decision is Decision.DROP
