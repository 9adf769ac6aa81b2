"""Schema snapshots of the event catalog (`schemas/<type>/v<N>.json`), and the check that events evolve compatibly.

A published version never changes, and each version stays compatible with all older ones, both ways: new readers
read old events (replays bring back weeks-old ones) and old readers read new ones. So the only compatible change is a
new optional property; a removed property, a new required one, or any change to a property's type (compared through
`$ref`, `anyOf`, `items`, nested objects: type, format, enum, const, constraints) is refused, widening too (`int` to
`int | None`, a new enum member: old readers break on the first such value). Titles, descriptions, defaults are free.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.compat import once
from shared.events.base import EventData
from shared.events.catalog import CATALOG
from shared.tolerant import FALLBACK_KEYWORD

DEFAULT_SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
SNAPSHOT_COMMAND = "weir events snapshot"

_SNAPSHOT_NAME = re.compile(r"^v([1-9][0-9]*)\.json$")

# Keywords that describe a value without constraining it (a closed set's fallback changes how it is read, not what
# is written: shared/compat.py judges it).
_DOC_KEYWORDS = frozenset(
    {"title", "description", "examples", "$comment", "deprecated", "readOnly", "writeOnly", FALLBACK_KEYWORD}
)
# Keywords the walk below handles itself.
_STRUCTURAL = frozenset(
    {
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "type",
        "anyOf",
        "oneOf",
        "allOf",
        "items",
        "prefixItems",
        "additionalProperties",
        "enum",
        "const",
    }
)
_MISSING = object()


class SnapshotRefused(ValueError):
    """`write_snapshots` would record an incompatible or silently changed schema; `reasons` says why."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("refusing to write event schema snapshots:\n" + "\n".join(f"- {r}" for r in reasons))


# --- snapshots ----------------------------------------------------------------------------------------------


def schema_of(model: type[EventData]) -> dict[str, Any]:
    """The JSON Schema of a payload model, as snapshotted (validation mode: what a reader accepts)."""
    return model.model_json_schema(mode="validation")


def render_schema(schema: Mapping[str, Any]) -> str:
    """A snapshot file's exact text: pretty-printed, sorted keys, trailing newline, so diffs are stable."""
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def snapshot_path(schemas_dir: Path, event_type: str, version: int) -> Path:
    return schemas_dir / event_type / f"v{version}.json"


def _snapshots(type_dir: Path) -> tuple[dict[int, Path], list[str]]:
    """The snapshot files of one event type by version, and complaints about anything else in its folder."""
    found: dict[int, Path] = {}
    strays: list[str] = []
    if type_dir.is_dir():
        for path in sorted(type_dir.iterdir()):
            match = _SNAPSHOT_NAME.match(path.name)
            if match and path.is_file():
                found[int(match.group(1))] = path
            elif not path.name.startswith("."):
                strays.append(f"{type_dir.name}: unexpected file {path}, snapshots are named v<N>.json")
    return found, strays


