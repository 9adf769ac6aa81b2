"""The dead-letter queue as an operator sees it (`weir dlq`): what a parked message says, what `show` may print of
it, and where `redrive` sends it. Pure: the JetStream and inbox reads are in weir/dlqbus.py and weir/inboxes.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contracts import DLQ_PREFIX, REPLAY_PREFIX, origin_of
from shared.headers import HDR_CONSUMER, HDR_DELIVERIES, HDR_ERROR, HDR_ORIGINAL_SUBJECT
from shared.logs import MASK, Redactor


class DeadLetterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_DLQ_", extra="ignore", frozen=True)

    redrive_wait_seconds: float = Field(30.0, ge=0, description="how long `weir dlq redrive` waits for the consumers "
                                        "to handle what it re-drove before it removes what was handled; what is "
                                        "handled later shows `handled` in `weir dlq list`")
    poll_seconds: float = Field(0.25, gt=0, description="how often `weir dlq redrive` looks at the inboxes while it "
                                "waits")
    fetch_batch: int = Field(256, gt=0, description="messages fetched from the DLQ stream at a time")
    reason_width: int = Field(80, gt=0, description="characters of the reason `weir dlq list` shows (show: all)")


class State:
    PARKED = "parked"  # its consumer has not handled the event
    HANDLED = "handled"  # its consumer's inbox has the event (re-driven or replayed since): safe to remove
    UNKNOWN = "unknown"  # no inbox to ask (no consumer named, no event id, or the database not reachable)


@dataclass(frozen=True)
class Parked:
    """One message on `dlq.<type>`: the event as its consumer received it, and why it was parked."""

    seq: int  # its DLQ stream sequence: the id `show`, and `redrive`'s removal, use
    subject: str
    time: datetime
    headers: dict[str, str]
    data: bytes

    @property
    def event_type(self) -> str:
        return self.subject.removeprefix(DLQ_PREFIX)

    @property
    def consumer(self) -> str | None:
        return self.headers.get(HDR_CONSUMER) or None

    @property
    def reason(self) -> str:
        return self.headers.get(HDR_ERROR, "")

    @property
    def deliveries(self) -> int | None:
        value = self.headers.get(HDR_DELIVERIES, "")
        return int(value) if value.isdigit() else None

    @property
    def original_subject(self) -> str:
        """Where it was published (its publisher's account subject, or the bare type)."""
        return self.headers.get(HDR_ORIGINAL_SUBJECT) or self.event_type

    @property
    def event_id(self) -> str | None:
        """The envelope's id, when the body is a readable envelope (a malformed one may have none)."""
        try:
            found = json.loads(self.data).get("id")
        except (ValueError, AttributeError):
            return None
        return found if isinstance(found, str) and 0 < len(found) <= 64 else None


def original_of(parked: Parked) -> str:
    """The subject a re-driven copy names as its origin: a copy parked from the replay path recorded the replay
    subject (releases before this one), which says nothing of its publisher: the bare type then."""
    subject = parked.original_subject
    if subject.startswith(REPLAY_PREFIX) or origin_of(subject) is None:
        return parked.event_type
    return subject


def selected(parked: Parked, *, event_type: str | None, since: datetime | None, consumer: str | None) -> bool:
    """`--type`, `--since` and (redrive's) `--to`: what a command acts on."""
    return ((event_type is None or parked.event_type == event_type)
            and (since is None or parked.time >= since)
            and (consumer is None or parked.consumer == consumer))


# ------------------------------------------------------------------------------------------------ redaction

_CREDENTIAL_NAME = re.compile(r"authori[sz]ation|token|secret|password|passwd|cookie|api[-_]?key|signature|seed",
                              re.IGNORECASE)
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[^\s\"',;]+", re.IGNORECASE)
_REDACT = Redactor()


def redact_text(text: str) -> str:
    """Anything credential-shaped masked: Weir's keys and tokens down to their 12-character prefix (SPEC 2), a
    Bearer or Basic value, a password in a URL, a presigned signature, an NKEY seed."""
    return _BEARER.sub(rf"\1 {MASK}", _REDACT(text))


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    """A header whose name says credential is masked whole; every other value as `redact_text`."""
    return {name: MASK if _CREDENTIAL_NAME.search(name) else redact_text(value) for name, value in headers.items()}


def _redact_value(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact_value(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v) for v in value]
    if isinstance(value, str):
        # a field named like a credential is masked, except a key's prefix (12 characters at most, SPEC 2)
        if _CREDENTIAL_NAME.search(key) and not key.endswith("prefix"):
            return MASK
        return redact_text(value)
    return value


def redact_body(data: bytes) -> str:
    """The body as `show` prints it: JSON indented with credential-like fields masked; else the text, redacted."""
    try:
        document = json.loads(data)
    except ValueError:
        return redact_text(data.decode("utf-8", errors="replace"))
    if isinstance(document, dict) and isinstance(document.get("data"), dict):
        prefix = document["data"].get("key_prefix")
        if isinstance(prefix, str) and len(prefix) > 12:  # an event's key prefix is never longer than 12
            document["data"]["key_prefix"] = prefix[:12]
    return json.dumps(_redact_value(document), indent=2, ensure_ascii=False)
