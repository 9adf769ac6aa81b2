"""The event catalog: envelopes, payload models, schema snapshots and the compatibility check (no servers)."""

from __future__ import annotations

import json
import re
import types
import typing
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pytest
import uuid6
from pydantic import BaseModel, TypeAdapter, ValidationError, create_model

from shared.events import (
    ALL_TYPES,
    CATALOG,
    DEFAULT_SCHEMAS_DIR,
    KEY_PREFIX_MAX_LENGTH,
    SCHEMA_VERSION_KEY,
    CredentialRejected,
    Envelope,
    Event,
    EventData,
    MalformedEvent,
    SnapshotRefused,
    UnknownEventType,
    UploadCompleted,
    VideoCreated,
    check_catalog,
    differences,
    dlq_subject,
    event_models,
    event_union,
    incompatibilities,
    model_for,
    new_event,
    render_schema,
    schema_of,
    snapshot_path,
    write_snapshots,
)

# The event types of SPEC sections 7 and 12.
SPEC_TYPES = {
    "webhook.disabled",
    "publisher.rejected",
    "credential.rejected",
    "key.created",
    "key.revoked",
    "video.created",
    "video.deleted",
    "upload.completed",
    "video.ready",  # beyond SPEC 7's list: a video's outcome, as the hosted video APIs announce it
    "video.failed",
    "video.captions_changed",  # beyond SPEC 7's list: a track added, replaced or removed, as Mux announces it
    "recording.completed",
    "dispatch.busy",
    "encode.started",
    "encode.progress",
    "encode.completed",
    "encode.failed",
    "video.retired",
}

MODELS = pytest.mark.parametrize("model", list(CATALOG.values()), ids=list(CATALOG))
AN_HOUR_AGO = datetime(2025, 3, 1, 11, 0, tzinfo=UTC)
M = TypeVar("M", bound=BaseModel)


