"""The event schemas in the services' AsyncAPI documents, held to the catalog's snapshots (`weir events check`).

In each service's `/asyncapi.json` (FastStream's, from its handlers and publishers) an event is the schema of
`Event[M]`; it must be its type's current catalog version, its `data` exactly that snapshot, so neither side changes
unnoticed. `check_routing` holds each document to shared/contracts.py: the service sends exactly the event types it
is declared to publish and receives exactly those its consumers (and, where shown, its own subscribers) read.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from shared import contracts
from shared.events.base import EventData
from shared.events.catalog import CATALOG
from shared.events.compat import DEFAULT_SCHEMAS_DIR, differences, snapshot_path
from shared.events.envelope import SCHEMA_VERSION_KEY

_COMPONENT_REF = "#/components/schemas/"


@dataclass(frozen=True)
class DocumentedEvent:
    """One event schema in one service's document."""

    service: str
    name: str  # its key under components.schemas
    event_type: str
    version: int | None
    data: dict[str, Any]  # the data's schema with its $refs resolved


def documented_events(service: str, document: Mapping[str, Any]) -> Iterator[DocumentedEvent]:
    """The event envelopes among a document's schemas (a `type` constant, a `data` property)."""
    schemas: Mapping[str, Any] = document.get("components", {}).get("schemas", {})
    for name, schema in schemas.items():
        properties = schema.get("properties", {}) if isinstance(schema, Mapping) else {}
        event_type = properties.get("type", {}).get("const") if isinstance(properties.get("type"), Mapping) else None
        if not isinstance(event_type, str) or "data" not in properties:
            continue
        version = schema.get(SCHEMA_VERSION_KEY)
        yield DocumentedEvent(service, name, event_type, version if isinstance(version, int) else None,
                              _inline(properties["data"], schemas))


def check_documents(
    documents: Mapping[str, Mapping[str, Any]],
    schemas_dir: Path = DEFAULT_SCHEMAS_DIR,
    catalog: Mapping[str, type[EventData]] | None = None,
) -> list[str]:
    """Every disagreement between the documents' event schemas and the catalog's snapshots; [] when they agree."""
    catalog = CATALOG if catalog is None else catalog
    problems: list[str] = []
    for service, document in documents.items():
        for event in documented_events(service, document):
            where = f"{event.event_type} in {service}'s AsyncAPI document ({event.name})"
            model = catalog.get(event.event_type)
            if model is None:
                problems.append(f"{where}: the type is not in the catalog")
                continue
            if event.version is None:
                problems.append(f"{where}: it does not say its version (`{SCHEMA_VERSION_KEY}`)")
                continue
            if event.version != model.version:
                problems.append(f"{where} shows v{event.version}, but the catalog is at v{model.version}: the "
                                "service does not read or write the catalog's current model")
            path = snapshot_path(schemas_dir, event.event_type, event.version)
            try:
                snapshot = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                problems.append(f"{where}: no readable snapshot of v{event.version} ({exc})")
                continue
            changes = differences(snapshot, event.data)
            if changes:
                problems.append(f"{where} differs from the snapshot of v{event.version}: {'; '.join(changes)}")
    return problems


def event_channels(document: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """The event types a document sends and receives (on any of their subjects: `video.created.{account_id}`, the
    wildcard `video.created.*`, the bare type)."""
    sends: set[str] = set()
    receives: set[str] = set()
    channels: Mapping[str, Any] = document.get("channels", {})
    for operation in document.get("operations", {}).values():
        name = unquote(operation["channel"]["$ref"].rsplit("/", 1)[1])
        found = contracts.origin_of(channels[name]["address"])
        if found is not None and found[0] in CATALOG:
            (sends if operation["action"] == "send" else receives).add(found[0])
    return sends, receives


def check_routing(documents: Mapping[str, Mapping[str, Any]], *, complete: bool = False) -> list[str]:
    """Every difference between what the documents send and receive and what shared/contracts.py declares.

    `complete`: the documents show every subscriber of the service (its `on_start` ones too), so the events it hears
    live must be there; otherwise they may be."""
    problems: list[str] = []
    for service, document in documents.items():
        sends, receives = event_channels(document)
        declared_sends = set(contracts.published_by(service))
        declared_receives = contracts.received_by(service)
        if not complete:
            receives |= set(contracts.heard_by(service))
        for what, shown, declared in (("publishes", sends, declared_sends), ("consumes", receives, declared_receives)):
            if extra := sorted(shown - declared):
                problems.append(f"{service}'s AsyncAPI document {what} {extra}, which shared/contracts.py does not "
                                f"declare")
            if missing := sorted(declared - shown):
                problems.append(f"{service}'s AsyncAPI document does not show that it {what} {missing}, as "
                                "shared/contracts.py declares")
    return problems


def _inline(node: Any, schemas: Mapping[str, Any], depth: int = 0) -> Any:
    """A copy of `node` with the document's `#/components/schemas/...` references replaced by what they name."""
    if depth > 32:
        raise ValueError("schema references nest too deep (a recursive schema?)")
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_COMPONENT_REF):
            target = schemas[ref[len(_COMPONENT_REF):]]
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return _inline({**target, **rest}, schemas, depth + 1)
        return {k: _inline(v, schemas, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(item, schemas, depth + 1) for item in node]
    return copy.deepcopy(node)
