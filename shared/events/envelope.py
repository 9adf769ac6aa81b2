"""The envelope every event travels in, with CloudEvents attribute names (SPEC section 7)."""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from types import UnionType
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, cast, get_args, get_origin

import uuid6
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    ValidationError,
    create_model,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, to_json

from shared.contracts import ACCOUNT_SUBJECTS_SINCE, ContractError, contract, subject_of
from shared.events.base import EntityId, EventData, MalformedEvent, UnknownEventType, UtcDatetime
from shared.events.catalog import CATALOG
from shared.headers import HDR_LEGACY_COPY

E = TypeVar("E", bound=EventData)
D = TypeVar("D", bound=EventData)

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

# The W3C trace context of the work that wrote the event (CloudEvents' distributed tracing extension). Optional, and
# never a reason to refuse an event: a reader that cannot parse it starts a trace of its own (shared/tracing.py).
Traceparent = Annotated[str, StringConstraints(min_length=1, max_length=512)]
TRACEPARENT_FIELD: Any = Field(
    None, description="W3C trace context (`00-<trace id>-<span id>-<flags>`) of the work that wrote the event: the "
    "CloudEvents distributed tracing extension. Absent when that work was not traced.")


def nats_subject_of(event_type: str, data: Mapping[str, Any]) -> str:
    """The NATS subject an event goes on: its contract's (shared/contracts.py: `<type>.<account_id>` for a public event
    since 1.1.0) with its tokens filled from the data; the bare type when the contract names none, a value is missing
    or the type has no contract."""
    try:
        return subject_of(event_type, dict(data)) or event_type
    except ContractError:
        return event_type


def type_description(event_type: str) -> str:
    """What an `Event[M]`'s `type` says in its schema (the AsyncAPI documents): the type, and the NATS subject it
    travels on, from its contract."""
    try:
        declared = contract(event_type)
    except ContractError:
        return "The event type."
    if not declared.subject:
        return "The event type, also its NATS subject."
    text = f"The event type. Its NATS subject is `{declared.template}`, each `{{token}}` the event's own value"
    if declared.legacy:
        text += (f"; the bare type `{event_type}` when a value is not known, and for a copy "
                 f"(`{HDR_LEGACY_COPY}: 1`) for consumers of releases before {ACCOUNT_SUBJECTS_SINCE} while "
                 "`WEIR_EVENTS_LEGACY_SUBJECTS` is on")
    return text + "."


def _dump(event: BaseModel) -> bytes:
    """Compact JSON, without `traceparent` when there is none (most readers never see the key)."""
    exclude = {"traceparent"} if getattr(event, "traceparent", None) is None else None
    return event.model_dump_json(exclude=exclude).encode("utf-8")


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
    traceparent: Traceparent | None = TRACEPARENT_FIELD

    @property
    def nats_subject(self) -> str:
        """The NATS subject the event is published on (`nats_subject_of`): not its type, for a public event."""
        return nats_subject_of(self.type, self.data)

    def to_bytes(self) -> bytes:
        """Compact JSON, as published (an absent trace context is left out, as CloudEvents extensions are)."""
        return _dump(self)

    @classmethod
    def from_bytes(cls, b: bytes) -> Envelope:
        """Reads an envelope; `MalformedEvent` on bad JSON or a bad envelope (`parsed` reads the data)."""
        try:
            return cls.model_validate_json(b)
        except ValidationError as e:
            raise MalformedEvent(f"malformed event envelope: {validation_summary(e)}") from None

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
                f"{model.__name__} v{model.version}: {validation_summary(e)}"
            ) from None


SCHEMA_VERSION_KEY = "x-weir-dataschemaversion"
"""Where an `Event[D]` schema (in an AsyncAPI document) says which version of D's schema its `data` is."""


