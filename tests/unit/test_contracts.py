"""shared/contracts.py, the one declaration of the bus: it is consistent, it covers the catalog and stays within SPEC 7,
every service runs exactly the consumers declared for it with the handlers' event types, and the subjects it names are
written nowhere else."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import asyncpg
import pytest

from shared import contracts
from shared.consumer import ConsumerSpec
from shared.contracts import (
    CONSUMERS,
    EVENTS,
    PUBLISHER,
    ContractError,
    EventContract,
    consumed_by,
    consumers_of,
    published_by,
)
from shared.events import CATALOG, Event, KeyCreated, UploadCompleted
from shared.events.documents import check_routing
from shared.metrics import Metrics
from shared.runtime import Runtime, ServiceDefinition, declared_consumer, messaging_document
from shared.settings import CommonSettings
from shared.streams import STREAMS, stream_for_subject
from weir.cli import SERVICE_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
SERVICES = list(SERVICE_SETTINGS)

# SPEC section 7's table, "published by": the declaration may narrow it (encode and media share the encoding events
# and each publishes its own), never widen it
SPEC_7_PUBLISHERS: dict[str, set[str]] = {
    "credential.rejected": {"auth"}, "key.created": {"auth"}, "key.revoked": {"auth"},
    "video.created": {"api"}, "video.deleted": {"api"}, "upload.completed": {"api"},
    "video.ready": {"api"}, "video.failed": {"api"},  # the outcome of what the api shows (its status projection)
    "video.captions_changed": {"api"},  # the api keeps a video's caption tracks
    "recording.completed": {PUBLISHER}, "dispatch.busy": {"encode"},
    "encode.started": {"encode", "media"}, "encode.progress": {"encode", "media"},
    "encode.completed": {"encode", "media"}, "encode.failed": {"encode", "media"},
    "video.retired": {"sweep"},
    "publisher.rejected": {"encode"},  # SPEC 12: what encode refused of a team's events, told to that team
    "webhook.disabled": {"webhooks"},  # SPEC 1 and 13
}


def definition(service: str) -> ServiceDefinition:
    found = importlib.import_module(f"services.{service}.app").SERVICE
    assert isinstance(found, ServiceDefinition)
    return found


def consumer_specs(service: str) -> list[ConsumerSpec]:
    d = definition(service)
    return d.consumers(Runtime(definition=d, settings=CommonSettings(), metrics=Metrics(service)))


# ------------------------------------------------------------------------------------------ the declaration


def test_the_declaration_is_consistent() -> None:
    assert contracts.problems() == []


def test_every_catalog_event_type_has_exactly_one_contract_and_a_publisher() -> None:
    assert sorted(e.type for e in EVENTS) == sorted(CATALOG)
    for e in EVENTS:
        assert e.publishers, e.type
        assert set(e.publishers) <= SPEC_7_PUBLISHERS[e.type], e.type


def test_each_stream_keeps_exactly_the_event_types_declared_on_it() -> None:
    for e in EVENTS:
        for subject in e.subjects:
            assert stream_for_subject(subject).name == e.stream
    kept = {found[0] for spec in STREAMS for s in spec.subjects if (found := contracts.origin_of(s)) is not None}
    assert kept == set(CATALOG)


@pytest.mark.parametrize("broken", [
    dataclasses.replace(EVENTS[0], publishers=()),
    dataclasses.replace(EVENTS[0], consumers=("nobody_reads",)),
    dataclasses.replace(EVENTS[0], consumers=("api_status",)),  # api_status would read AUTH and ENCODE
], ids=["no publisher", "undeclared consumer", "consumer on two streams"])
def test_an_inconsistent_declaration_is_refused(broken: EventContract, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contracts, "EVENTS", (broken, *EVENTS[1:]))
    assert contracts.problems()


def test_a_consumer_nobody_reads_through_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contracts, "CONSUMERS", (*CONSUMERS, contracts.ConsumerContract("api_idle", "api", "x")))
    assert contracts.problems() == ["consumer api_idle reads no event type"]


# ------------------------------------------------------------------------------------------ the services


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_exactly_its_declared_consumers_with_the_declared_event_types(service: str) -> None:
    specs = {spec.name: spec for spec in consumer_specs(service)}
    assert set(specs) == {c.name for c in consumers_of(service)}
    for name, spec in specs.items():
        assert sorted(spec.types) == sorted(consumed_by(name))  # the handler's annotation is the declaration
        assert spec.stream == contracts.contract(spec.types[0]).stream


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_publishes_what_is_declared_for_it(service: str) -> None:
    assert definition(service).publishes == published_by(service)


async def _reads_uploads(conn: asyncpg.Connection, event: Event[UploadCompleted]) -> None: ...


async def _reads_keys(conn: asyncpg.Connection, event: Event[KeyCreated]) -> None: ...


def test_a_consumer_the_declaration_does_not_have_refuses_to_start() -> None:
    with pytest.raises(ContractError, match="not declared"):
        declared_consumer("encode", ConsumerSpec(name="encode_extra", handler=_reads_uploads))
    with pytest.raises(ContractError, match="declared as encode's"):
        declared_consumer("api", ConsumerSpec(name="encode_uploads", handler=_reads_uploads))
    with pytest.raises(ContractError, match="declares"):
        declared_consumer("encode", ConsumerSpec(name="encode_uploads", handler=_reads_keys))
    taken = declared_consumer("encode", ConsumerSpec(name="encode_uploads", handler=_reads_uploads))
    assert taken.description == contracts.consumer_contract("encode_uploads").description
    extra = ServiceDefinition(name="encode", settings_cls=CommonSettings,
                              consumers=lambda rt: [ConsumerSpec(name="encode_extra", handler=_reads_uploads)])
    with pytest.raises(ContractError):
        messaging_document(extra)


def test_a_declared_consumer_no_service_runs_fails_the_documents_check() -> None:
    none = ServiceDefinition(name="encode", settings_cls=CommonSettings)
    problems = check_routing({"encode": messaging_document(none)})
    assert problems == [f"encode's AsyncAPI document does not show that it consumes "
                        f"{sorted(contracts.received_by('encode'))}, as shared/contracts.py declares"]


def test_a_document_that_publishes_an_undeclared_event_fails_the_check() -> None:
    document = messaging_document(definition("sweep"))
    assert check_routing({"sweep": document}) == []
    assert check_routing({"media": document}) == [
        "media's AsyncAPI document publishes ['video.retired'], which shared/contracts.py does not declare",
        "media's AsyncAPI document does not show that it publishes ['encode.progress'], as shared/contracts.py "
        "declares"]


# ------------------------------------------------------------------------------------------ subjects, once

# the subjects shared/contracts.py declares (and authcheck.py auth's requests, media/protocol.py encode.status): a
# whole subject, or a root whose subjects are built from it (`limits` alone is a word, `limits.x` a subject)
SUBJECTS = ("auth.spent", "sweep.run", "auth.check", "auth.manage", "encode.status")
ROOTS = ("limits", "dlq", "replay", *SUBJECTS)
DECLARED_IN = {"shared/contracts.py", "shared/authcheck.py", "shared/media/protocol.py"}


def _subject_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants (an f-string's parts too) that are, or begin, a subject under one of ROOTS; docstrings
    aside."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
            continue
        text = node.value
        if " " not in text and (text in SUBJECTS or any(text.startswith(f"{root}.") for root in ROOTS)):
            found.append((node.lineno, text))
    return found


def test_each_subject_name_is_written_in_one_module() -> None:
    written = []
    for folder in ("services", "shared", "weir"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in DECLARED_IN:
                continue
            written += [f"{where}:{line}: {text!r}" for line, text in _subject_literals(ast.parse(path.read_text()))]
    assert written == []


def test_the_literal_search_finds_what_it_looks_for() -> None:
    tree = ast.parse('"""dlq.x in a docstring"""\nA = "auth.spent"\nB = f"replay.{c}.>"\nC = "limits"\n'
                     'D = "a dlq.x"\nE = "limits.>"\n')
    assert sorted(_subject_literals(tree)) == [(2, "auth.spent"), (3, "replay."), (6, "limits.>")]
