"""The contract snapshot of a release: every event, every request/reply contract (both models) and the api's public
OpenAPI document, as committed under contracts/<version>/ (SPEC 11).

    contracts/<version>/events/<type>.json         type, version, publishers, readers, schema
    contracts/<version>/envelope.json              the envelope every event travels in
    contracts/<version>/requests/<subject>.json    subject, version, responder, callers, request and replies' schemas
    contracts/<version>/openapi/api.json           the api's public routes (operations and internal ones left out)

Pretty-printed with sorted keys, so a diff shows what changed. `collect()` reads the code on `sys.path`; run as a file
(`PYTHONPATH=<checkout> python shared/contractsnap.py --out DIR`) it snapshots another checkout, e.g. an older
release's: its models and event declarations, and this file's request/reply declarations where that release has none.
Imports Weir's code only inside `collect`, so it runs against any checkout.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

EVENTS_DIR, REQUESTS_DIR, OPENAPI_DIR = "events", "requests", "openapi"
MANIFEST, ENVELOPE = "release.json", "envelope.json"
ENVELOPE_MODEL = "shared.events.envelope:Envelope"
PRIVATE_TAGS = frozenset({"operations", "internal"})  # the api's routes outside its public contract
_DECLARATIONS = Path(__file__).resolve().with_name("contracts.py")
CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"  # at the repository's root


def snapshot_dir(version: str) -> Path:
    """Where release `version`'s contracts are committed."""
    return CONTRACTS_DIR / version


def collect(declarations: ModuleType | None = None) -> dict[str, Any]:
    """{"events": {type: entry}, "envelope": entry, "requests": {subject: entry}, "openapi": {"api": document}} of the
    code on sys.path.

    `declarations`: where the request/reply contracts are declared (shared.contracts, or this file's copy of it for
    a checkout that declares none)."""
    from shared import contracts
    from shared.events.catalog import CATALOG

    declared = declarations or (contracts if hasattr(contracts, "REQUESTS") else _declarations_beside())
    services_of = {c.name: c.service for c in contracts.CONSUMERS}
    events: dict[str, Any] = {}
    for e in contracts.EVENTS:
        model = CATALOG[e.type]
        events[e.type] = {
            "type": e.type, "version": model.version, "publishers": sorted(e.publishers),
            "readers": sorted({services_of[c] for c in e.consumers} | set(e.listeners)), "public": e.public,
            # where it travels (`video.created.*`, and the bare type while kept beside): older releases have none,
            # which reads as the bare type alone
            "subjects": sorted(getattr(e, "subjects", (e.type,))),
            "model": f"{model.__module__}:{model.__qualname__}",
            "schema": model.model_json_schema(mode="validation"),
        }
    requests: dict[str, Any] = {}
    for r in declared.REQUESTS:
        requests[r.subject] = {
            "subject": r.subject, "version": r.version, "responder": r.responder, "callers": sorted(r.callers),
            "beside": r.beside, "answered": bool(r.replies),
            # older checkouts declare no `optional`: every caller of theirs waits for its answer
            **({"optional": True} if getattr(r, "optional", False) else {}),
            "request": _model_entry(r.request), "replies": {_name(m): _model_entry(m) for m in r.replies},
        }
    return {"events": events, "envelope": _model_entry(ENVELOPE_MODEL), "requests": requests,
            "openapi": {"api": public_openapi()}}


def _name(model: str) -> str:
    return model.rsplit(":", 1)[1]


def _model_entry(model: str) -> dict[str, Any]:
    """A model's JSON schema (what a reader of it accepts), or `missing` when this code has no such model."""
    module_name, _, name = model.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return {"model": model, "missing": True}
    return {"model": model, "schema": found.model_json_schema(mode="validation")}


def _declarations_beside() -> ModuleType:
    """This file's shared/contracts.py, loaded under a name of its own (it imports nothing of Weir's)."""
    name = "_weir_declared_contracts"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _DECLARATIONS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def public_openapi() -> dict[str, Any]:
    """The api's OpenAPI document as its app serves it, without its operations and internal routes, the schemas
    only those use, or its version (the release, which changes every release)."""
    from services.api.app import offline_app

    document: dict[str, Any] = offline_app().openapi()
    paths: dict[str, Any] = {}
    for path, operations in document.get("paths", {}).items():
        public = {method: op for method, op in operations.items()
                  if isinstance(op, Mapping) and not PRIVATE_TAGS & set(op.get("tags", []))}
        if public:
            paths[path] = public
    schemas = document.get("components", {}).get("schemas", {})
    used = _reachable(paths, schemas)
    return {"openapi": document.get("openapi"), "info": {"title": document.get("info", {}).get("title")},
            "paths": paths, "components": {"schemas": {k: v for k, v in schemas.items() if k in used}}}


