"""Every model of every declared contract (events, requests, replies) reads what a newer release may write (SPEC 11).

Driven by shared/contracts.py: a new contract is covered without a line here. For each model, an instance built from
its JSON schema, with unknown fields added to every object, is read; each tolerant closed set (`x-weir-fallback`)
given a value this release does not know is read as its fallback; and a closed set with no fallback fails, since a
newer release's value would refuse the whole message."""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import find, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from shared import contracts
from shared.compat import resolve
from shared.events.catalog import CATALOG
from shared.tolerant import FALLBACK_KEYWORD

UNKNOWN_FIELD = "x_weir_newer_field"
UNKNOWN_VALUE = "x-weir-newer-value"
Path = tuple[str | int, ...]


def declared_models() -> Iterator[tuple[str, type[BaseModel]]]:
    """(where it crosses, model) for each event type's model and each contract's request and reply models."""
    for e in contracts.EVENTS:
        yield f"event {e.type}", CATALOG[e.type]
    for r in contracts.REQUESTS:
        for role, name in (("request", r.request), *(("reply", m) for m in r.replies)):
            module, _, attribute = name.partition(":")
            yield f"{r.subject} {role}", getattr(importlib.import_module(module), attribute)


MODELS = sorted({(where, model) for where, model in declared_models()}, key=lambda m: (m[0], m[1].__name__))


class Sample:
    """A valid instance of a JSON schema, unknown fields in every object, and where its closed sets are."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.tolerant: list[tuple[Path, Any]] = []  # (path, fallback)
        self.closed: list[tuple[Path, list[Any]]] = []  # (path, values) of a closed set with no fallback
        self.value = self.build(root, (), fallback=False)

    def build(self, node: Any, path: Path, *, fallback: bool, depth: int = 0) -> Any:
        if not isinstance(node, dict) or depth > 12:
            return "x"
        here, _ = resolve(node, self.root)
        marked = fallback or FALLBACK_KEYWORD in here  # here, or on the union this is a branch of
        if FALLBACK_KEYWORD in here:
            self.tolerant.append((path, here[FALLBACK_KEYWORD]))
        for union in ("anyOf", "oneOf"):
            if union in here:
                branches = [resolve(b, self.root)[0] for b in here[union]]
                chosen = next((b for b in branches if b.get("type") != "null"), branches[0])
                return self.build(chosen, path, fallback=marked, depth=depth + 1)
        values = [here["const"]] if "const" in here else here.get("enum")
        if isinstance(values, list):
            if any(isinstance(v, str) for v in values) and not marked:
                self.closed.append((path, values))
            return values[0]
        kind = here.get("type")
        if kind == "object" or "properties" in here:
            built = {name: self.build(prop, (*path, name), fallback=False, depth=depth + 1)
                     for name, prop in here.get("properties", {}).items()}
            extra = here.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                built["key"] = self.build(extra, (*path, "key"), fallback=False, depth=depth + 1)
            if "properties" in here:
                built[UNKNOWN_FIELD] = {"nested": [1, "two", None], "flag": True}
            return built
        if kind == "array":
            prefix = here.get("prefixItems", [])
            items = [self.build(p, (*path, i), fallback=False, depth=depth + 1) for i, p in enumerate(prefix)]
            if not prefix and "items" in here:
                items = [self.build(here["items"], (*path, 0), fallback=False, depth=depth + 1)]
            return items * max(1, here.get("minItems", 1) // max(1, len(items))) if items else []
        return scalar(here)


def scalar(node: dict[str, Any]) -> Any:
    kind = node.get("type")
    if kind == "string":
        if node.get("format") == "date-time":
            return "2026-12-03T10:00:00Z"
        if node.get("format") == "date":
            return "2026-12-03"
        if "pattern" in node:
            return find(st.from_regex(node["pattern"], fullmatch=True), lambda _: True,
                        settings=settings(database=None))
        return "x" * max(1, int(node.get("minLength", 1)))
    if kind in ("integer", "number"):
        low = node.get("minimum", node["exclusiveMinimum"] + 1 if "exclusiveMinimum" in node else 1)
        return low if kind == "integer" or "maximum" not in node else (low + node["maximum"]) / 2
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "x"


def at(value: Any, path: Path) -> Any:
    for step in path:
        value = value[step] if isinstance(step, int) or isinstance(value, dict) else getattr(value, step)
    return value


def set_at(data: Any, path: Path, new: Any) -> Any:
    changed = copy.deepcopy(data)
    target = changed
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return changed


def plain(value: Any) -> Any:
    return getattr(value, "value", value)


@pytest.mark.parametrize(("where", "model"), MODELS, ids=[f"{w}:{m.__name__}" for w, m in MODELS])
def test_a_newer_release_s_message_is_read(where: str, model: type[BaseModel]) -> None:
    sample = Sample(model.model_json_schema(mode="validation"))
    model.model_validate_json(json.dumps(sample.value))  # unknown fields everywhere: ignored
    assert not sample.closed, "\n".join(
        f"{where}: {model.__name__} `{'.'.join(map(str, path))}` is a closed set {values} with no fallback: a value "
        "a newer release adds would refuse the whole message. Read it with `unknown_as(<member>)` "
        "(shared/tolerant.py), or mark a validator of its own with `Fallback(<member>)`"
        for path, values in sample.closed)
    for path, fallback in sample.tolerant:
        read = model.model_validate_json(json.dumps(set_at(sample.value, path, UNKNOWN_VALUE)))
        assert plain(at(read, path)) == fallback, f"{where}: `{path}` read {at(read, path)!r}, not {fallback!r}"


def test_the_tolerant_closed_sets_are_found() -> None:
    found = {(where, path) for where, model in MODELS
             for path, _ in Sample(model.model_json_schema(mode="validation")).tolerant}
    assert ("auth.check reply", ("identity", "key_type")) in found
    assert ("encode.status reply", ("outputs", 0, "state")) in found
    assert ("farm.result request", ("outcome",)) in found
    assert ("event key.revoked", ("kind",)) in found


def test_a_closed_set_without_fallback_is_found() -> None:
    class Strict(BaseModel):
        state: str = "x"
        kind: Any = None

    schema = Strict.model_json_schema()
    schema["properties"]["kind"] = {"enum": ["a", "b"], "type": "string"}
    assert Sample(schema).closed == [(("kind",), ["a", "b"])]