class Event(BaseModel, Generic[D]):
    """One event with its payload typed: `Event[UploadCompleted]` is the envelope whose `data` is an UploadCompleted.

    A handler's signature names what it consumes (`event: Event[UploadCompleted]`, or a union of several), so the
    signature is the contract and FastStream's AsyncAPI document shows the schema. `Event[M]` is a class of its own
    (`UploadCompletedEvent`) whose `type` is the constant `M.event_type`: a union of them is told apart by `type`.
    Read from bytes with JSON-mode strictness (`model_validate_json`): RFC 3339 strings become datetimes, "12" is
    still not a size.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    id: EventId
    type: Annotated[str, StringConstraints(pattern=EVENT_TYPE_PATTERN)]
    specversion: Literal["1.0"] = "1.0"
    source: Annotated[str, StringConstraints(min_length=1)]
    time: UtcDatetime
    subject: EntityId = Field(description="The entity the event is about; events about one entity keep their order.")
    dataschemaversion: Annotated[int, Field(ge=1)] = Field(
        description="The version of the data's schema it was written with; the current model reads every version."
    )
    data: D
    traceparent: Traceparent | None = TRACEPARENT_FIELD

    @classmethod
    def __get_pydantic_json_schema__(cls, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core)
        data = cls.model_fields["data"].annotation
        if isinstance(data, builtins.type) and issubclass(data, EventData):
            handler.resolve_ref_schema(schema)[SCHEMA_VERSION_KEY] = data.version
        return schema

    def __class_getitem__(cls, params: Any) -> Any:
        model = super().__class_getitem__(params)
        if cls is Event and isinstance(params, type) and issubclass(params, EventData):
            return _typed_event(cast(builtins.type[BaseModel], model), params)
        return model

    @property
    def nats_subject(self) -> str:
        """The NATS subject the event is published on (`nats_subject_of`): not its type, for a public event."""
        return nats_subject_of(self.type, self.data.model_dump(mode="json"))

    def to_bytes(self) -> bytes:
        """Compact JSON, as published (an absent trace context is left out)."""
        return _dump(self)


_TYPED: dict[builtins.type[EventData], builtins.type[BaseModel]] = {}


def _typed_event(generic: builtins.type[BaseModel], data: builtins.type[EventData]) -> builtins.type[BaseModel]:
    """`Event[data]` with `type` fixed to the data's event type (one class per data model, made once)."""
    typed = _TYPED.get(data)
    if typed is None:
        constant: Any = Literal[data.event_type]
        typed = create_model(
            f"{data.__name__}Event",
            __base__=generic,
            __module__=__name__,
            __doc__=f"The `{data.event_type}` event: {(data.__doc__ or '').strip()}",
            type=(constant, Field(description=type_description(data.event_type))),
        )
        _TYPED[data] = typed
    return typed


def event_models(annotation: Any) -> tuple[builtins.type[EventData], ...]:
    """The catalog models an annotation names: `Event[M]` gives (M,), a union of `Event[...]` gives each M.

    `ValueError` for anything else: a consumer's handler must say which events it takes."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    models: list[builtins.type[EventData]] = []
    for member in members:
        data = member.model_fields["data"].annotation if _is_event_class(member) else None
        if not (isinstance(data, builtins.type) and issubclass(data, EventData)):
            raise ValueError(f"{member!r} is not Event[<catalog model>]")
        models.append(data)
    if len({m.event_type for m in models}) != len(models):
        raise ValueError(f"{annotation!r} names an event type twice")
    return tuple(models)


def event_union(models: tuple[builtins.type[EventData], ...]) -> Any:
    """The type one message validates as: `Event[M]`, or for several models their union told apart by `type`."""
    typed = [Event[m] for m in models]  # type: ignore[valid-type]
    if len(typed) == 1:
        return typed[0]
    return Annotated[Union[tuple(typed)], Field(discriminator="type")]  # noqa: UP007


def _is_event_class(member: Any) -> bool:
    return isinstance(member, builtins.type) and issubclass(member, Event)


def new_event(
    data: EventData,
    *,
    source: str,
    subject: str,
    time: datetime | None = None,
    id: str | None = None,
    traceparent: str | None = None,
) -> Envelope:
    """Wraps a payload in a new envelope: a fresh UUIDv7 id and the current UTC time unless given. (`enqueue` adds
    the current trace context when the event has none.)"""
    return Envelope(
        id=str(uuid6.uuid7()) if id is None else id,
        type=data.event_type,
        source=source,
        time=datetime.now(UTC) if time is None else time,
        subject=subject,
        dataschemaversion=data.version,
        data=data.model_dump(mode="json"),
        traceparent=traceparent,
    )


def validation_summary(error: ValidationError, whole: str = "(the whole value)") -> str:
    """Where each problem is and what it is, in one line (never the input itself)."""
    problems = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in item["loc"]) or whole
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)
