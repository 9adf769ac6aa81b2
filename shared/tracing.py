"""Traces with OpenTelemetry: one tracer provider per service process, or none at all (README "Tracing and logs").

On when spans have somewhere to go: OTLP over HTTP (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`), else OTLP/JSON lines in
`WEIR_TRACES_DIR/<service>-<pid>.jsonl` (what `weir trace` reads); with neither, `setup` installs nothing and
`enabled()` is False. A video's trace is carried by HTTP server spans, the outbox's stored `traceparent`, NATS headers
and each consumer's per-event span; a replayed event links to its original trace. Spans about a video carry
`weir.video_id`. Sampling: parent-based; writes always, reads by `ReadRule`, noise never (`WeirSampler`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from shared.contracts import AUTH_SPENT_SUBJECT
from shared.events.catalog import CATALOG
from shared.media.protocol import HEARTBEAT_SUBJECT, STATUS_SUBJECT

log = logging.getLogger("weir.tracing")

VIDEO_ID = "weir.video_id"
EVENT_ID = "weir.event_id"
TRACER_NAME = "weir"
ROOT = Context()  # as a span's parent context: a new trace
REPLAYED_FROM = "weir.replayed_from"  # the attribute of a replayed event's link to its original trace

# the event types whose subject is a video's id (a recording is a first-party video for encode)
VIDEO_EVENT_TYPES = frozenset(
    {t for t, model in CATALOG.items() if "video_id" in model.model_fields} | {"recording.completed"}
)
# root spans of these subjects come by the second and concern no video: not recorded (their children neither)
QUIET_SUBJECTS = (HEARTBEAT_SUBJECT, STATUS_SUBJECT, AUTH_SPENT_SUBJECT)

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None  # once set up
_tracer: trace.Tracer = trace.NoOpTracer()
_lock = threading.Lock()


def enabled() -> bool:
    return _provider is not None


def exporter_choice(environ: Mapping[str, str], traces_dir: str) -> str | None:
    """Where spans go: "otlp" (an endpoint is set), "files" (a traces directory), or None (tracing is off)."""
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    if traces_dir:
        return "files"
    return None


def trace_file(traces_dir: str | Path, service: str, pid: int | None = None) -> Path:
    return Path(traces_dir) / f"{service}-{os.getpid() if pid is None else pid}.jsonl"


def setup(service: str, traces_dir: str = "", environ: Mapping[str, str] | None = None, *,
          reads_per_second: float = 1.0, read_ratio: float = 0.01) -> bool:
    """Install the process's tracer provider (once; a second call keeps the first); False when tracing stays off.
    `reads_per_second`, `read_ratio`: the sampler's rule for reads (`ReadRule`)."""
    global _provider, _tracer, _reads
    environ_ = os.environ if environ is None else environ
    choice = exporter_choice(environ_, traces_dir)
    if choice is None:
        return False
    with _lock:
        if _provider is not None:
            return True
        from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor  # patches asyncpg: only when on

        exporter: SpanExporter
        if choice == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, timeout: OpenTelemetry's own OTEL_* variables
        else:
            exporter = OtlpJsonLines(trace_file(traces_dir, service))

        resource = Resource.create({"service.name": service, "service.namespace": "weir",
                                    "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"})
        provider = TracerProvider(resource=resource, sampler=WeirSampler(root_ratio(environ_)))
        # spans are queued and written in batches by the processor's own thread, off the request's path
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        # capture_parameters stays off: a query's values (hashes, tokens) never go into a span
        AsyncPGInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]
        _provider = provider
        _tracer = provider.get_tracer(TRACER_NAME)
        _reads = ReadRule(reads_per_second, read_ratio)
    log.info("tracing on: %s", "OTLP over HTTP" if choice == "otlp" else f"files in {traces_dir}")
    return True


