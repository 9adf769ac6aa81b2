"""The services' AsyncAPI documents (FastStream's, built as each service declares its messaging, no server) and
`weir events check`: every event subject with the catalog's schema, and no drift between documents and snapshots."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote

import asyncpg
import pytest
from pydantic import Field
from typer.testing import CliRunner

from shared.bus import HDR_LEGACY_COPY, HDR_MSG_ID, HDR_VERSION
from shared.consumer import ConsumerSpec
from shared.contracts import contract, origin_of
from shared.events import (
    CATALOG,
    DEFAULT_SCHEMAS_DIR,
    Event,
    EventData,
    UploadCompleted,
    check_catalog,
    dlq_subject,
    write_snapshots,
)
from shared.events.documents import check_documents, documented_events
from shared.metrics import Metrics
from shared.publishers import HINTS
from shared.runtime import Runtime, ServiceDefinition, messaging_document
from shared.settings import CommonSettings
from weir.cli import SERVICE_SETTINGS, app, service_documents

SERVICES = list(SERVICE_SETTINGS)


def definition(service: str) -> ServiceDefinition:
    found = importlib.import_module(f"services.{service}.app").SERVICE
    assert isinstance(found, ServiceDefinition)
    return found


def operations(document: dict[str, Any]) -> dict[str, set[str]]:
    """The addresses the document says the service sends to and receives from."""
    by_action: dict[str, set[str]] = {"send": set(), "receive": set()}
    for operation in document["operations"].values():
        channel = unquote(operation["channel"]["$ref"].rsplit("/", 1)[1])
        by_action[operation["action"]].add(document["channels"][channel]["address"])
    return by_action


@pytest.mark.parametrize("service", SERVICES)
def test_each_document_lists_what_the_service_publishes_and_consumes_with_the_catalog_schemas(service: str) -> None:
    d = definition(service)
    document = messaging_document(d)
    sends, receives = operations(document)["send"], operations(document)["receive"]
    assert {contract(t).template for t in d.publishes} <= sends  # its account subject (`{account_id}`)
    assert {t for t in d.publishes if contract(t).legacy} <= sends  # and the copy on the bare type
    shown = {event.event_type for event in documented_events(service, document)}
    assert set(d.publishes) <= shown
    specs = d.consumers(Runtime(definition=d, settings=d.settings_cls(), metrics=Metrics(service)))
    for spec in specs:
        assert set(spec.subjects) <= receives  # the durable's subjects
        assert f"replay.{spec.name}.>" in receives  # and its replay durable's
        assert {dlq_subject(t) for t in spec.types} <= sends  # where it parks what it cannot handle
        assert set(spec.types) <= shown
    assert check_documents({service: document}) == []


def sent_events(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(event type, channel name, channel) of each event the document says the service sends."""
    found = []
    for operation in document["operations"].values():
        name = unquote(operation["channel"]["$ref"].rsplit("/", 1)[1])
        channel = document["channels"][name]
        origin = origin_of(channel["address"])
        if operation["action"] == "send" and origin is not None and origin[0] in CATALOG:
            found.append((origin[0], name, channel))
    return found


@pytest.fixture(scope="module")
def documents() -> dict[str, dict[str, Any]]:
    return {service: messaging_document(definition(service)) for service in SERVICES}


def test_each_event_channel_says_how_its_type_is_published(documents: dict[str, dict[str, Any]]) -> None:
    """From the outbox (acknowledged, sent again until it is), or straight to its stream as a hint: media's
    encode.progress, which a lost one's next replaces."""
    seen = set()
    for document in documents.values():
        for event_type, name, channel in sent_events(document):
            seen.add(event_type)
            stream = contract(event_type).stream
            if event_type in HINTS:
                assert channel["description"].count(f"A hint, published by its publisher straight into stream "
                                                    f"{stream} as it happens, not from an outbox") == 1, name
                assert "Published from its publisher's outbox" not in channel["description"], name
            else:
                assert f"Published from its publisher's outbox into stream {stream} " in channel["description"], name
    progress = documents["media"]["channels"]["encode.progress"]["description"]
    assert "a lost one is followed by the next" in progress
    assert {"encode.progress", "encode.started", "video.created", "key.created"} <= seen


def test_each_event_channel_names_its_headers_and_its_subjects_parameters(
        documents: dict[str, dict[str, Any]]) -> None:
    """FastStream's publishers declare no message headers nor channel parameters in AsyncAPI, and give every message
    a `correlationId` in a `correlation_id` header no event carries: the channel's description says what is."""
    for document in documents.values():
        for event_type, name, channel in sent_events(document):
            text = channel["description"]
            copy = channel["address"] == event_type and contract(event_type).template != event_type
            assert f"`{HDR_MSG_ID}`" in text and f"`{HDR_VERSION}`" in text, name
            assert (f"`{HDR_LEGACY_COPY}: 1`" in text) is copy, name
            assert ("`traceparent` (W3C trace context of the publish" in text) is not copy, name
            assert "No `correlation_id` header" in text, name
            message = document["components"]["messages"][f"{name}:Message"]
            assert message["correlationId"] == {"location": "$message.header#/correlation_id"}  # FastStream's own
            if not copy:
                for token in contract(event_type).tokens:
                    assert f"`{{{token}}}`: " in text, (name, token)
    encode = documents["encode"]["channels"]
    assert "`{account_id}`: the account the event is about" in encode["encode.started"]["description"]
    assert "`{publisher}`: the publisher identity's name" in encode["publisher.rejected"]["description"]


