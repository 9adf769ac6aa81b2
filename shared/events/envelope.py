"""The envelope every event travels in, with CloudEvents attribute names (SPEC section 7)."""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

import uuid6
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic_core import to_json

from shared.events.base import EntityId, EventData, MalformedEvent, UnknownEventType, UtcDatetime
from shared.events.catalog import CATALOG

E = TypeVar("E", bound=EventData)

EVENT_TYPE_PATTERN = r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$"


def _uuid7(value: str) -> str:
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise ValueError("must be a UUID") from None
    # v7 ids sort by time, and the id is the Nats-Msg-Id that JetStream dedupes on.
    if parsed.version != 7:
        raise ValueError(f"must be a UUIDv7, not a version {parsed.version} UUID")
    return str(parsed)


EventId = Annotated[str, AfterValidator(_uuid7)]


class Envelope(BaseModel):
    """One event: who published what about which entity, when, and its typed payload serialised in `data`."""

    # extra="ignore": CloudEvents extension attributes a newer publisher may add do not break readers.
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    id: EventId
    type: Annotated[str, StringConstraints(pattern=EVENT_TYPE_PATTERN)]
    specversion: Literal["1.0"] = "1.0"
    source: Annotated[str, StringConstraints(min_length=1)]
    time: UtcDatetime
    subject: EntityId
    dataschemaversion: Annotated[int, Field(ge=1)]
    data: dict[str, Any]

    @property
    def nats_subject(self) -> str:
        """The NATS subject the event is published on: its type."""
        return self.type

    def to_bytes(self) -> bytes:
        """Compact JSON, as published."""
        return self.model_dump_json().encode("utf-8")

    @classmethod
    def from_bytes(cls, b: bytes) -> Envelope:
        """Reads an envelope; `MalformedEvent` on bad JSON or a bad envelope (`parsed` reads the data)."""
        try:
            return cls.model_validate_json(b)
        except ValidationError as e:
            raise MalformedEvent(f"malformed event envelope: {_summary(e)}") from None

    def parsed(self, catalog: Mapping[str, builtins.type[EventData]] | None = None) -> EventData:
        """The payload, validated by the current model of the event's type (from `catalog`, default CATALOG).

        Any older `dataschemaversion` parses with the current model, because schemas only evolve compatibly;
        a newer one parses too, its new fields ignored. `MalformedEvent` for an unknown type or bad data.
        """
        model = (CATALOG if catalog is None else catalog).get(self.type)
        if model is None:
            raise UnknownEventType(f"unknown event type {self.type!r} (event {self.id})")
        return self._validate(model)

    def parsed_as(self, model: builtins.type[E]) -> E:
        """The payload as `model`, for a handler that knows its input; `MalformedEvent` if not its type."""
        if self.type != model.event_type:
            raise MalformedEvent(f"event {self.id} is {self.type!r}, not {model.event_type!r}")
        return self._validate(model)

    def _validate(self, model: builtins.type[E]) -> E:
        try:
            return model.model_validate_json(to_json(self.data))
        except ValidationError as e:
            raise MalformedEvent(
                f"{self.type} event {self.id} (dataschemaversion {self.dataschemaversion}) does not match "
                f"{model.__name__} v{model.version}: {_summary(e)}"
            ) from None


def new_event(
    data: EventData,
    *,
    source: str,
    subject: str,
    time: datetime | None = None,
    id: str | None = None,
) -> Envelope:
    """Wraps a payload in a new envelope: a fresh UUIDv7 id and the current UTC time unless given."""
    return Envelope(
        id=str(uuid6.uuid7()) if id is None else id,
        type=data.event_type,
        source=source,
        time=datetime.now(UTC) if time is None else time,
        subject=subject,
        dataschemaversion=data.version,
        data=data.model_dump(mode="json"),
    )


def _summary(error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in item["loc"]) or "(the whole value)"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)