def shutdown() -> None:
    """Flush what is queued and close the exporter (the end of the process)."""
    provider = _provider
    if provider is None:
        return
    try:
        provider.shutdown()
    except Exception as exc:  # the spans not written are lost; the process stops all the same
        log.warning("tracing: the last spans were not exported: %r", exc)


def tracer() -> trace.Tracer:
    return _tracer


# ------------------------------------------------------------------------------------------------ the sampler


def root_ratio(environ: Mapping[str, str]) -> float:
    """The share of new traces recorded: 1 unless OpenTelemetry's own variables say a ratio
    (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG=0.1`)."""
    if environ.get("OTEL_TRACES_SAMPLER", "").strip() not in ("parentbased_traceidratio", "traceidratio"):
        return 1.0
    try:
        return min(1.0, max(0.0, float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
METHOD_ATTRIBUTE, PATH_ATTRIBUTE = "http.request.method", "url.path"
_ALL = 2**64 - 1


def ratio_bound(ratio: float) -> int:
    """TraceIdRatioBased's rule: a trace is in the ratio when its id's low 64 bits are below this bound."""
    return round(min(1.0, max(0.0, ratio)) * _ALL)


def in_ratio(trace_id: int, bound: int) -> bool:
    return bound >= _ALL or trace_id & _ALL < bound


def read_decision(second: int, window: int, taken: int, draw: int, per_second: float,
                  bound: int) -> tuple[bool, int, int]:
    """Whether a new read's trace is recorded, as a pure function of the reservoir's state: `(window, taken)` is the
    second the reservoir counts in and how many reads it recorded in it. The first `per_second` reads of each second
    are recorded; past those, the ones whose `draw` (64 random bits) is within the ratio's `bound`. Returns
    (recorded, window, taken) after this read."""
    if second != window:
        window, taken = second, 0
    if taken < per_second:
        return True, window, taken + 1
    return in_ratio(draw, bound), window, taken


class ReadRule:
    """The reservoir and ratio for reads that begin a trace (`read_decision`), one per process, of the shape AWS
    X-Ray applies by default: in each second the first `per_second`, then `ratio` of the rest. Reads are most of the
    traffic (clients poll a video until it is ready) and tell little each; recording all costs the api much of its
    throughput and buries a video's journey in polls. Decided before any span is made, so a read left out is cheap."""

    def __init__(self, per_second: float = 1.0, ratio: float = 0.01) -> None:
        self.per_second, self.ratio = max(0.0, per_second), min(1.0, max(0.0, ratio))
        self._bound = ratio_bound(ratio)
        self._window, self._taken = -1, 0
        self._lock = threading.Lock()  # spans start on the loop's thread and, rarely, in worker threads

    def recorded(self, draw: int | None = None, now: float | None = None) -> bool:
        """Whether the read starting now is recorded; `draw`: 64 random bits (made here when not given)."""
        if self._bound >= _ALL:
            return True
        with self._lock:
            decided, self._window, self._taken = read_decision(
                int(time.monotonic() if now is None else now), self._window, self._taken,
                random.getrandbits(64) if draw is None else draw, self.per_second, self._bound)
        return decided


_reads = ReadRule(1.0, 1.0)  # every read, until `setup` installs the settings' rule


class WeirSampler(Sampler):
    """Parent-based (a child follows its parent's decision, local or remote). A new trace: never for noise (a
    database query outside any traced work, a periodic subject); otherwise with probability `ratio` (by trace id, as
    OpenTelemetry's ratio sampler does: every service decides the same for one trace). HTTP reads are decided before
    any span is made (`start_server_span`, by the ReadRule)."""

    def __init__(self, ratio: float = 1.0) -> None:
        self.ratio = ratio
        self._bound = ratio_bound(ratio)

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                      kind: SpanKind | None = None, attributes: Attributes = None,
                      links: Sequence[Link] | None = None, trace_state: TraceState | None = None) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if parent.is_valid:
            if parent.trace_flags.sampled:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
            return SamplingResult(Decision.DROP, None, parent.trace_state)
        if attributes and ("db.system" in attributes or "db.system.name" in attributes):
            return SamplingResult(Decision.DROP)
        if name.startswith(QUIET_SUBJECTS):
            return SamplingResult(Decision.DROP)
        if not in_ratio(trace_id, self._bound):
            return SamplingResult(Decision.DROP)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return f"WeirSampler{{ratio={self.ratio}}}"


# ------------------------------------------------------------------------------------------ the OTLP JSON files


class OtlpJsonLines(SpanExporter):
    """A SpanExporter writing one OTLP `ExportTraceServiceRequest` per line in OTLP/JSON (`otlp_json`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._file is None:
            return SpanExportResult.FAILURE
        try:
            self._file.write(json.dumps(otlp_json(spans), separators=(",", ":")) + "\n")
            self._file.flush()
        except (OSError, TypeError, ValueError) as exc:
            log.warning("tracing: writing %s failed: %r", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._file is not None:
            self._file.flush()
        return True


def otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The spans as one `ExportTraceServiceRequest` in OTLP/JSON (hex ids, integer enums, 64-bit integers as strings,
    default values left out): the same document as OpenTelemetry's own JSON encoder makes
    (`opentelemetry.exporter.otlp.json.common.trace_encoder.encode_spans(spans).to_dict()`, checked equal by
    tests/unit/test_tracing.py), written directly: theirs (and protobuf's `json_format`) cost several times more per
    span, and with a span or two per request the exporter's thread would take more CPU than the request itself."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[dict[str, Any]]]]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope
        scopes = groups.setdefault(id(resource), (resource, {}))[1]
        scopes.setdefault(id(scope), (scope, []))[1].append(_span_json(span))
    resource_spans = []
    for resource, scopes in groups.values():
        scope_spans = []
        for scope, encoded in scopes.values():
            scope_doc: dict[str, Any] = {}
            if scope is not None:
                if scope.name:
                    scope_doc["name"] = scope.name
                if scope.version:
                    scope_doc["version"] = scope.version
                if scope.attributes:
                    scope_doc["attributes"] = _attributes_json(scope.attributes)
            entry: dict[str, Any] = {"scope": scope_doc, "spans": encoded}
            if scope is not None and scope.schema_url:
                entry["schemaUrl"] = scope.schema_url
            scope_spans.append(entry)
        resource_doc: dict[str, Any] = {}
        if resource.attributes:
            resource_doc["attributes"] = _attributes_json(resource.attributes)
        group: dict[str, Any] = {"resource": resource_doc, "scopeSpans": scope_spans}
        if resource.schema_url:
            group["schemaUrl"] = resource.schema_url
        resource_spans.append(group)
    return {"resourceSpans": resource_spans} if resource_spans else {}


_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's (or a link's) context says whether it is remote


def _span_json(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    doc: dict[str, Any] = {}
    if context is not None:
        if context.trace_id:
            doc["traceId"] = f"{context.trace_id:032x}"
        if context.span_id:
            doc["spanId"] = f"{context.span_id:016x}"
        if context.trace_state:
            doc["traceState"] = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    if parent is not None and parent.span_id:
        doc["parentSpanId"] = f"{parent.span_id:016x}"
    doc["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    if span.name:
        doc["name"] = span.name
    doc["kind"] = span.kind.value + 1  # OTLP's SpanKind counts from UNSPECIFIED = 0
    if span.start_time:
        doc["startTimeUnixNano"] = str(span.start_time)
    if span.end_time:
        doc["endTimeUnixNano"] = str(span.end_time)
    if span.attributes:
        doc["attributes"] = _attributes_json(span.attributes)
    if span.dropped_attributes:
        doc["droppedAttributesCount"] = span.dropped_attributes
    if span.events:
        doc["events"] = [_event_json(event) for event in span.events]
    if span.dropped_events:
        doc["droppedEventsCount"] = span.dropped_events
    if span.links:
        doc["links"] = [_link_json(link) for link in span.links]
    if span.dropped_links:
        doc["droppedLinksCount"] = span.dropped_links
    status: dict[str, Any] = {}
    if span.status.description:
        status["message"] = span.status.description
    if span.status.status_code.value:
        status["code"] = span.status.status_code.value
    doc["status"] = status
    return doc


def _event_json(event: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if event.timestamp:
        doc["timeUnixNano"] = str(event.timestamp)
    if event.name:
        doc["name"] = event.name
    if event.attributes:
        doc["attributes"] = _attributes_json(event.attributes)
    if event.dropped_attributes:
        doc["droppedAttributesCount"] = event.dropped_attributes
    return doc


def _link_json(link: Link) -> dict[str, Any]:
    context = link.context
    doc: dict[str, Any] = {}
    if context.trace_id:
        doc["traceId"] = f"{context.trace_id:032x}"
    if context.span_id:
        doc["spanId"] = f"{context.span_id:016x}"
    if link.attributes:
        doc["attributes"] = _attributes_json(link.attributes)
    if link.dropped_attributes:
        doc["droppedAttributesCount"] = link.dropped_attributes
    doc["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if context.is_remote else 0)
    return doc


def _attributes_json(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value_json(value)} if key else {"value": _value_json(value)}
            for key, value in attributes.items()]


def _value_json(value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # the common case first
        return {"stringValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if math.isnan(value):
            return {"doubleValue": "NaN"}
        if math.isinf(value):
            return {"doubleValue": "Infinity" if value > 0 else "-Infinity"}
        return {"doubleValue": value}
    if value is None:
        return {}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()} if value else {"bytesValue": ""}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [_value_json(v) for v in value]} if value else {}}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": _attributes_json({str(k): v for k, v in value.items()})} if value else {}}
    raise TypeError(f"not an attribute value: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------- trace context


def traceparent_of(span_context: SpanContext) -> str | None:
    """The W3C traceparent of a span context (None for an invalid one)."""
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def current_traceparent() -> str | None:
    """The current span's traceparent, to store with what is written now (None when tracing is off)."""
    if _provider is None:
        return None
    return traceparent_of(trace.get_current_span().get_span_context())


def span_context_of(traceparent: str | None) -> SpanContext | None:
    """The remote span context a traceparent names (None when there is none, or it is malformed)."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def context_of(traceparent: str | None) -> Context | None:
    """A context whose parent span is the one a traceparent names (None when there is none)."""
    span_context = span_context_of(traceparent)
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), Context()) if span_context else None


def context_from_headers(headers: Mapping[str, str] | None) -> Context | None:
    """The trace context a message's headers carry (`traceparent`), or None."""
    if not headers or "traceparent" not in headers:
        return None
    context = _PROPAGATOR.extract(headers)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


@contextlib.contextmanager
def continued(traceparent: str | None) -> Iterator[None]:
    """While the block runs, the current context is the stored trace's (no span of its own): what the block does
    later on behalf of earlier work (a result delivered by a loop) joins that work's trace."""
    context = context_of(traceparent) if _provider is not None else None
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def outside_traces() -> Iterator[None]:
    """While the block runs, no trace is current: periodic work sent from inside traced work (a heartbeat after a
    job frees its slot) starts no span in that work's trace, and the sampler drops its quiet subject."""
    token = otel_context.attach(ROOT)
    try:
        yield
    finally:
        otel_context.detach(token)


def video_id_of(event_type: str, subject: str) -> str | None:
    """The video an event is about (its subject), for the event types that concern a video."""
    return subject if event_type in VIDEO_EVENT_TYPES else None


def tag_video(video_id: str | None) -> None:
    """Mark the current span (an HTTP request, a handler) as concerning this video; nothing when tracing is off."""
    if _provider is not None and video_id:
        trace.get_current_span().set_attribute(VIDEO_ID, video_id)


# ------------------------------------------------------------------------------------------------------ spans


def start_span(name: str, *, context: Context | None = None, video_id: str | None = None,
               attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = None,
               kind: SpanKind = SpanKind.INTERNAL) -> Span:
    """A span (to end yourself). `context`: its parent (None: the current span; `ROOT`: a new trace)."""
    attrs: dict[str, Any] = dict(attributes or {})
    if video_id:
        attrs[VIDEO_ID] = video_id
    return _tracer.start_span(name, context=context, kind=kind, attributes=attrs, links=links)


@contextlib.contextmanager
def span(name: str, *, context: Context | None = None, video_id: str | None = None,
         attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = None,
         kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A span, current while the block runs; an exception that leaves the block marks it failed. A no-op span when
    tracing is off."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    started = start_span(name, context=context, video_id=video_id, attributes=attributes, links=links, kind=kind)
    with trace.use_span(started, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield started


def handling_span(name: str, *, headers: Mapping[str, str] | None, envelope_traceparent: str | None,
                  replayed: bool, video_id: str | None,
                  attributes: Mapping[str, Any]) -> contextlib.AbstractContextManager[Span]:
    """The span of one consumer's handling of one event: the child of the trace its message's headers carry (else its
    envelope's); a replayed event starts a new span (a child of the replay's own trace, if any) that links to its
    original trace."""
    if _provider is None:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    parent = context_from_headers(headers)
    links: list[Link] = []
    if replayed:
        original = span_context_of(envelope_traceparent)
        if original is not None:
            links.append(Link(original, {REPLAYED_FROM: traceparent_of(original) or ""}))
    elif parent is None:
        parent = context_of(envelope_traceparent)
    return span(name, context=parent or ROOT, video_id=video_id, attributes=attributes, links=links,
                kind=SpanKind.CONSUMER)


# ------------------------------------------------------------------------------------------------ HTTP spans

TRACEPARENT_HEADER = b"traceparent"


def _instrumentation_suppressed() -> Context:
    """A new trace's context in which instrumentations (asyncpg's) record nothing: a read's when not recorded."""
    token = otel_context.attach(ROOT)
    try:
        with suppress_instrumentation():
            return otel_context.get_current()
    finally:
        otel_context.detach(token)


_LEFT_OUT = _instrumentation_suppressed()


def start_server_span(scope: Mapping[str, Any]) -> tuple[Span, object]:
    """The server span of one HTTP request, current from now (`end_server_span` ends it): the child of the caller's
    trace when it sent a `traceparent`, else a new trace. Named by its method until the route is known."""
    method = scope["method"]
    parent: Context | None = None
    for name, value in scope.get("headers", ()):
        if name == TRACEPARENT_HEADER:
            parent = context_of(value.decode("latin-1"))
            break
    if parent is None and method in READ_METHODS and not _reads.recorded():
        # a new read the rule leaves out makes no span at all, and its queries none either (the instrumentation is
        # off for it: its wrappers' attributes and no-op spans cost tens of microseconds a request)
        return trace.INVALID_SPAN, otel_context.attach(_LEFT_OUT)
    span = _tracer.start_span(method, context=parent or ROOT, kind=SpanKind.SERVER,
                              attributes={METHOD_ATTRIBUTE: method, PATH_ATTRIBUTE: scope["path"]})
    return span, otel_context.attach(trace.set_span_in_context(span))


def end_server_span(span: Span, token: object, *, method: str, route: str, status: int) -> None:
    """Names the span by its route template (`GET /v1/videos/{video_id}`), with the answer's status."""
    otel_context.detach(token)  # type: ignore[arg-type]
    if span is trace.INVALID_SPAN:  # a read left out: nothing to name or end
        return
    span.update_name(f"{method} {route}")
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def failed(span_: Span, error: BaseException | str) -> None:
    """Mark a span failed, with why (a string, or the exception recorded)."""
    if not span_.is_recording():
        return
    if isinstance(error, BaseException):
        span_.record_exception(error)
        span_.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
    else:
        span_.set_status(Status(StatusCode.ERROR, error[:500]))