def sample_value(annotation: Any, name: str) -> Any:
    """A valid value for a field, from its annotation, so that a new event type is covered without new code."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return sample_value(typing.get_args(annotation)[0], name)
    if origin in (types.UnionType, typing.Union):
        # Fill optional fields too: the round trip should carry a value, not just null.
        return sample_value(next(a for a in typing.get_args(annotation) if a is not type(None)), name)
    if origin is Literal:
        return typing.get_args(annotation)[0]
    if origin is list:
        return [sample_value(typing.get_args(annotation)[0], name)]
    if annotation is bool:
        return True
    if annotation is int:
        return 720
    if annotation is float:
        return 0.5
    if annotation is str:
        return f"{name[:8]}-1"
    if annotation is datetime:
        return AN_HOUR_AGO
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sample(annotation)
    raise AssertionError(f"teach sample_value about {annotation!r} (field {name})")


def sample(model: type[M]) -> M:
    return model(**{name: sample_value(f.annotation, name) for name, f in model.model_fields.items()})


# --- the catalog ------------------------------------------------------------------------------------------


def test_catalog_has_every_event_type_of_the_spec() -> None:
    assert set(ALL_TYPES) == SPEC_TYPES
    assert set(CATALOG) == SPEC_TYPES


def test_committed_snapshots_match_the_catalog() -> None:
    assert check_catalog(DEFAULT_SCHEMAS_DIR) == []


@MODELS
def test_each_model_is_registered_under_its_type(model: type[EventData]) -> None:
    assert model_for(model.event_type) is model
    assert CATALOG[model.event_type] is model
    assert model.version >= 1
    assert snapshot_path(DEFAULT_SCHEMAS_DIR, model.event_type, model.version).is_file()


@MODELS
def test_snapshot_files_are_canonical(model: type[EventData]) -> None:
    text = snapshot_path(DEFAULT_SCHEMAS_DIR, model.event_type, model.version).read_text(encoding="utf-8")
    assert text == render_schema(json.loads(text))
    assert text.endswith("}\n")
    assert text == render_schema(schema_of(model))


def test_unknown_type_has_no_model() -> None:
    with pytest.raises(UnknownEventType):
        model_for("video.exploded")
    assert issubclass(UnknownEventType, MalformedEvent)


def test_dead_letters_go_to_the_dlq_subject_of_the_type() -> None:
    assert dlq_subject("upload.completed") == "dlq.upload.completed"


@MODELS
def test_payloads_are_frozen(model: type[EventData]) -> None:
    payload = sample(model)
    field = next(iter(model.model_fields))
    with pytest.raises(ValidationError):
        setattr(payload, field, getattr(payload, field))


# --- the envelope -----------------------------------------------------------------------------------------


@MODELS
def test_every_event_type_round_trips(model: type[EventData]) -> None:
    payload = sample(model)
    event = new_event(payload, source="api", subject="entity-1")

    wire = event.to_bytes()
    received = Envelope.from_bytes(wire)

    assert received == event
    assert received.to_bytes() == wire
    assert received.parsed() == payload
    assert received.parsed_as(model) == payload
    assert received.type == model.event_type
    assert received.dataschemaversion == model.version
    assert received.specversion == "1.0"
    assert (received.source, received.subject) == ("api", "entity-1")
    assert uuid.UUID(received.id).version == 7
    assert received.time.tzinfo is not None and received.time.utcoffset() == timedelta(0)


def test_an_events_nats_subject_is_its_contracts_not_its_type() -> None:
    """Since 1.1.0 a public event travels on `<type>.<account_id>`; a type without a template on its type; one whose
    account is not known on its bare type."""
    created = new_event(sample(VideoCreated).model_copy(update={"account_id": "acme1"}), source="api", subject="v1")
    assert created.nats_subject == "video.created.acme1"
    assert Event[VideoCreated].model_validate_json(created.to_bytes()).nats_subject == "video.created.acme1"
    assert new_event(sample(CredentialRejected), source="auth", subject="x").nats_subject == "credential.rejected"
    progress = new_event(sample(CATALOG["encode.progress"]).model_copy(update={"account_id": None}), source="media",
                         subject="v1")
    assert progress.nats_subject == "encode.progress"


# --- typed events: what a consumer's handler takes ------------------------------------------------------------


@MODELS
def test_every_event_type_reads_as_its_typed_event(model: type[EventData]) -> None:
    payload = sample(model)
    wire = new_event(payload, source="api", subject="entity-1").to_bytes()

    typed: type[Event[Any]] = Event[model]  # type: ignore[valid-type]
    event = typed.model_validate_json(wire)

    assert typed is Event[model]  # type: ignore[valid-type]  # one class per model
    assert typed.__name__ == f"{model.__name__}Event" and issubclass(typed, Event)
    assert event.data == payload and type(event.data) is model
    assert event.to_bytes() == wire  # the same bytes as the untyped envelope
    assert event.type == model.event_type and event.dataschemaversion == model.version
    schema = typed.model_json_schema()
    assert schema["properties"]["type"]["const"] == model.event_type
    assert schema[SCHEMA_VERSION_KEY] == model.version


def test_a_typed_event_refuses_another_type_and_data_that_fails_its_model() -> None:
    upload = new_event(sample(UploadCompleted), source="api", subject="v")
    with pytest.raises(ValidationError, match="type"):
        Event[CredentialRejected].model_validate_json(upload.to_bytes())
    bad = json.loads(upload.to_bytes())
    bad["data"]["size"] = "720"  # JSON-mode strict: a string is not a size
    with pytest.raises(ValidationError, match=r"data\.size"):
        Event[UploadCompleted].model_validate_json(json.dumps(bad))


def test_a_union_of_typed_events_is_told_apart_by_type() -> None:
    annotation = Event[UploadCompleted] | Event[CredentialRejected]
    models = event_models(annotation)
    assert models == (UploadCompleted, CredentialRejected)
    adapter: TypeAdapter[Any] = TypeAdapter(event_union(models))
    rejected = sample(CredentialRejected)
    read = adapter.validate_json(new_event(rejected, source="auth", subject="k").to_bytes())
    assert type(read) is Event[CredentialRejected] and read.data == rejected
    with pytest.raises(ValidationError):  # a type outside the union
        adapter.validate_json(new_event(sample(VideoCreated), source="api", subject="v").to_bytes())
    for not_events in (UploadCompleted, Envelope, Event[UploadCompleted] | int):
        with pytest.raises(ValueError, match="is not Event"):
            event_models(not_events)


def test_envelope_is_compact_json_with_cloudevents_names() -> None:
    event = new_event(sample(UploadCompleted), source="api", subject="video-1", time=AN_HOUR_AGO)
    wire = event.to_bytes()
    assert b"\n" not in wire and b'", "' not in wire and b'": ' not in wire
    decoded = json.loads(wire)
    assert set(decoded) == {
        "id",
        "type",
        "specversion",
        "source",
        "time",
        "subject",
        "dataschemaversion",
        "data",
    }
    assert decoded["time"] == "2025-03-01T11:00:00Z"
    assert decoded["type"] == "upload.completed"
    assert decoded["data"]["size"] == 720


def test_new_event_keeps_a_given_id_and_normalises_time_to_utc() -> None:
    event_id = str(uuid6.uuid7())
    at = datetime(2025, 3, 1, 13, 0, tzinfo=timezone(timedelta(hours=2)))
    event = new_event(sample(UploadCompleted), source="api", subject="video-1", time=at, id=event_id)
    assert event.id == event_id
    assert event.time == AN_HOUR_AGO and event.time.tzinfo == UTC


def test_new_event_ids_are_fresh_and_time_ordered() -> None:
    ids = [new_event(sample(UploadCompleted), source="api", subject="v").id for _ in range(50)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


@pytest.mark.parametrize(
    ("time", "event_id"),
    [
        (datetime(2025, 3, 1, 11, 0), None),  # naive: which zone?
        (None, "0801b34a-4453-4776-9a02-ea78110907bc"),  # a v4, not a v7
        (None, "not-a-uuid"),
    ],
)
def test_new_event_refuses_a_naive_time_or_a_bad_id(time: datetime | None, event_id: str | None) -> None:
    with pytest.raises(ValidationError):
        new_event(sample(UploadCompleted), source="api", subject="video-1", time=time, id=event_id)


def _good_envelope() -> dict[str, Any]:
    return new_event(sample(UploadCompleted), source="api", subject="video-1").model_dump(mode="json")


def _without(key: str) -> dict[str, Any]:
    envelope = _good_envelope()
    del envelope[key]
    return envelope


def _with(**changes: Any) -> dict[str, Any]:
    return {**_good_envelope(), **changes}


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"\xff\xfe garbage",
        b"not json",
        b"[1, 2, 3]",
        b"{}",
        b'{"id": ',
        json.dumps(_without("data")).encode(),
        json.dumps(_without("type")).encode(),
        json.dumps(_without("time")).encode(),
        json.dumps(_with(data=[1, 2])).encode(),
        json.dumps(_with(id="12345")).encode(),
        json.dumps(_with(id=str(uuid.uuid4()))).encode(),
        json.dumps(_with(specversion="0.3")).encode(),
        json.dumps(_with(time="yesterday")).encode(),
        json.dumps(_with(time="2025-03-01T11:00:00")).encode(),  # no offset
        json.dumps(_with(dataschemaversion="1")).encode(),
        json.dumps(_with(dataschemaversion=0)).encode(),
        json.dumps(_with(type="")).encode(),
        json.dumps(_with(source="")).encode(),
    ],
)
def test_from_bytes_refuses_garbage(wire: bytes) -> None:
    with pytest.raises(MalformedEvent, match="malformed event"):
        Envelope.from_bytes(wire)


def test_parsed_refuses_an_unknown_type() -> None:
    wire = json.dumps(_with(type="video.exploded")).encode()
    event = Envelope.from_bytes(wire)  # the envelope itself is fine
    with pytest.raises(MalformedEvent, match=re.escape("unknown event type 'video.exploded'")):
        event.parsed()


@pytest.mark.parametrize(
    "data",
    [
        {},
        {**sample(UploadCompleted).model_dump(mode="json"), "size": "12"},  # no silent coercion
        {**sample(UploadCompleted).model_dump(mode="json"), "size": -1},
        {k: v for k, v in sample(UploadCompleted).model_dump(mode="json").items() if k != "video_id"},
    ],
)
def test_parsed_refuses_data_that_fails_its_model(data: dict[str, Any]) -> None:
    event = Envelope.from_bytes(json.dumps(_with(data=data)).encode())
    with pytest.raises(MalformedEvent, match=f"does not match UploadCompleted v{UploadCompleted.version}"):
        event.parsed()


def test_parsed_as_refuses_another_type() -> None:
    event = Envelope.from_bytes(json.dumps(_good_envelope()).encode())
    with pytest.raises(MalformedEvent):
        event.parsed_as(CredentialRejected)


def test_a_key_prefix_longer_than_twelve_characters_is_refused() -> None:
    fields = sample(CredentialRejected).model_dump()
    CredentialRejected(**{**fields, "key_prefix": "k" * KEY_PREFIX_MAX_LENGTH})
    with pytest.raises(ValidationError):
        CredentialRejected(**{**fields, "key_prefix": "k" * (KEY_PREFIX_MAX_LENGTH + 1)})

    # and a publisher that skipped the model is caught by the reader
    event = new_event(sample(CredentialRejected), source="auth", subject="app-1").model_dump(mode="json")
    event["data"]["key_prefix"] = "sk_live_0123456789abcdef"
    with pytest.raises(MalformedEvent, match="key_prefix"):
        Envelope.from_bytes(json.dumps(event).encode()).parsed()


def test_credential_rejections_count_one_unless_folded() -> None:
    fields = sample(CredentialRejected).model_dump(exclude={"count"})
    assert CredentialRejected(**fields).count == 1
    with pytest.raises(ValidationError):
        CredentialRejected(**fields, count=0)


# --- evolving a schema: old and new models read each other's events ------------------------------------------


class UploadCompletedV2(UploadCompleted):
    """upload.completed as it might evolve: one new optional field, the next version."""

    version: ClassVar[int] = UploadCompleted.version + 1

    duration_seconds: float | None = None


def test_a_v1_payload_parses_under_a_compatible_v2_model() -> None:
    v1 = sample(UploadCompleted)
    wire = new_event(v1, source="api", subject=v1.video_id).to_bytes()

    event = Envelope.from_bytes(wire)
    read = event.parsed(catalog={"upload.completed": UploadCompletedV2})

    assert event.dataschemaversion == UploadCompleted.version
    assert isinstance(read, UploadCompletedV2)
    assert read.duration_seconds is None
    assert read.model_dump(exclude={"duration_seconds"}) == v1.model_dump()
    assert incompatibilities(schema_of(UploadCompleted), schema_of(UploadCompletedV2)) == []


def test_a_v2_payload_parses_under_the_v1_model() -> None:
    v2 = UploadCompletedV2(**sample(UploadCompleted).model_dump(), duration_seconds=12.5)
    event = Envelope.from_bytes(new_event(v2, source="api", subject=v2.video_id).to_bytes())

    assert event.dataschemaversion == UploadCompletedV2.version
    assert event.parsed() == sample(UploadCompleted)  # the new field is ignored by the old reader


# --- the compatibility checker -----------------------------------------------------------------------------


class Inner(BaseModel):
    height: int
    label: str


class InnerRetyped(BaseModel):
    height: str
    label: str


class Before(BaseModel):
    name: str
    size: int
    note: str | None = None
    kind: Literal["a", "b"]
    at: datetime
    inner: Inner
    maybe_inner: Inner | None = None
    inners: list[Inner]


def evolve(**changes: Any) -> dict[str, Any]:
    """The schema of `Before` with some fields changed: `name=None` removes a field, `name=T` makes it a
    required T, `name=(T, default)` an optional one."""
    fields: dict[str, Any] = {
        name: (f.annotation, ... if f.is_required() else f.default) for name, f in Before.model_fields.items()
    }
    for name, change in changes.items():
        if change is None:
            del fields[name]
        else:
            fields[name] = change if isinstance(change, tuple) else (change, ...)
    after: type[BaseModel] = create_model("After", **fields)
    return after.model_json_schema()


BEFORE = Before.model_json_schema()


def test_an_unchanged_schema_is_compatible() -> None:
    assert incompatibilities(BEFORE, BEFORE) == []
    assert incompatibilities(BEFORE, evolve()) == []
    assert differences(BEFORE, evolve()) == []


def test_a_new_optional_field_is_compatible() -> None:
    after = evolve(extra=(int | None, None))
    assert incompatibilities(BEFORE, after) == []
    assert differences(BEFORE, after) == ["property `extra` was added"]


def test_documentation_and_defaults_may_change() -> None:
    after = evolve(note=(str | None, "none given"))
    after["description"] = "Now documented."
    after["properties"]["size"]["title"] = "Size in bytes"
    assert incompatibilities(BEFORE, after) == []


def test_a_removed_field_is_incompatible() -> None:
    assert incompatibilities(BEFORE, evolve(size=None)) == ["property `size` was removed"]
    # even an optional one: old readers may rely on it
    assert incompatibilities(BEFORE, evolve(note=None)) == ["property `note` was removed"]


@pytest.mark.parametrize(
    ("field", "annotation", "expected"),
    [
        ("name", int, "property `name` changed type from string to integer"),
        ("size", list[int], "property `size` changed type from integer to array of integer"),
        ("size", float, "property `size` changed type from integer to number"),
        # widening is refused too: an old reader fails on the first null
        ("size", (int | None, None), "property `size` changed type from integer to integer | null"),
        ("note", (int | None, None), "property `note` changed type from string | null to integer | null"),
        ("at", str, 'property `at`: `format` changed from "date-time" to (none)'),
        ("kind", Literal["a", "b", "c"], 'property `kind` changed its allowed values from ["a", "b"]'),
        ("inner", InnerRetyped, "property `inner.height` changed type from integer to string"),
        ("maybe_inner", (InnerRetyped | None, None), "property `maybe_inner.height` changed type"),
        ("inners", list[InnerRetyped], "property `inners[].height` changed type from integer to string"),
    ],
)
def test_a_changed_type_is_incompatible(field: str, annotation: Any, expected: str) -> None:
    reasons = incompatibilities(BEFORE, evolve(**{field: annotation}))
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith(expected)


def test_a_changed_constraint_is_incompatible() -> None:
    before = schema_of(CredentialRejected)
    after = json.loads(json.dumps(before))
    after["properties"]["key_prefix"]["anyOf"][0]["maxLength"] = 8
    assert incompatibilities(before, after) == ["property `key_prefix`: `maxLength` changed from 12 to 8"]


def test_a_new_required_field_is_incompatible() -> None:
    assert incompatibilities(BEFORE, evolve(extra=int)) == [
        "new property `extra` is required; readers of older events would fail"
    ]


def test_an_optional_field_becoming_required_is_incompatible() -> None:
    assert incompatibilities(BEFORE, evolve(note=str | None)) == ["property `note` became required"]


def test_a_required_field_becoming_optional_is_compatible_but_a_difference() -> None:
    after = evolve(size=(int, 0))
    assert incompatibilities(BEFORE, after) == []
    assert "property `size` became optional" in differences(BEFORE, after)


def test_reordering_a_union_is_not_a_change() -> None:
    assert incompatibilities(BEFORE, evolve(note=(None | str, None))) == []


class Tree(BaseModel):
    label: str
    children: list[Tree]


class TreeRetyped(BaseModel):
    label: int
    children: list[TreeRetyped]


def test_recursive_models_are_compared() -> None:
    assert incompatibilities(Tree.model_json_schema(), Tree.model_json_schema()) == []
    assert incompatibilities(Tree.model_json_schema(), TreeRetyped.model_json_schema()) == [
        "property `label` changed type from string to integer"
    ]


# --- snapshots ----------------------------------------------------------------------------------------------


class ThingV1(EventData):
    event_type: ClassVar[str] = "thing.happened"
    version: ClassVar[int] = 1

    thing_id: str
    size: int


class ThingV1Edited(ThingV1):
    """Same version, new field: a change that needed a version bump."""

    colour: str | None = None


class ThingV1Documented(ThingV1):
    """Same schema as v1, now with a description."""


class ThingV2(ThingV1):
    version: ClassVar[int] = 2

    colour: str | None = None


class ThingV3Incompatible(EventData):
    event_type: ClassVar[str] = "thing.happened"
    version: ClassVar[int] = 3

    thing_id: str
    colour: str | None = None


def test_snapshots_are_written_once_per_version(tmp_path: Path) -> None:
    catalog: dict[str, type[EventData]] = {"thing.happened": ThingV1}
    assert check_catalog(tmp_path, catalog) == [
        "thing.happened: snapshot v1 is missing, run `weir events snapshot`"
    ]

    written = write_snapshots(tmp_path, catalog)

    v1 = tmp_path / "thing.happened" / "v1.json"
    assert written == [v1]
    assert v1.read_text(encoding="utf-8") == render_schema(schema_of(ThingV1))
    assert check_catalog(tmp_path, catalog) == []
    assert write_snapshots(tmp_path, catalog) == []  # nothing changed, nothing written


def test_a_changed_schema_needs_a_version_bump(tmp_path: Path) -> None:
    write_snapshots(tmp_path, {"thing.happened": ThingV1})
    v1 = tmp_path / "thing.happened" / "v1.json"
    committed = v1.read_bytes()
    edited: dict[str, type[EventData]] = {"thing.happened": ThingV1Edited}

    [problem] = check_catalog(tmp_path, edited)
    assert "the schema changed but its version did not" in problem and "`colour` was added" in problem
    with pytest.raises(SnapshotRefused, match="raise `version` to 2") as refused:
        write_snapshots(tmp_path, edited)
    assert len(refused.value.reasons) == 1
    assert v1.read_bytes() == committed

    # the fix: a new version, written next to the old one
    bumped: dict[str, type[EventData]] = {"thing.happened": ThingV2}
    assert write_snapshots(tmp_path, bumped) == [tmp_path / "thing.happened" / "v2.json"]
    assert v1.read_bytes() == committed
    assert check_catalog(tmp_path, bumped) == []


def test_a_documentation_only_change_rewrites_the_snapshot(tmp_path: Path) -> None:
    write_snapshots(tmp_path, {"thing.happened": ThingV1})
    documented: dict[str, type[EventData]] = {"thing.happened": ThingV1Documented}

    assert check_catalog(tmp_path, documented) == [
        "thing.happened: snapshot v1 is out of date (documentation or formatting only), "
        "run `weir events snapshot`"
    ]
    assert write_snapshots(tmp_path, documented) == [tmp_path / "thing.happened" / "v1.json"]
    assert check_catalog(tmp_path, documented) == []


def test_an_incompatible_version_is_refused_and_reported(tmp_path: Path) -> None:
    write_snapshots(tmp_path, {"thing.happened": ThingV1})
    write_snapshots(tmp_path, {"thing.happened": ThingV2})
    incompatible: dict[str, type[EventData]] = {"thing.happened": ThingV3Incompatible}

    with pytest.raises(SnapshotRefused) as refused:
        write_snapshots(tmp_path, incompatible)
    assert refused.value.reasons == [
        "thing.happened v1 -> v3: property `size` was removed",
        "thing.happened v2 -> v3: property `size` was removed",
    ]
    assert not (tmp_path / "thing.happened" / "v3.json").exists()

    (tmp_path / "thing.happened" / "v3.json").write_text(render_schema(schema_of(ThingV3Incompatible)))
    assert check_catalog(tmp_path, incompatible) == refused.value.reasons


def test_deleting_an_old_snapshot_is_caught(tmp_path: Path) -> None:
    bumped: dict[str, type[EventData]] = {"thing.happened": ThingV2}
    write_snapshots(tmp_path, {"thing.happened": ThingV1})
    write_snapshots(tmp_path, bumped)
    (tmp_path / "thing.happened" / "v1.json").unlink()

    [problem] = check_catalog(tmp_path, bumped)
    assert problem.startswith("thing.happened: snapshot v1 is missing")


def test_removing_an_event_type_is_caught(tmp_path: Path) -> None:
    write_snapshots(tmp_path, {"thing.happened": ThingV1})
    assert check_catalog(tmp_path, {}) == [
        "thing.happened: snapshots exist but the type is not in the catalog; removing an event type is an "
        "incompatible change"
    ]


def test_the_committed_catalog_needs_no_new_snapshot(tmp_path: Path) -> None:
    # writing into a copy of the committed snapshots changes nothing
    for path in DEFAULT_SCHEMAS_DIR.glob("*/v*.json"):
        copy = tmp_path / path.parent.name / path.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(path.read_bytes())
    assert write_snapshots(tmp_path) == []