def _load(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _UnreadableSnapshot(f"cannot read snapshot {path}: {e}") from None
    if not isinstance(loaded, dict):
        raise _UnreadableSnapshot(f"cannot read snapshot {path}: not a JSON object")
    return loaded


class _UnreadableSnapshot(Exception):
    pass


def _model_problems(event_type: str, model: type[EventData]) -> list[str]:
    problems = []
    declared = getattr(model, "event_type", None)
    if declared != event_type:
        problems.append(f"{event_type}: registered model {model.__name__} has event_type {declared!r}")
    version = getattr(model, "version", None)
    if not isinstance(version, int) or version < 1:
        problems.append(f"{event_type}: {model.__name__}.version must be an int from 1, not {version!r}")
    return problems


def check_catalog(
    schemas_dir: Path = DEFAULT_SCHEMAS_DIR, catalog: Mapping[str, type[EventData]] | None = None
) -> list[str]:
    """Every problem with the catalog's snapshots; [] when all is well.

    For each model: the snapshot of its current version exists and equals its schema, the snapshots of all
    older versions exist, and the current schema is compatible with each of them. Every snapshot directory
    must still be a type in the catalog: removing an event type is an incompatible change.
    """
    catalog = CATALOG if catalog is None else catalog
    problems: list[str] = []
    for event_type, model in catalog.items():
        model_problems = _model_problems(event_type, model)
        if model_problems:
            problems += model_problems
            continue
        version = model.version
        schema = schema_of(model)
        snapshots, strays = _snapshots(schemas_dir / event_type)
        problems += strays
        try:
            current = snapshots.get(version)
            if current is None:
                problems.append(f"{event_type}: snapshot v{version} is missing, run `{SNAPSHOT_COMMAND}`")
            elif current.read_text(encoding="utf-8") != render_schema(schema):
                changes = differences(_load(current), schema)
                if changes:
                    problems.append(_changed_without_bump(event_type, version, changes))
                else:
                    problems.append(
                        f"{event_type}: snapshot v{version} is out of date (documentation or formatting "
                        f"only), run `{SNAPSHOT_COMMAND}`"
                    )
            for older in range(1, version):
                if older not in snapshots:
                    problems.append(
                        f"{event_type}: snapshot v{older} is missing; snapshots of published versions are "
                        "never deleted, restore it from version control"
                    )
                    continue
                problems += [
                    f"{event_type} v{older} -> v{version}: {reason}"
                    for reason in incompatibilities(_load(snapshots[older]), schema)
                ]
        except _UnreadableSnapshot as e:
            problems.append(f"{event_type}: {e}")
        problems += [
            f"{event_type}: snapshot v{newer} exists but {model.__name__} is at version {version}; "
            "versions never go down"
            for newer in snapshots
            if newer > version
        ]
    if schemas_dir.is_dir():
        problems += [
            f"{path.name}: snapshots exist but the type is not in the catalog; removing an event type is an "
            "incompatible change"
            for path in sorted(schemas_dir.iterdir())
            if path.is_dir() and not path.name.startswith((".", "_")) and path.name not in catalog
        ]
    return problems


def write_snapshots(
    schemas_dir: Path = DEFAULT_SCHEMAS_DIR, catalog: Mapping[str, type[EventData]] | None = None
) -> list[Path]:
    """Writes the snapshot of each model's current version, and returns the files written (new or rewritten).

    Writes nothing and raises `SnapshotRefused` if any current schema is incompatible with an older snapshot,
    or differs from the existing snapshot of its own version in more than documentation (that needs a new
    version). A snapshot whose schema is unchanged but whose text is stale (a docstring, formatting) is
    rewritten.
    """
    catalog = CATALOG if catalog is None else catalog
    refusals: list[str] = []
    planned: list[tuple[Path, str]] = []
    for event_type, model in catalog.items():
        model_problems = _model_problems(event_type, model)
        if model_problems:
            refusals += model_problems
            continue
        version = model.version
        schema = schema_of(model)
        text = render_schema(schema)
        snapshots, _ = _snapshots(schemas_dir / event_type)
        try:
            for older, path in sorted(snapshots.items()):
                if older < version:
                    refusals += [
                        f"{event_type} v{older} -> v{version}: {reason}"
                        for reason in incompatibilities(_load(path), schema)
                    ]
                elif older > version:
                    refusals.append(
                        f"{event_type}: snapshot v{older} exists but {model.__name__} is at version {version}"
                    )
            target = snapshot_path(schemas_dir, event_type, version)
            if version in snapshots:
                if snapshots[version].read_text(encoding="utf-8") == text:
                    continue
                changes = differences(_load(snapshots[version]), schema)
                if changes:
                    refusals.append(_changed_without_bump(event_type, version, changes))
                    continue
            planned.append((target, text))
        except _UnreadableSnapshot as e:
            refusals.append(f"{event_type}: {e}")
    if refusals:
        raise SnapshotRefused(refusals)
    for target, text in planned:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return [target for target, _ in planned]


def _changed_without_bump(event_type: str, version: int, changes: list[str]) -> str:
    return (
        f"{event_type}: the schema changed but its version did not: v{version} differs from its snapshot "
        f"({'; '.join(changes)}). A published version never changes: add the field as optional, raise "
        f"`version` to {version + 1} and run `{SNAPSHOT_COMMAND}`"
    )


# --- comparing two schemas ---------------------------------------------------------------------------------


def incompatibilities(old_schema: Mapping[str, Any], new_schema: Mapping[str, Any]) -> list[str]:
    """Why `new_schema` is not a compatible evolution of `old_schema` (see the module docstring); [] if so."""
    walk = _Walk(old_schema, new_schema, ignored=_DOC_KEYWORDS | {"default"}, exact=False)
    walk.compare(old_schema, new_schema, "")
    return walk.reasons


def differences(old_schema: Mapping[str, Any], new_schema: Mapping[str, Any]) -> list[str]:
    """Every change from `old_schema` to `new_schema` other than documentation: added properties, changed
    defaults and required-ness included. [] means the two accept and produce the same events."""
    walk = _Walk(old_schema, new_schema, ignored=_DOC_KEYWORDS, exact=True)
    walk.compare(old_schema, new_schema, "")
    return walk.reasons


@dataclass
class _Walk:
    old_root: Mapping[str, Any]
    new_root: Mapping[str, Any]
    ignored: frozenset[str]
    exact: bool
    reasons: list[str] = field(default_factory=list)
    _comparing: set[tuple[str, str]] = field(default_factory=set)

    def compare(self, old: Any, new: Any, path: str) -> None:
        if not isinstance(old, Mapping) or not isinstance(new, Mapping):
            # A boolean schema (true/false) or something odd: compare it as a value.
            if old != new:
                self.reasons.append(f"{_where(path)} changed from {_show(old)} to {_show(new)}")
            return
        old_node, old_ref = _resolve(old, self.old_root)
        new_node, new_ref = _resolve(new, self.new_root)
        with once(self._comparing, old_ref, new_ref) as first_time:
            if first_time:
                self._compare_nodes(old_node, new_node, path)

    def _compare_nodes(self, old: Mapping[str, Any], new: Mapping[str, Any], path: str) -> None:
        if _shape(old, self.old_root) != _shape(new, self.new_root):
            self.reasons.append(
                f"{_where(path)} changed type from {_describe(old, self.old_root)} "
                f"to {_describe(new, self.new_root)}"
            )
            return
        for keyword in ("anyOf", "oneOf"):
            if keyword in old:
                for old_branch, new_branch in self._pair_branches(old[keyword], new[keyword]):
                    self.compare(old_branch, new_branch, path)
        if "allOf" in old or "allOf" in new:
            self._compare_lists(old.get("allOf", []), new.get("allOf", []), path, "allOf")
        old_values, new_values = _allowed_values(old), _allowed_values(new)
        if old_values != new_values:
            self.reasons.append(
                f"{_where(path)} changed its allowed values from {_show_values(old_values)} "
                f"to {_show_values(new_values)}"
            )
        if any(k in old or k in new for k in ("properties", "required")):
            self._compare_properties(old, new, path)
        self._compare_subschema(
            old.get("items", _MISSING), new.get("items", _MISSING), f"{path}[]", path, "items"
        )
        self._compare_subschema(
            old.get("additionalProperties", _MISSING),
            new.get("additionalProperties", _MISSING),
            f"{path}{{}}",
            path,
            "additionalProperties",
        )
        if "prefixItems" in old or "prefixItems" in new:
            self._compare_lists(old.get("prefixItems", []), new.get("prefixItems", []), path, "prefixItems")
        for keyword in sorted((old.keys() | new.keys()) - _STRUCTURAL - self.ignored):
            before, after = old.get(keyword, _MISSING), new.get(keyword, _MISSING)
            if before != after:
                self.reasons.append(
                    f"{_where(path)}: `{keyword}` changed from {_show(before)} to {_show(after)}"
                )

    def _compare_properties(self, old: Mapping[str, Any], new: Mapping[str, Any], path: str) -> None:
        old_props: Mapping[str, Any] = old.get("properties", {})
        new_props: Mapping[str, Any] = new.get("properties", {})
        old_required, new_required = set(old.get("required", [])), set(new.get("required", []))
        for name, old_prop in old_props.items():
            child = f"{path}.{name}" if path else name
            if name not in new_props:
                self.reasons.append(f"property `{child}` was removed")
                continue
            if name in new_required and name not in old_required:
                self.reasons.append(f"property `{child}` became required")
            elif self.exact and name in old_required and name not in new_required:
                self.reasons.append(f"property `{child}` became optional")
            self.compare(old_prop, new_props[name], child)
        for name in new_props.keys() - old_props.keys():
            child = f"{path}.{name}" if path else name
            if name in new_required:
                self.reasons.append(f"new property `{child}` is required; readers of older events would fail")
            elif self.exact:
                self.reasons.append(f"property `{child}` was added")

    def _compare_subschema(self, old: Any, new: Any, child: str, path: str, keyword: str) -> None:
        if old is _MISSING and new is _MISSING:
            return
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            self.compare(old, new, child)
        elif old != new:
            self.reasons.append(f"{_where(path)}: `{keyword}` changed from {_show(old)} to {_show(new)}")

    def _compare_lists(self, old: list[Any], new: list[Any], path: str, keyword: str) -> None:
        if len(old) != len(new):
            self.reasons.append(f"{_where(path)}: `{keyword}` changed from {len(old)} to {len(new)} schemas")
            return
        for index, (old_item, new_item) in enumerate(zip(old, new, strict=True)):
            self.compare(old_item, new_item, f"{path}[{index}]" if keyword == "prefixItems" else path)

    def _pair_branches(self, old: list[Any], new: list[Any]) -> list[tuple[Any, Any]]:
        """Pairs the branches of two unions by kind (their order may change); the kinds already match."""
        by_kind: dict[object, list[Any]] = defaultdict(list)
        for branch in new:
            by_kind[_kind(branch, self.new_root)].append(branch)
        return [(branch, by_kind[_kind(branch, self.old_root)].pop(0)) for branch in old]


def _resolve(node: Mapping[str, Any], root: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The node with its `$ref` (and a lone `allOf`, as older pydantic wrote them) replaced by the target."""
    resolved = dict(node)
    ref_name: str | None = None
    for _ in range(32):  # a chain of $refs, not a loop
        if "$ref" in resolved:
            ref_name = resolved.pop("$ref")
            target = _lookup(root, str(ref_name))
            resolved = {**target, **resolved}
        elif isinstance(resolved.get("allOf"), list) and len(resolved["allOf"]) == 1:
            inner = resolved.pop("allOf")[0]
            if not isinstance(inner, Mapping):
                resolved["allOf"] = [inner]
                break
            resolved = {**inner, **resolved}
        else:
            break
    return resolved, ref_name


def _lookup(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    if not ref.startswith("#"):
        raise ValueError(f"only local $refs are supported, not {ref!r}")
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise ValueError(f"unresolvable $ref {ref!r}")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ValueError(f"$ref {ref!r} does not point to a schema")
    return node


def _kind(node: Any, root: Mapping[str, Any]) -> object:
    """A value's JSON type, the coarse part of its shape."""
    if not isinstance(node, Mapping):
        return ("boolean-schema", node)
    resolved, _ = _resolve(node, root)
    json_type = resolved.get("type")
    if isinstance(json_type, list):
        return tuple(sorted(str(t) for t in json_type))
    if json_type is not None:
        return str(json_type)
    for keyword in ("anyOf", "oneOf"):
        if keyword in resolved:
            return (keyword, tuple(sorted(repr(_kind(b, root)) for b in resolved[keyword])))
    for keyword, kind in (("const", "const"), ("enum", "enum"), ("properties", "object"), ("items", "array")):
        if keyword in resolved:
            return kind
    return "any"


def _shape(node: Mapping[str, Any], root: Mapping[str, Any]) -> object:
    """The union structure and JSON types of a node: if they differ, the type changed."""
    for keyword in ("anyOf", "oneOf"):
        if keyword in node:
            return (keyword, tuple(sorted(repr(_kind(branch, root)) for branch in node[keyword])))
    return ("single", _kind(node, root))


def _allowed_values(node: Mapping[str, Any]) -> list[str] | None:
    if "const" in node:
        return [json.dumps(node["const"], sort_keys=True)]
    if "enum" in node:
        return sorted(json.dumps(value, sort_keys=True) for value in node["enum"])
    return None


def _describe(node: Any, root: Mapping[str, Any], depth: int = 0) -> str:
    """A short human name for a schema's type: `integer | null`, `array of string`, `string (date-time)`."""
    if not isinstance(node, Mapping):
        return json.dumps(node)
    if depth > 3:
        return "..."
    resolved, _ = _resolve(node, root)
    for keyword in ("anyOf", "oneOf"):
        if keyword in resolved:
            return " | ".join(_describe(branch, root, depth + 1) for branch in resolved[keyword])
    values = _allowed_values(resolved)
    if values is not None:
        return values[0] if len(values) == 1 else f"one of {', '.join(values)}"
    json_type = resolved.get("type")
    if json_type == "array" and isinstance(resolved.get("items"), Mapping):
        return f"array of {_describe(resolved['items'], root, depth + 1)}"
    if json_type == "object" and isinstance(resolved.get("additionalProperties"), Mapping):
        return f"object of {_describe(resolved['additionalProperties'], root, depth + 1)}"
    if json_type == "string" and "format" in resolved:
        return f"string ({resolved['format']})"
    if isinstance(json_type, list):
        return " | ".join(str(t) for t in json_type)
    if json_type is not None:
        return str(json_type)
    if "properties" in resolved:
        return "object"
    return "any"


def _where(path: str) -> str:
    return f"property `{path}`" if path else "the event schema"


def _show(value: Any) -> str:
    return "(none)" if value is _MISSING else json.dumps(value, sort_keys=True)


def _show_values(values: list[str] | None) -> str:
    return "(any)" if values is None else f"[{', '.join(values)}]"
