"""What every event payload shares: the `EventData` base, the field types it uses, and `MalformedEvent`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints


class MalformedEvent(ValueError):
    """An event that cannot be read: bad JSON, a bad envelope, an unknown type, or data failing its model."""


class UnknownEventType(MalformedEvent):
    """An event type that is not in the catalog."""


def _as_utc(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("must be timezone-aware (RFC 3339 with an offset)")
    return value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]
"""A timezone-aware datetime, normalised to UTC; a naive one is refused."""

EntityId = Annotated[str, StringConstraints(min_length=1)]
Height = Annotated[int, Field(gt=0)]
ByteCount = Annotated[int, Field(ge=0)]


class EventData(BaseModel):
    """Base of every event payload: frozen, versioned, one subclass per event type.

    Each subclass sets `event_type` (also its NATS subject) and `version` (its dataschemaversion, from 1).
    A schema only evolves compatibly (new optional fields), so the current model reads every older version.
    """

    # extra="ignore": a consumer on an older model must still read what a newer publisher writes.
    # strict: no silent coercion ("12" is not a size); JSON input still parses datetimes from strings.
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    event_type: ClassVar[str]
    version: ClassVar[int]
