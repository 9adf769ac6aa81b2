"""Spans kept in memory, for tests that look at what tracing recorded (no exporter, no files)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from shared import tracing


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: object) -> SpanExportResult:
        self.spans.extend(spans)  # type: ignore[call-overload]
        return SpanExportResult.SUCCESS

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]


def kept_in_memory(monkeypatch: pytest.MonkeyPatch, service: str = "test") -> Iterator[Kept]:
    """Weir's own spans on, into memory, for one test (the process's global provider, FastStream's, is left alone):
    a fixture's body, `yield from kept_in_memory(monkeypatch)`."""
    exporter = Kept()
    provider = TracerProvider(resource=Resource.create({"service.name": service}), sampler=tracing.WeirSampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("weir"))
    yield exporter
    provider.shutdown()
