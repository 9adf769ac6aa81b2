"""Spans kept in memory, for tests that look at what tracing recorded (no exporter, no files)."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: object) -> SpanExportResult:
        self.spans.extend(spans)  # type: ignore[call-overload]
        return SpanExportResult.SUCCESS

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]