_COMPONENT = re.compile(r"^#/components/schemas/(.+)$")


def _reachable(node: Any, schemas: Mapping[str, Any]) -> set[str]:
    found: set[str] = set()
    todo = [node]
    while todo:
        item = todo.pop()
        if isinstance(item, Mapping):
            ref = item.get("$ref")
            match = _COMPONENT.match(ref) if isinstance(ref, str) else None
            if match and match.group(1) not in found and match.group(1) in schemas:
                found.add(match.group(1))
                todo.append(schemas[match.group(1)])
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


# --- files ----------------------------------------------------------------------------------------------------


def render(value: Any) -> str:
    """A snapshot file's exact text: pretty-printed, sorted keys, a trailing newline."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def file_name(subject: str) -> str:
    """A subject as a file name: `farm.offer.{instance}` -> `farm.offer.instance.json`."""
    return re.sub(r"[{}]", "", subject) + ".json"


def files(snapshot: Mapping[str, Any]) -> dict[str, str]:
    """Each file of the snapshot (its path under contracts/<version>/) and its text."""
    out = {f"{EVENTS_DIR}/{file_name(t)}": render(e) for t, e in snapshot["events"].items()}
    out |= {f"{REQUESTS_DIR}/{file_name(s)}": render(r) for s, r in snapshot["requests"].items()}
    out |= {f"{OPENAPI_DIR}/{name}.json": render(doc) for name, doc in snapshot["openapi"].items()}
    if "envelope" in snapshot:
        out[ENVELOPE] = render(snapshot["envelope"])
    if "release" in snapshot:
        out[MANIFEST] = render(snapshot["release"])
    return out


def write(snapshot: Mapping[str, Any], directory: Path) -> list[Path]:
    """Writes the snapshot under `directory` (replacing what was there), and returns the files written."""
    written: list[Path] = []
    wanted = files(snapshot)
    for sub in (EVENTS_DIR, REQUESTS_DIR, OPENAPI_DIR):
        if (directory / sub).is_dir():
            for stale in (directory / sub).glob("*.json"):
                if f"{sub}/{stale.name}" not in wanted:
                    stale.unlink()
    for relative, text in wanted.items():
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


def load(directory: Path) -> dict[str, Any]:
    """A snapshot written by `write`; FileNotFoundError when there is none."""
    if not directory.is_dir():
        raise FileNotFoundError(f"no contract snapshot at {directory}")

    def each(sub: str) -> list[dict[str, Any]]:
        return [json.loads(p.read_text(encoding="utf-8")) for p in sorted((directory / sub).glob("*.json"))]

    snapshot: dict[str, Any] = {
        "events": {e["type"]: e for e in each(EVENTS_DIR)},
        "requests": {r["subject"]: r for r in each(REQUESTS_DIR)},
        "openapi": {p.stem: json.loads(p.read_text(encoding="utf-8"))
                    for p in sorted((directory / OPENAPI_DIR).glob("*.json"))},
    }
    if (directory / ENVELOPE).is_file():
        snapshot["envelope"] = json.loads((directory / ENVELOPE).read_text(encoding="utf-8"))
    if (directory / MANIFEST).is_file():
        snapshot["release"] = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    return snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the contract snapshot of the code on PYTHONPATH")
    parser.add_argument("--out", type=Path, required=True, help="the directory: contracts/<version>")
    parser.add_argument("--version", default="", help="the release's version, for release.json")
    parser.add_argument("--commit", default="", help="the release's commit, for release.json")
    args = parser.parse_args(argv)
    snapshot = collect()
    if args.version:
        snapshot["release"] = {"version": args.version, "commit": args.commit}
    for path in write(snapshot, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    # run as a file: this file's folder must not shadow the checkout's modules (shared/logs.py is not `logs`)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
