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

from shared.consumer import ConsumerSpec
from shared.contracts import contract
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
    """upload.completed as the catalog might evolve it: a new optional field, version 2."""

    version: ClassVar[int] = 2

    duration_seconds: float | None = Field(default=None, description="How long the video plays.")


def test_a_catalog_change_the_documents_do_not_show_fails_the_check(tmp_path: Path) -> None:
    """The catalog moves upload.completed to v2 (its snapshot recorded, the change compatible), but the services
    still document v1: the snapshots alone are content, the documents are not."""
    schemas = tmp_path / "schemas"
    shutil.copytree(DEFAULT_SCHEMAS_DIR, schemas)
    catalog: dict[str, type[EventData]] = {**CATALOG, "upload.completed": UploadCompletedV2}
    write_snapshots(schemas, catalog)
    assert check_catalog(schemas, catalog) == []

    problems = check_documents(service_documents(), schemas, catalog)

    assert problems, "the documents still show upload.completed v1"
    assert all("upload.completed" in p for p in problems)
    # the api publishes it; encode and webhooks consume it
    assert {p.split("'s AsyncAPI")[0].rsplit(" ", 1)[1] for p in problems} == {"api", "encode", "webhooks"}
    assert all("shows v1, but the catalog is at v2" in p for p in problems)


class StaleUploadCompleted(EventData):
    """A service's own copy of upload.completed v1, drifted from the catalog: `size` became a string."""

    event_type: ClassVar[str] = "upload.completed"
    version: ClassVar[int] = 1

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