def test_an_event_schemas_type_says_the_subject_it_travels_on(documents: dict[str, dict[str, Any]]) -> None:
    """Since 1.1.0 a public event's subject is `<type>.<account_id>`, not its type."""
    schemas = documents["media"]["components"]["schemas"]
    progress = schemas["EncodeProgressEvent"]["properties"]["type"]["description"]
    assert progress.startswith("The event type. Its NATS subject is `encode.progress.{account_id}`")
    assert "the bare type `encode.progress` when a value is not known" in progress
    key = documents["auth"]["components"]["schemas"]["KeyCreatedEvent"]["properties"]["type"]["description"]
    assert key == "The event type, also its NATS subject."
    for document in documents.values():
        for schema in document["components"]["schemas"].values():
            described = schema.get("properties", {}).get("type", {}).get("description", "")
            event_type = schema.get("properties", {}).get("type", {}).get("const")
            if event_type in CATALOG and contract(event_type).subject:
                assert "also its NATS subject" not in described and f"`{contract(event_type).template}`" in described


def test_the_consumers_of_encode_and_api_take_the_catalog_models() -> None:
    """Each message a consumer takes is one event of the catalog (a union of them, for a consumer of several)."""
    encode = messaging_document(definition("encode"))
    payload = encode["components"]["messages"]["encode_uploads:upload.completed.*:SubscribeMessage"]["payload"]
    assert payload == {"$ref": "#/components/schemas/UploadCompletedEvent"}
    api = messaging_document(definition("api"))
    union = api["components"]["schemas"]["api_status:Message:Payload"]
    assert union["discriminator"] == "type"
    assert {branch["$ref"].rsplit("/", 1)[1] for branch in union["oneOf"]} == {
        "EncodeStartedEvent", "EncodeProgressEvent", "EncodeCompletedEvent", "EncodeFailedEvent", "DispatchBusyEvent"}


class UploadCompletedV2(UploadCompleted):
    """upload.completed as the catalog might evolve it: a new optional field, the next version."""

    version: ClassVar[int] = UploadCompleted.version + 1

    duration_seconds: float | None = Field(default=None, description="How long the video plays.")


def test_a_catalog_change_the_documents_do_not_show_fails_the_check(tmp_path: Path) -> None:
    """The catalog moves upload.completed to its next version (its snapshot recorded, the change compatible), but the
    services still document the current one: the snapshots alone are content, the documents are not."""
    schemas = tmp_path / "schemas"
    shutil.copytree(DEFAULT_SCHEMAS_DIR, schemas)
    catalog: dict[str, type[EventData]] = {**CATALOG, "upload.completed": UploadCompletedV2}
    write_snapshots(schemas, catalog)
    assert check_catalog(schemas, catalog) == []

    problems = check_documents(service_documents(), schemas, catalog)

    assert problems, "the documents still show upload.completed's current version"
    assert all("upload.completed" in p for p in problems)
    # the api publishes it; encode and webhooks consume it
    assert {p.split("'s AsyncAPI")[0].rsplit(" ", 1)[1] for p in problems} == {"api", "encode", "webhooks"}
    now, then = UploadCompleted.version, UploadCompletedV2.version
    assert all(f"shows v{now}, but the catalog is at v{then}" in p for p in problems)


class StaleUploadCompleted(EventData):
    """A service's own copy of upload.completed, drifted from the catalog: `size` became a string."""

    event_type: ClassVar[str] = "upload.completed"
    version: ClassVar[int] = UploadCompleted.version

    video_id: str
    app_id: str
    account_id: str
    key_id: str
    object_key: str
    size: str
    content_type: str
    source_height: int | None


async def _read_stale(conn: asyncpg.Connection, event: Event[StaleUploadCompleted]) -> None:
    """A handler typed on the stale copy."""


def test_a_document_whose_handler_reads_another_schema_fails_the_check() -> None:
    stale = ServiceDefinition(name="encode", settings_cls=CommonSettings,
                              consumers=lambda rt: [ConsumerSpec(name="encode_uploads", handler=_read_stale)])
    problems = check_documents({"stale": messaging_document(stale)})
    assert len(problems) == 1
    assert "upload.completed in stale's AsyncAPI document" in problems[0]
    assert "`size` changed type from integer to string" in problems[0]


def test_weir_events_check_passes_on_the_committed_tree() -> None:
    result = CliRunner().invoke(app, ["events", "check"])
    assert result.exit_code == 0, result.output
    assert "AsyncAPI documents of auth, api, encode, media, sweep" in " ".join(result.output.split())
