"""Log lines of a service: text (the default, for a terminal) or one JSON object per line (WEIR_LOG_FORMAT=json).

A JSON line has `time`, `level`, `service`, `logger`, `message`, and when there are `trace_id`/`span_id`, `event_id`
(the event being handled), `request_id` (a plain `X-Request-Id`, else one made on first need) and `exception`.
Never a secret (SPEC 2: a key's 12-character prefix at most): Weir logs ids, and as a second defence every line goes
through `Redactor`, which also replaces the process's own secret settings wherever they appear.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from collections.abc import Iterable, MutableMapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

EVENT_ID: ContextVar[str | None] = ContextVar("weir_log_event_id", default=None)
HTTP_SCOPE: ContextVar[MutableMapping[str, Any] | None] = ContextVar("weir_log_http_scope", default=None)
REQUEST_ID_KEY = "weir.request_id"  # where a request's id is kept in its ASGI scope, once made
REQUEST_ID_HEADER = b"x-request-id"
_PLAIN_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
KEEP = 12  # a key's prefix as it may be shown (shared.events.catalog.KEY_PREFIX_MAX_LENGTH)
MASK = "***"
MIN_SECRET_LENGTH = 6  # shorter "secrets" would mask ordinary words


class EventContext:
    """`with EventContext(event_id):` lines logged while the block runs name this event. (A class, not a generator:
    it runs once per event handled, tracing or not, and costs a tenth of one.)"""

    __slots__ = ("event_id", "token")

    def __init__(self, event_id: str) -> None:
        self.event_id = event_id

    def __enter__(self) -> None:
        self.token = EVENT_ID.set(self.event_id)

    def __exit__(self, *_: object) -> None:
        EVENT_ID.reset(self.token)


def request_id() -> str | None:
    """The id of the HTTP request being served (None outside one). Made only when a line needs it."""
    scope = HTTP_SCOPE.get()
    if scope is None:
        return None
    rid = scope.get(REQUEST_ID_KEY)
    if rid is None:
        given = next((v for k, v in scope.get("headers", ()) if k == REQUEST_ID_HEADER), None)
        rid = given.decode() if given and _PLAIN_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = rid
    return str(rid)


class Redactor:
    """Masks what must never be in a log line: the given secrets, and anything shaped like a credential."""

    PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
        # account tokens, secret and publishable keys: their 12-character prefix stays (SPEC 2)
        (re.compile(rf"\b(w(?:at|sk|pk)_[0-9A-Za-z]{{{KEEP - 4}}})[0-9A-Za-z]+"), r"\1…"),
        # upload tokens (wut_<claims>.<signature>)
        (re.compile(rf"\b(wut_[A-Za-z0-9_-]{{{KEEP - 4}}})[A-Za-z0-9_.-]+"), r"\1…"),
        # a password in a URL (a database DSN)
        (re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:@/\s]*):[^@/\s]+@"), rf"\1:{MASK}@"),
        # presigned URLs: their signature (and a session token) is a credential while the URL lives
        (re.compile(r"(X-Amz-(?:Signature|Security-Token)=)[^&\s'\"]+"), rf"\1{MASK}"),
        # NKEY seeds (S + key type + base32)
        (re.compile(r"\bS[UAOCNPX][A-Z2-7]{56}\b"), f"S{MASK}"),
    )

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = sorted({s for s in secrets if len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        for pattern, replacement in self.PATTERNS:
            text = pattern.sub(replacement, text)
        return text


class TextFormatter(logging.Formatter):
    """`<time> <service> <LEVEL> <logger>: <message>`, redacted."""

    def __init__(self, service: str, redactor: Redactor | None = None) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        self.redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        return self.redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring), redacted."""

    def __init__(self, service: str, redactor: Redactor | None = None) -> None:
        super().__init__()
        self.service = service
        self.redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = f"{span.trace_id:032x}"
            line["span_id"] = f"{span.span_id:016x}"
        event_id = EVENT_ID.get()
        if event_id is not None:
            line["event_id"] = event_id
        rid = request_id()
        if rid is not None:
            line["request_id"] = rid
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # redacted after encoding: a secret is masked wherever it sits, escaped as JSON writes it
        return self.redact(json.dumps(line, ensure_ascii=False, default=str))


def formatter(service: str, log_format: str, secrets: Iterable[str] = ()) -> logging.Formatter:
    redactor = Redactor(secrets)
    if log_format == "json":
        return JsonFormatter(service, redactor)
    return TextFormatter(service, redactor)


def configure(service: str, level: str, log_format: str = "text", secrets: Iterable[str] = ()) -> None:
    """The process's logging: every line to stderr in `log_format`, at `level`; `secrets` never shown."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(service, log_format, secrets))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # a Python warning is a line in the same format too
