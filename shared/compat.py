"""What breaks when one release reads what another wrote: the per-direction compatibility check of every contract.

The core is `problems_reading(writer, reader)`: what goes wrong when a reader whose model has the JSON schema `reader`
reads data written per the schema `writer`, under Weir's tolerant-reader rules (SPEC 11):
- a property the writer writes and the reader does not know is ignored (unless the reader refuses unknown ones:
  `additionalProperties: false`);
- a property the reader requires and the writer may omit breaks;
- a type, format or constraint change breaks unless every value the writer may write is one the reader accepts
  (`int` read as `float`, a longer maximum, a constraint dropped: fine; the reverse: broken);
- a closed-set value (enum, Literal, const) the reader does not know breaks, unless the reader's field declares a
  fallback (`x-weir-fallback`, from shared/tolerant.py's `unknown_as` and `Fallback`): it reads it as that.

Each contract is judged in both directions, as Confluent Schema Registry's modes do: BACKWARD (the new release reads
what the old one wrote: old publisher -> new consumer, old caller -> new responder, old client -> new server),
FORWARD (the old release reads what the new one writes), FULL (both), NONE. A request/reply contract is read both
ways at once: the responder reads the request, the caller reads the reply.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shared.tolerant import FALLBACK_KEYWORD

# keywords that describe a value, or say how a reader fills in what is missing, without restricting what it accepts
_FREE = frozenset({"title", "description", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "default",
                   "discriminator", "contentMediaType", "contentEncoding", FALLBACK_KEYWORD, "$defs", "definitions",
                   "$schema", "$id"})
# keywords the walk judges itself
_JUDGED = frozenset({"$ref", "type", "anyOf", "oneOf", "allOf", "enum", "const", "format", "properties", "required",
                     "additionalProperties", "items", "prefixItems", "minLength", "maxLength", "pattern", "minimum",
                     "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
                     "uniqueItems", "minProperties", "maxProperties"})
_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def problems_reading(writer: Any, reader: Any, *, writer_root: Mapping[str, Any] | None = None,
                     reader_root: Mapping[str, Any] | None = None) -> list[str]:
    """What breaks when a reader with the schema `reader` reads data written per `writer`; [] when nothing does.

    The roots are where their `$ref`s point (the schemas themselves unless given: an OpenAPI document's components)."""
    reading = _Reading(writer_root if writer_root is not None else writer,
                       reader_root if reader_root is not None else reader)
    reading.read(writer, reader, "", tolerant=False)
    return reading.problems


@contextmanager
def once(seen: set[tuple[str, str]], a_ref: str | None, b_ref: str | None) -> Iterator[bool]:
    """A recursive model: a pair of definitions already being read (or compared) is not read again inside itself.
    Yields False for a pair already in `seen`; True otherwise, the pair in `seen` for as long as the block runs."""
    if a_ref is None or b_ref is None:
        yield True
        return
    key = (a_ref, b_ref)
    if key in seen:
        yield False
        return
    seen.add(key)
    try:
        yield True
    finally:
        seen.discard(key)


@dataclass
class _Reading:
    writer_root: Any
    reader_root: Any
    problems: list[str] = field(default_factory=list)
    _in_progress: set[tuple[str, str]] = field(default_factory=set)

    def read(self, writer: Any, reader: Any, path: str, *, tolerant: bool) -> None:
        self.problems += self._read(writer, reader, path, tolerant)

    def _read(self, writer: Any, reader: Any, path: str, tolerant: bool) -> list[str]:
        if reader is True or reader == {}:
            return []
        if writer is False:
            return []
        if reader is False:
            return [f"{_where(path)}: the reader refuses any value"]
        if writer is True:
            writer = {}
        w, w_ref = resolve(writer, self.writer_root)
        r, r_ref = resolve(reader, self.reader_root)
        with once(self._in_progress, w_ref, r_ref) as first:
            if not first:
                return []
            tolerant = tolerant or FALLBACK_KEYWORD in r
            return self._read_alternatives(w, r, path, tolerant)

    def _read_alternatives(self, w: Mapping[str, Any], r: Mapping[str, Any], path: str, tolerant: bool) -> list[str]:
        """Every value the writer may write (each branch of its union) must be one some branch of the reader reads."""
        readers = list(_alternatives(r, self.reader_root))
        if any(_accepts_anything(alt) for alt in readers):
            return []
        found: list[str] = []
        for written in _alternatives(w, self.writer_root):
            kind = _kind(written)
            if kind == "any":
                found.append(f"{_where(path)}: the writer may write any value; the reader accepts only "
                             f"{describe(r, self.reader_root)}")
                continue
            candidates = [alt for alt in readers if _reads_kind(_kind(alt), kind)]
            if not candidates:
                found.append(f"{_where(path)}: the writer may write {describe(written, self.writer_root)}, which the "
                             f"reader does not accept (it reads {describe(r, self.reader_root)})")
                continue
            best: list[str] | None = None
            for alt in candidates:
                got = self._read_one(written, alt, kind, path, tolerant or FALLBACK_KEYWORD in alt)
                if not got:
                    best = []
                    break
                if best is None or len(got) < len(best):
                    best = got
            found += best or []
        return found

    def _read_one(self, w: Mapping[str, Any], r: Mapping[str, Any], kind: str, path: str,
                  tolerant: bool) -> list[str]:
        """One branch of the writer read by one branch of the reader, of the same JSON type."""
        found = self._values(w, r, kind, path, tolerant)
        if "format" in r and w.get("format") != r["format"]:
            found.append(f"{_where(path)}: the reader requires the format {r['format']}, the writer writes "
                         f"{w.get('format', 'any ' + kind)}")
        values_known = _values(w) is not None
        if kind == "string" and not values_known:
            found += _no_stricter(w, r, path, lower=("minLength",), upper=("maxLength",))
            if "pattern" in r and w.get("pattern") != r["pattern"]:
                found.append(f"{_where(path)}: the reader requires the pattern {r['pattern']!r}, the writer "
                             f"{'writes ' + repr(w['pattern']) if 'pattern' in w else 'does not restrict it'}")
        if kind in ("integer", "number") and not values_known:
            found += _bounds(w, r, path, integer=kind == "integer")
            if "multipleOf" in r and w.get("multipleOf") != r["multipleOf"]:
                found.append(f"{_where(path)}: the reader requires a multiple of {r['multipleOf']}")
        if kind == "array":
            found += _no_stricter(w, r, path, lower=("minItems",), upper=("maxItems",))
            if r.get("uniqueItems") and not w.get("uniqueItems"):
                found.append(f"{_where(path)}: the reader requires unique items, the writer may repeat them")
            found += self._items(w, r, path)
        if kind == "object":
            found += _no_stricter(w, r, path, lower=("minProperties",), upper=("maxProperties",))
            found += self._properties(w, r, path)
        for keyword in sorted(r.keys() - _FREE - _JUDGED):
            if w.get(keyword) != r[keyword]:
                found.append(f"{_where(path)}: the reader requires `{keyword}: {_show(r[keyword])}`, the writer "
                             f"{'has ' + _show(w[keyword]) if keyword in w else 'does not'}")
        return found

    def _values(self, w: Mapping[str, Any], r: Mapping[str, Any], kind: str, path: str, tolerant: bool) -> list[str]:
        """A closed set: every value the writer may write is known to the reader, or the reader has a fallback."""
        known = _values(r)
        if known is None:
            return []
        written = _values(w)
        fallback = tolerant and kind == "string"  # unknown_as and the Tolerant* types read unknown text only
        if written is None:
            if fallback:
                return []
            return [f"{_where(path)}: the writer may write any {kind}; the reader knows only {_show_set(known)} and "
                    "has no fallback"]
        unknown = [v for v in written if v not in known]
        if not unknown or (fallback and all(isinstance(json.loads(v), str) for v in unknown)):
            return []
        return [f"{_where(path)}: the writer may write {_show_set(unknown)}, which the reader does not know "
                f"({_show_set(known)}) and has no fallback for"]

    def _items(self, w: Mapping[str, Any], r: Mapping[str, Any], path: str) -> list[str]:
        found: list[str] = []
        w_prefix, r_prefix = w.get("prefixItems", []), r.get("prefixItems", [])
        for index, r_item in enumerate(r_prefix):
            w_item = w_prefix[index] if index < len(w_prefix) else w.get("items", True)
            found += self._read(w_item, r_item, f"{path}[{index}]", False)
        if "items" in r:
            for index, w_item in enumerate(w_prefix[len(r_prefix):], start=len(r_prefix)):
                found += self._read(w_item, r["items"], f"{path}[{index}]", False)
            if "items" in w or not w_prefix:
                found += self._read(w.get("items", True), r["items"], f"{path}[]", False)
        return found

    def _properties(self, w: Mapping[str, Any], r: Mapping[str, Any], path: str) -> list[str]:
        found: list[str] = []
        w_props: Mapping[str, Any] = w.get("properties", {})
        r_props: Mapping[str, Any] = r.get("properties", {})
        w_required, r_required = set(w.get("required", [])), set(r.get("required", []))
        # a model writes only its properties; a map (dict[str, X]) writes any key with values per additionalProperties
        w_extra = w.get("additionalProperties", "properties" not in w)
        r_extra = r.get("additionalProperties", True)
        for name, r_prop in r_props.items():
            child = f"{path}.{name}" if path else name
            if name in w_props:
                if name in r_required and name not in w_required:
                    found.append(f"{_where(child)}: the reader requires it, the writer may omit it")
                found += self._read(w_props[name], r_prop, child, False)
            elif name in r_required:
                found.append(f"{_where(child)}: the reader requires it, the writer does not write it")
            elif w_extra not in (False, None):
                found += self._read(w_extra, r_prop, child, False)
        for name, w_prop in w_props.items():
            if name in r_props:
                continue
            child = f"{path}.{name}" if path else name
            if r_extra is False:
                found.append(f"{_where(child)}: the writer writes it, the reader refuses properties it does not know")
            elif isinstance(r_extra, Mapping):
                found += self._read(w_prop, r_extra, child, False)
        if w_extra not in (False, None):
            if r_extra is False:
                found.append(f"{_where(path)}: the writer may write any key, the reader refuses properties it does "
                             "not know")
            elif isinstance(r_extra, Mapping):
                found += self._read(w_extra, r_extra, f"{path}{{}}", False)
        return found


# --- reading schemas ------------------------------------------------------------------------------------------


def resolve(node: Any, root: Any) -> tuple[dict[str, Any], str | None]:
    """The node with its `$ref` (and a lone `allOf`) replaced by what it names; its own keywords kept beside."""
    if not isinstance(node, Mapping):
        return {}, None
    resolved = dict(node)
    ref_name: str | None = None
    for _ in range(32):  # a chain of $refs, not a loop
        if "$ref" in resolved:
            ref_name = str(resolved.pop("$ref"))
            resolved = {**_lookup(root, ref_name), **resolved}
        elif isinstance(resolved.get("allOf"), list) and len(resolved["allOf"]) == 1 \
                and isinstance(resolved["allOf"][0], Mapping):
            resolved = {**resolved.pop("allOf")[0], **resolved}
        else:
            break
    return resolved, ref_name


def _lookup(root: Any, ref: str) -> Mapping[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $refs are supported, not {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise ValueError(f"unresolvable $ref {ref!r}")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ValueError(f"$ref {ref!r} does not point to a schema")
    return node


def _alternatives(node: Mapping[str, Any], root: Any) -> Iterator[dict[str, Any]]:
    """The branches of a union, flattened and resolved, a `type: [a, b]` split in one per type; the union's own
    keywords (its fallback) go with each branch."""
    for keyword in ("anyOf", "oneOf"):
        if isinstance(node.get(keyword), list):
            outer = {k: v for k, v in node.items() if k in (FALLBACK_KEYWORD,)}
            for branch in node[keyword]:
                resolved, _ = resolve(branch, root)
                for alternative in _alternatives(resolved, root):
                    yield {**outer, **alternative}
            return
    json_type = node.get("type")
    if isinstance(json_type, list):
        for one in json_type:
            yield {**node, "type": one}
        return
    yield dict(node)


def _kind(node: Mapping[str, Any]) -> str:
    json_type = node.get("type")
    if isinstance(json_type, str):
        return json_type
    values = _values(node)
    if values is not None:
        kinds = {_json_kind(json.loads(v)) for v in values}
        return kinds.pop() if len(kinds) == 1 else "any"
    for keyword, kind in (("properties", "object"), ("additionalProperties", "object"), ("items", "array"),
                          ("prefixItems", "array")):
        if keyword in node:
            return kind
    return "any"


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _reads_kind(reader_kind: str, writer_kind: str) -> bool:
    return reader_kind in (writer_kind, "any") or (reader_kind == "number" and writer_kind == "integer")


def _accepts_anything(node: Mapping[str, Any]) -> bool:
    return not (node.keys() - _FREE)


def _values(node: Mapping[str, Any]) -> list[str] | None:
    """A closed set's values (each as JSON), or None for an open one."""
    if "const" in node:
        return [json.dumps(node["const"], sort_keys=True)]
    if isinstance(node.get("enum"), list):
        return sorted(json.dumps(v, sort_keys=True) for v in node["enum"])
    return None


def _no_stricter(w: Mapping[str, Any], r: Mapping[str, Any], path: str, *, lower: tuple[str, ...],
                 upper: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for keyword in lower:
        if keyword in r and (keyword not in w or w[keyword] < r[keyword]):
            found.append(f"{_where(path)}: the reader requires `{keyword}` {r[keyword]}, the writer "
                         f"{'allows ' + str(w[keyword]) if keyword in w else 'does not restrict it'}")
    for keyword in upper:
        if keyword in r and (keyword not in w or w[keyword] > r[keyword]):
            found.append(f"{_where(path)}: the reader requires `{keyword}` {r[keyword]}, the writer "
                         f"{'allows ' + str(w[keyword]) if keyword in w else 'does not restrict it'}")
    return found


def _bound(node: Mapping[str, Any], inclusive: str, exclusive: str, *, lower: bool,
           integer: bool) -> tuple[float, bool] | None:
    """A numeric bound as (value, exclusive): the tighter of the two keywords when both are there (an integer's
    exclusive bound as the inclusive one it is: `gt=0` is `ge=1`)."""
    found: list[tuple[float, bool]] = []
    if isinstance(node.get(inclusive), int | float):
        found.append((node[inclusive], False))
    if isinstance(node.get(exclusive), int | float):
        value = node[exclusive]
        if integer and isinstance(value, int):
            found.append((value + 1 if lower else value - 1, False))
        else:
            found.append((value, True))
    if not found:
        return None
    return max(found, key=lambda b: (b[0] if lower else -b[0], b[1]))


def _bounds(w: Mapping[str, Any], r: Mapping[str, Any], path: str, *, integer: bool) -> list[str]:
    found: list[str] = []
    for inclusive, exclusive, below in (("minimum", "exclusiveMinimum", True), ("maximum", "exclusiveMaximum", False)):
        r_bound = _bound(r, inclusive, exclusive, lower=below, integer=integer)
        if r_bound is None:
            continue
        w_bound = _bound(w, inclusive, exclusive, lower=below, integer=integer)
        if w_bound is None:
            ok = False
        elif w_bound[0] != r_bound[0]:
            ok = w_bound[0] > r_bound[0] if below else w_bound[0] < r_bound[0]
        else:
            ok = w_bound[1] or not r_bound[1]
        if not ok:
            side = "at least" if below else "at most"
            found.append(f"{_where(path)}: the reader requires {side} {_show_bound(r_bound)}, the writer "
                         f"{'allows ' + _show_bound(w_bound) if w_bound else 'does not restrict it'}")
    return found


def _show_bound(bound: tuple[float, bool]) -> str:
    return f"{bound[0]} ({'exclusive' if bound[1] else 'inclusive'})"


def describe(node: Any, root: Any, depth: int = 0) -> str:
    """A short human name for a schema's type: `integer | null`, `array of string`, `one of "a", "b"`."""
    if not isinstance(node, Mapping):
        return json.dumps(node)
    if depth > 3:
        return "..."
    resolved, _ = resolve(node, root)
    branches = list(_alternatives(resolved, root))
    if len(branches) > 1:
        return " | ".join(describe(b, root, depth + 1) for b in branches)
    values = _values(resolved)
    if values is not None:
        return values[0] if len(values) == 1 else f"one of {', '.join(values)}"
    kind = _kind(resolved)
    if kind == "array" and isinstance(resolved.get("items"), Mapping):
        return f"array of {describe(resolved['items'], root, depth + 1)}"
    if kind == "string" and "format" in resolved:
        return f"string ({resolved['format']})"
    return kind


def _where(path: str) -> str:
    return f"`{path}`" if path else "the message"


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _show_set(values: list[str]) -> str:
    return "[" + ", ".join(values) + "]"


# --- what changed ---------------------------------------------------------------------------------------------


def inline(node: Any, root: Any, depth: int = 0, stack: tuple[str, ...] = ()) -> Any:
    """A copy of `node` with its local `$ref`s replaced by what they name (a recursive one left as a `$ref`)."""
    if depth > 48:
        return node
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and ref not in stack:
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return inline({**_lookup(root, ref), **rest}, root, depth + 1, (*stack, ref))
        return {k: inline(v, root, depth + 1, stack) for k, v in node.items() if k not in ("$defs", "definitions")}
    if isinstance(node, list):
        return [inline(v, root, depth + 1, stack) for v in node]
    return node


def changes(old: Any, new: Any, path: str = "", *, ignored: frozenset[str] = frozenset(
        {"title", "description", "examples", "$comment"})) -> list[str]:
    """What differs between two (inlined) schemas, as short lines: `+ a.b`, `- a.c`, `~ a.d.type: "x" -> "y"`."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        found: list[str] = []
        for key in sorted(old.keys() | new.keys(), key=str):
            if key in ignored:
                continue
            child = f"{path}.{key}" if path else str(key)
            if key not in new:
                found.append(f"- {child}")
            elif key not in old:
                found.append(f"+ {child}")
            else:
                found += changes(old[key], new[key], child, ignored=ignored)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (o, n) in enumerate(zip(old, new, strict=True))
                for line in changes(o, n, f"{path}[{i}]", ignored=ignored)]
    if old != new:
        return [f"~ {path}: {_short(old)} -> {_short(new)}"]
    return []


def _short(value: Any) -> str:
    text = _show(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- the verdict per direction -------------------------------------------------------------------------------

EVENT, REQUEST, API = "event", "request", "api"
# (the new release reads the old one's: BACKWARD, the old reads the new one's: FORWARD)
DIRECTIONS: dict[str, tuple[str, str]] = {
    EVENT: ("old publisher -> new consumer", "new publisher -> old consumer"),
    REQUEST: ("old caller -> new responder", "new caller -> old responder"),
    API: ("old client -> new server", "new client -> old server"),
}
FULL, BACKWARD, FORWARD, NONE = "FULL", "BACKWARD", "FORWARD", "NONE"


@dataclass(frozen=True)
class Verdict:
    """One direction of one contract's change: what breaks (nothing: compatible), and what would break but is
    accepted on purpose (contracts/accepted.toml, shared/acceptances.py), with the reason given there."""

    direction: str
    problems: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    reason: str = ""

    @property
    def compatible(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Change:
    """One contract that differs between two releases, and its verdict in both directions."""

    kind: str  # EVENT, REQUEST or API
    name: str  # the event type, the subject, or `METHOD /path`
    what: tuple[str, ...]  # what changed
    backward: Verdict  # the new release reads the old one's (old publisher/caller/client -> new)
    forward: Verdict  # the old release reads the new one's

    @property
    def mode(self) -> str:
        """The Confluent mode the change satisfies."""
        both = (self.backward.compatible, self.forward.compatible)
        return {(True, True): FULL, (True, False): BACKWARD, (False, True): FORWARD}.get(both, NONE)

    @property
    def breaking(self) -> bool:
        return not (self.backward.compatible and self.forward.compatible)

    @property
    def accepted(self) -> bool:
        """Whether some of what it breaks is accepted on purpose."""
        return bool(self.backward.accepted or self.forward.accepted)

    @property
    def mode_as_written(self) -> str:
        """The mode the change satisfies before any acceptance."""
        both = (not (self.backward.problems or self.backward.accepted),
                not (self.forward.problems or self.forward.accepted))
        return {(True, True): FULL, (True, False): BACKWARD, (False, True): FORWARD}.get(both, NONE)


def compare(old: Mapping[str, Any], new: Mapping[str, Any], *, old_label: str = "old") -> list[Change]:
    """Every contract that changed from the snapshot `old` to `new` (shared/contractsnap.py's), judged both ways."""
    found = _compare_events(old.get("events", {}), new.get("events", {}))
    found += _compare_envelopes(old, new)
    found += _compare_requests(old.get("requests", {}), new.get("requests", {}), old_label)
    for name in sorted(old.get("openapi", {}).keys() & new.get("openapi", {}).keys()):
        found += compare_openapi(old["openapi"][name], new["openapi"][name])
    return found


def _verdicts(kind: str, backward: list[str], forward: list[str]) -> tuple[Verdict, Verdict]:
    there, back = DIRECTIONS[kind]
    return Verdict(there, tuple(backward)), Verdict(back, tuple(forward))


def _version_line(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"version {old.get('version')} -> {new.get('version')}"] if old.get("version") != new.get("version") else []


def _compare_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    found: list[Change] = []
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            was = old[name]
            backward = ([f"removed, but {', '.join(was['publishers'])} of the older release still publish it"]
                        if was.get("publishers") else [])
            forward = ([f"removed: {', '.join(was['readers'])} of the older release wait for it"]
                       if was.get("readers") else [])
            found.append(Change(EVENT, name, ("removed",), *_verdicts(EVENT, backward, forward)))
            continue
        if name not in old:
            found.append(Change(EVENT, name, ("added",), *_verdicts(EVENT, [], [])))
            continue
        o, n = old[name], new[name]
        moved = _subject_changes(name, o, n)
        what = _version_line(o, n) + changes(inline(o["schema"], o["schema"]), inline(n["schema"], n["schema"]))
        if moved[0]:
            what.append(f"subjects {', '.join(moved[0])}")
        if not what:
            continue
        found.append(Change(EVENT, name, tuple(what), *_verdicts(
            EVENT, problems_reading(o["schema"], n["schema"]) + moved[1],
            problems_reading(n["schema"], o["schema"]) + moved[2])))
    return found


def _subject_changes(name: str, old: Mapping[str, Any],
                     new: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """What changed in where an event travels, and the problems it makes (old publisher -> new consumer, new
    publisher -> old consumer): a subject dropped is one the older release still publishes on or reads; a subject
    added beside the kept ones breaks nothing (SPEC 11: a new subject ships beside the old one)."""
    was, now = set(old.get("subjects") or [name]), set(new.get("subjects") or [name])
    lines = [f"+{s}" for s in sorted(now - was)] + [f"-{s}" for s in sorted(was - now)]
    gone = sorted(was - now)
    backward = [f"no longer read on {', '.join(gone)}, where {', '.join(old['publishers'])} of the older release "
                "publish it: keep it beside the new subject for a release"] if gone and old.get("publishers") else []
    forward = [f"no longer published on {', '.join(gone)}, where {', '.join(old['readers'])} of the older release "
               "read it: keep it beside the new subject for a release"] if gone and old.get("readers") else []
    return lines, backward, forward


ENVELOPE = "(envelope)"  # the envelope every event travels in, judged as an event


def _compare_envelopes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    if "schema" not in old.get("envelope", {}) or "schema" not in new.get("envelope", {}):
        return []
    return _compare_events({ENVELOPE: old["envelope"]}, {ENVELOPE: new["envelope"]})


def _compare_requests(old: Mapping[str, Any], new: Mapping[str, Any], old_label: str) -> list[Change]:
    found: list[Change] = []
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            callers = old[name].get("callers", [])
            backward = [f"removed while {', '.join(callers)} of {old_label} still call it: remove the callers in one "
                        "release, the contract in the next"] if callers else []
            found.append(Change(REQUEST, name, ("removed",), *_verdicts(REQUEST, backward, [])))
            continue
        if name not in old:
            n = new[name]
            forward = []
            # a service new in this release has no older instance to ask: its callers answer 503 until it runs
            new_service = not any(o.get("responder") == n["responder"] for o in old.values())
            # an optional contract's callers go on without its answer (shared/contracts.py `optional`)
            if n.get("callers") and n.get("beside") not in old and not new_service and not n.get("optional"):
                forward.append(f"an older {n['responder']} does not serve it, so {', '.join(n['callers'])} of this "
                               "release would get no answer: serve it beside an older contract its callers fall back "
                               "to (`beside=` in shared/contracts.py)")
            what = ("added" + (f", beside {n['beside']}" if n.get("beside") else "")
                    + (f", served by {n['responder']}, new in this release" if new_service else "")
                    + (", optional to its callers" if n.get("optional") else ""),)
            found.append(Change(REQUEST, name, what, *_verdicts(REQUEST, [], forward)))
            continue
        change = _compare_request(old[name], new[name])
        if change is not None:
            found.append(change)
    return found


def _compare_request(o: Mapping[str, Any], n: Mapping[str, Any]) -> Change | None:
    name = n["subject"]
    what = _version_line(o, n)
    for key in ("responder", "callers"):
        if o.get(key) != n.get(key):
            what.append(f"{key} {_short(o.get(key))} -> {_short(n.get(key))}")
    backward: list[str] = []
    forward: list[str] = []
    # the responder reads the request
    o_req, n_req = o["request"], n["request"]
    what += [f"request {line}" for line in _model_changes(o_req, n_req)]
    if "schema" in o_req and "schema" in n_req:
        backward += [f"request {p}" for p in problems_reading(o_req["schema"], n_req["schema"])]
        forward += [f"request {p}" for p in problems_reading(n_req["schema"], o_req["schema"])]
    # the caller reads each reply
    o_replies, n_replies = o.get("replies", {}), n.get("replies", {})
    for reply in sorted(o_replies.keys() | n_replies.keys()):
        if reply not in n_replies:
            what.append(f"reply {reply} removed")
            forward.append(f"reply {reply}: an older responder may answer it, which a caller of this release "
                           "no longer reads")
        elif reply not in o_replies:
            what.append(f"reply {reply} added")
            backward.append(f"reply {reply}: the responder may answer it, which an older caller does not read")
        else:
            o_rep, n_rep = o_replies[reply], n_replies[reply]
            what += [f"reply {reply} {line}" for line in _model_changes(o_rep, n_rep)]
            if "schema" in o_rep and "schema" in n_rep:
                backward += [f"reply {reply} {p}" for p in problems_reading(n_rep["schema"], o_rep["schema"])]
                forward += [f"reply {reply} {p}" for p in problems_reading(o_rep["schema"], n_rep["schema"])]
    if not what:
        return None
    return Change(REQUEST, name, tuple(what), *_verdicts(REQUEST, backward, forward))


def _model_changes(o: Mapping[str, Any], n: Mapping[str, Any]) -> list[str]:
    if o.get("missing") or n.get("missing"):
        return [f"model {o['model']} -> {n['model']} (one of them missing)"] if o != n else []
    return changes(inline(o["schema"], o["schema"]), inline(n["schema"], n["schema"]))


# --- the public HTTP API ----------------------------------------------------------------------------------------

_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def compare_openapi(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Each route that changed between two OpenAPI documents: the server reads requests (path, query, headers,
    body), clients read responses. A removed route or a new required input breaks old clients; a new route breaks
    no one (an older server answers it 404, as any server does a route it does not have)."""
    old_ops, new_ops = _operations(old), _operations(new)
    found: list[Change] = []
    for route in sorted(old_ops.keys() | new_ops.keys()):
        if route not in new_ops:
            found.append(Change(API, route, ("removed",),
                                *_verdicts(API, ["the route was removed: an older client calls it"], [])))
            continue
        if route not in old_ops:
            found.append(Change(API, route, ("added",), *_verdicts(API, [], [])))
            continue
        o, n = old_ops[route], new_ops[route]
        what = changes(inline(o, old), inline(n, new))
        if what:
            found.append(Change(API, route, tuple(what), *_verdicts(
                API, _route_problems(o, n, old, new), _route_problems(n, o, new, old))))
    return found


def _operations(document: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {f"{method.upper()} {path}": op for path, ops in document.get("paths", {}).items()
            for method, op in ops.items() if method in _METHODS}


def _route_problems(client: Mapping[str, Any], server: Mapping[str, Any], client_doc: Mapping[str, Any],
                    server_doc: Mapping[str, Any]) -> list[str]:
    """What breaks when a client built on `client` calls a server serving `server` (one operation each)."""
    found: list[str] = []
    sent = {(p.get("in"), p.get("name")): p for p in _parameters(client, client_doc)}
    for p in _parameters(server, server_doc):
        key = (p.get("in"), p.get("name"))
        where = f"{p.get('in')} parameter `{p.get('name')}`"
        if key not in sent:
            if p.get("required"):
                found.append(f"{where}: the server requires it, the client does not send it")
            continue
        if p.get("required") and not sent[key].get("required"):
            found.append(f"{where}: the server requires it, the client may omit it")
        found += [f"{where} {x}" for x in problems_reading(sent[key].get("schema", True), p.get("schema", True),
                                                           writer_root=client_doc, reader_root=server_doc)]
    c_body, _ = resolve(client.get("requestBody", {}), client_doc)
    s_body, _ = resolve(server.get("requestBody", {}), server_doc)
    if s_body.get("required") and not c_body:
        found.append("request body: the server requires one, the client sends none")
    for media, s_content in s_body.get("content", {}).items():
        c_content = c_body.get("content", {}).get(media)
        if c_content is not None:
            found += [f"request body ({media}) {x}" for x in problems_reading(
                c_content.get("schema", True), s_content.get("schema", True), writer_root=client_doc,
                reader_root=server_doc)]
    if c_body and s_body and not c_body.get("content", {}).keys() & s_body.get("content", {}).keys():
        found.append("request body: the server reads none of the media types the client sends")
    for status, s_response in server.get("responses", {}).items():
        c_response = client.get("responses", {}).get(status)
        if c_response is None:
            continue
        s_resolved, _ = resolve(s_response, server_doc)
        c_resolved, _ = resolve(c_response, client_doc)
        for media, s_content in s_resolved.get("content", {}).items():
            c_content = c_resolved.get("content", {}).get(media)
            # a body the server's document names without a schema is not described (not "any value"): what such a
            # server writes is unknown, so describing it later breaks no reader (a schema of `{}` still means any)
            if c_content is not None and "schema" in s_content:
                found += [f"response {status} ({media}) {x}" for x in problems_reading(
                    s_content.get("schema", True), c_content.get("schema", True), writer_root=server_doc,
                    reader_root=client_doc)]
    return found


def _parameters(op: Mapping[str, Any], document: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [resolve(p, document)[0] for p in op.get("parameters", [])]


# --- a release against the ones before it ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseCheck:
    """The current code against the previous release (every change, both directions) and, for events, against every
    older release (old publisher -> new consumer only: replays bring old events back)."""

    against: str
    changes: tuple[Change, ...]
    older: tuple[tuple[str, Change], ...] = ()  # (release, change) whose old publisher -> new consumer breaks
    older_releases: tuple[str, ...] = ()  # the older releases whose events were compared
    stale: tuple[str, ...] = ()  # acceptances (contracts/accepted.toml) that no finding matches any more

    @property
    def breaking(self) -> list[str]:
        lines = [f"{c.kind} {c.name} ({c.mode}): {d.direction}: {p}" for c in self.changes if c.breaking
                 for d in (c.backward, c.forward) for p in d.problems]
        lines += [f"event {c.name} against {release}: {c.backward.direction}: {p}" for release, c in self.older
                  for p in c.backward.problems]
        return lines + [f"stale acceptance: {line}" for line in self.stale]


def check_release(current: Mapping[str, Any], previous: tuple[str, Mapping[str, Any]],
                  older: tuple[tuple[str, Mapping[str, Any]], ...] = ()) -> ReleaseCheck:
    label, snapshot = previous
    found = compare(snapshot, current, old_label=label)
    replayed = tuple((release, c) for release, old in older
                     for c in _compare_events(old.get("events", {}), current.get("events", {}))
                     + _compare_envelopes(old, current) if not c.backward.compatible)
    return ReleaseCheck(label, tuple(found), replayed, tuple(release for release, _ in older))


def check_current(against: str | None = None) -> ReleaseCheck:
    """This code against the snapshot of release `against` (the previous release: shared/release.py) and, for events,
    every older release with a snapshot, with the findings contracts/accepted.toml accepts on purpose set apart.
    FileNotFoundError when `against` has no snapshot under contracts/; AcceptanceError when that file is not valid."""
    from shared import acceptances, contractsnap, release

    listed = [r.version for r in release.read_releases(release.RELEASES_FILE)]
    if against is None:
        if not listed:
            raise FileNotFoundError(f"no release listed in {release.RELEASES_FILE}")
        against = listed[-1]  # the previous release
    target = release.parse_version(against)
    older = tuple((v, contractsnap.load(contractsnap.snapshot_dir(v))) for v in listed
                  if release.parse_version(v) < target and contractsnap.snapshot_dir(v).is_dir())
    checked = check_release(contractsnap.collect(),
                            (against, contractsnap.load(contractsnap.snapshot_dir(against))), older)
    accepted = acceptances.read(contractsnap.CONTRACTS_DIR / acceptances.FILE_NAME, releases=listed)
    return acceptances.apply(checked, accepted)
