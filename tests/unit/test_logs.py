"""shared/logs.py: JSON log lines (service, level, trace id, event or request id) and the redaction of secrets."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared import logs

KEY = "wsk_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"


def record(message: str, *args: Any, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("weir.encode", logging.WARNING, __file__, 1, message, args, info)


def as_json(rec: logging.LogRecord, secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    line = logs.formatter("encode", "json", secrets).format(rec)
    assert "\n" not in line  # one object a line, a traceback included
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def test_a_json_line_names_its_service_level_logger_and_message() -> None:
    entry = as_json(record("round of %s failed", "v1"))
    assert entry.keys() == {"time", "level", "service", "logger", "message"}
    assert (entry["service"], entry["level"], entry["logger"], entry["message"]) == (
        "encode", "WARNING", "weir.encode", "round of v1 failed")
    assert entry["time"].endswith("Z")


def test_inside_a_span_the_line_carries_its_trace_and_span_ids() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("encode dispatch round") as span:
        entry = as_json(record("offered"))
    context = span.get_span_context()
    assert entry["trace_id"] == f"{context.trace_id:032x}" and entry["span_id"] == f"{context.span_id:016x}"
    assert "trace_id" not in as_json(record("outside"))
    assert not trace.get_current_span().get_span_context().is_valid


def test_the_event_being_handled_and_the_request_being_served_are_named() -> None:
    with logs.EventContext("01a2-event"):
        assert as_json(record("x"))["event_id"] == "01a2-event"
    assert "event_id" not in as_json(record("x"))
    given: dict[str, Any] = {"headers": [(b"x-request-id", b"req-42")]}
    token = logs.HTTP_SCOPE.set(given)
    try:
        assert as_json(record("x"))["request_id"] == "req-42"
    finally:
        logs.HTTP_SCOPE.reset(token)
    made: dict[str, Any] = {"headers": [(b"x-request-id", b"not plain <script>")]}
    token = logs.HTTP_SCOPE.set(made)
    try:
        first, second = as_json(record("x"))["request_id"], as_json(record("y"))["request_id"]
    finally:
        logs.HTTP_SCOPE.reset(token)
    assert first == second and len(first) == 32  # made once per request, the same for all its lines
    assert "request_id" not in as_json(record("x"))


def test_a_traceback_stays_in_its_line() -> None:
    entry = as_json(record("failed", exc=True))
    assert "ValueError: boom" in entry["exception"]


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_no_secret_reaches_a_line_whatever_the_format(log_format: str) -> None:
    secret = "the-internal-token-0123456789"
    fmt = logs.formatter("api", log_format, [secret, "short"])
    line = fmt.format(record(
        "token %s, key %s, dsn %s, url %s, seed %s", secret, KEY, "postgresql://weir:hunter22@db:5432/weir",
        "http://s3/b/k?X-Amz-Credential=weir%2F2026&X-Amz-Signature=0123456789abcdef&X-Amz-Expires=60",
        "SUAOQCGDFD7M73QOJ7PGKBOYFJOMEPMIEW23BXSHMVI2DNUQKXNN747DZE"))
    for leaked in (secret, KEY, "hunter22", "0123456789abcdef", "SUAOQCGDFD7M73QO"):
        assert leaked not in line, line
    assert KEY[:12] in line  # a key's 12-character prefix may be shown
    assert "postgresql://weir:***@db:5432/weir" in line and "X-Amz-Expires=60" in line
    assert "short" not in logs.Redactor(["short"]).secrets  # too short to mask without masking words


def test_configure_sets_the_root_loggers_format(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                ) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    logs.configure("sweep", "info", "json")
    logging.getLogger("weir.sweep").info("ran")
    entry = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (entry["service"], entry["level"], entry["message"]) == ("sweep", "INFO", "ran")
