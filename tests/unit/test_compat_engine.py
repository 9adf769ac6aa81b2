"""The per-direction compatibility engine (shared/compat.py): each tolerant-reader rule, in both directions.

`directions(old, new)` is (backward, forward): what breaks when the new model reads what the old one wrote (old
publisher -> new consumer), and when the old model reads what the new one writes (new publisher -> old consumer)."""

from __future__ import annotations

import copy
import inspect
from datetime import datetime
from typing import Annotated, Any, Literal

import pytest
from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from shared.compat import API, BACKWARD, EVENT, FORWARD, FULL, NONE, REQUEST, compare, problems_reading
from shared.events.catalog import CATALOG
from shared.media.protocol import OutputResult, ProcessingStatus
from shared.messaging import unknown_as
from shared.tolerant import FALLBACK_KEYWORD, Fallback
from shared.videos import JobClass, TolerantJobClass


def schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(mode="validation")


def directions(old: type[BaseModel], new: type[BaseModel]) -> tuple[list[str], list[str]]:
    return problems_reading(schema(old), schema(new)), problems_reading(schema(new), schema(old))


class Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- properties ---------------------------------------------------------------------------------------------


class V1(Base):
    a: str
    b: int = 0


class V2Optional(Base):
    a: str
    b: int = 0
    c: str | None = None


class V2Required(Base):
    a: str
    b: int = 0
    c: str


class V2BRequired(Base):
    a: str
    b: int


class V2WithoutA(Base):
    b: int = 0


class V1Forbidding(Base):
    model_config = ConfigDict(extra="forbid")
    a: str
    b: int = 0


def test_the_same_schema_reads_both_ways() -> None:
    assert directions(V1, V1) == ([], [])


def test_a_new_optional_property_is_compatible_both_ways() -> None:
    assert directions(V1, V2Optional) == ([], [])  # the old reader ignores it; the new one does without it


def test_a_new_required_property_breaks_only_the_new_reader() -> None:
    backward, forward = directions(V1, V2Required)
    assert backward and "`c`" in backward[0] and "does not write it" in backward[0]
    assert forward == []


def test_an_optional_property_made_required_breaks_the_new_reader() -> None:
    backward, forward = directions(V1, V2BRequired)
    assert backward == ["`b`: the reader requires it, the writer may omit it"]
    assert forward == []


def test_a_removed_property_the_old_reader_requires_breaks_it() -> None:
    backward, forward = directions(V1, V2WithoutA)
    assert backward == []
    assert forward and "`a`" in forward[0]


def test_a_reader_refusing_unknown_properties_breaks_on_a_new_one() -> None:
    # what issue 28 found: auth's extra="forbid" reply models made an older api answer 500 to a newer auth
    forward = problems_reading(schema(V2Optional), schema(V1Forbidding))
    assert forward == ["`c`: the writer writes it, the reader refuses properties it does not know"]
    assert problems_reading(schema(V1Forbidding), schema(V2Optional)) == []


# --- types, formats, constraints ----------------------------------------------------------------------------


class Count(Base):
    n: int


class CountAsText(Base):
    n: str


class CountAsFloat(Base):
    n: float


class CountOrNull(Base):
    n: int | None


class Positive(Base):
    n: int = Field(gt=0)


class AtLeastTwo(Base):
    n: int = Field(ge=2)


class Short(Base):
    s: str = Field(max_length=10)


class Long(Base):
    s: str = Field(max_length=20)


class Text(Base):
    s: str


class Patterned(Base):
    s: str = Field(pattern=r"^[a-z]+$")


class When(Base):
    s: datetime


class Items(Base):
    xs: list[int]


class FewItems(Base):
    xs: list[int] = Field(max_length=3)


class Nested(Base):
    inner: list[V1]


class NestedRequired(Base):
    inner: list[V2Required]


class Mapped(Base):
    m: dict[str, int]


class MappedText(Base):
    m: dict[str, str]


class Node(Base):
    value: int
    children: list[Node] = []


class NodeV2(Base):
    value: int
    children: list[NodeV2] = []
    label: str | None = None


def test_a_changed_type_breaks_both_ways() -> None:
    backward, forward = directions(Count, CountAsText)
    assert backward and forward
    assert "integer" in backward[0] and "string" in backward[0]


def test_a_widened_type_breaks_only_the_old_reader() -> None:
    assert directions(Count, CountAsFloat)[0] == []  # an int is a float
    assert directions(Count, CountAsFloat)[1]  # a float is not an int
    assert directions(Count, CountOrNull)[0] == []
    assert "null" in directions(Count, CountOrNull)[1][0]


def test_a_tighter_constraint_breaks_the_reader_that_has_it() -> None:
    assert directions(Short, Long) == ([], directions(Short, Long)[1])
    assert directions(Short, Long)[1] and "maxLength" in directions(Short, Long)[1][0]
    backward, forward = directions(Positive, AtLeastTwo)
    assert backward and "at least 2" in backward[0]
    assert forward == []  # >= 2 is > 0
    assert directions(Text, Short)[0] and directions(Text, Short)[1] == []
    backward, forward = directions(Items, FewItems)
    assert backward and "maxItems" in backward[0]
    assert forward == []


def test_an_integer_s_exclusive_bound_is_the_inclusive_one_above() -> None:
    assert problems_reading({"type": "integer", "exclusiveMinimum": 0}, {"type": "integer", "minimum": 1}) == []
    assert problems_reading({"type": "integer", "minimum": 1}, {"type": "integer", "exclusiveMinimum": 0}) == []
    assert problems_reading({"type": "number", "minimum": 0}, {"type": "number", "exclusiveMinimum": 0})


def test_a_new_pattern_or_format_breaks_the_reader_that_requires_it() -> None:
    backward, forward = directions(Text, Patterned)
    assert backward and "pattern" in backward[0]
    assert forward == []
    backward, forward = directions(Text, When)
    assert backward and "date-time" in backward[0]
    assert forward == []  # a date-time is a string


def test_nested_models_lists_and_maps_are_read_through() -> None:
    backward, forward = directions(Nested, NestedRequired)
    assert backward and "`inner[].c`" in backward[0]
    assert forward == []
    backward, forward = directions(Mapped, MappedText)
    assert backward and forward and "`m{}`" in backward[0]


def test_a_recursive_model_is_read_without_looping() -> None:
    assert directions(Node, NodeV2) == ([], [])


# --- closed sets ----------------------------------------------------------------------------------------------


class State(Base):
    state: Literal["ready", "busy"]


class StateWithNew(Base):
    state: Literal["ready", "busy", "draining"]


class StateTolerant(Base):
    state: Annotated[Literal["ready", "busy", "unknown"], unknown_as("unknown")]


class StateTolerantWithNew(Base):
    state: Annotated[Literal["ready", "busy", "unknown", "draining"], unknown_as("unknown")]


class StateAsText(Base):
    state: str


class OptionalTolerant(Base):
    state: Annotated[Literal["ready", "busy"] | None, unknown_as(None)] = None


class OptionalTolerantWithNew(Base):
    state: Annotated[Literal["ready", "busy", "draining"] | None, unknown_as(None)] = None


class Job(Base):
    job_class: TolerantJobClass


class JobWithNewClass(Base):
    job_class: Literal["developer", "first_party", "partner"]


class CountTolerant(Base):
    n: Annotated[Literal[1, 2], unknown_as(1)]


def test_a_new_closed_set_value_breaks_an_old_reader_without_fallback() -> None:
    backward, forward = directions(State, StateWithNew)
    assert backward == []
    assert forward and '"draining"' in forward[0] and "no fallback" in forward[0]


def test_a_new_closed_set_value_is_read_as_the_fallback_by_a_tolerant_reader() -> None:
    assert directions(StateTolerant, StateTolerantWithNew) == ([], [])
    assert directions(OptionalTolerant, OptionalTolerantWithNew) == ([], [])  # the fallback on the union
    assert problems_reading(schema(JobWithNewClass), schema(Job)) == []  # the Tolerant* types (BeforeValidator)


def test_a_removed_closed_set_value_breaks_the_new_reader_without_fallback() -> None:
    backward, forward = directions(StateWithNew, State)
    assert backward and '"draining"' in backward[0]
    assert forward == []


def test_an_open_set_read_as_a_closed_one_needs_a_fallback() -> None:
    assert problems_reading(schema(StateAsText), schema(State))
    assert problems_reading(schema(StateAsText), schema(StateTolerant)) == []
    assert problems_reading(schema(State), schema(StateAsText)) == []


def test_a_fallback_reads_unknown_text_only() -> None:
    # unknown_as and the Tolerant* types read an unknown string as the fallback; another type is still refused
    assert problems_reading({"type": "integer", "enum": [1, 2, 3]}, schema(CountTolerant))


def test_the_fallback_is_marked_in_the_schema_of_the_current_tolerant_types() -> None:
    assert schema(StateTolerant)["properties"]["state"][FALLBACK_KEYWORD] == "unknown"
    assert schema(Job)["properties"]["job_class"][FALLBACK_KEYWORD] == JobClass.DEVELOPER.value
    status = schema(ProcessingStatus)
    assert status["properties"]["status"][FALLBACK_KEYWORD] is None
    assert status["$defs"]["OutputStatus"]["properties"]["state"][FALLBACK_KEYWORD] == "pending"
    assert schema(OutputResult)["properties"]["outcome"][FALLBACK_KEYWORD] == "failed"
    assert CATALOG["key.revoked"].model_json_schema()["properties"]["kind"][FALLBACK_KEYWORD] == "secret"


def test_a_new_value_of_a_current_tolerant_type_breaks_no_reader() -> None:
    """encode.status: a newer encode's output state and processing state, read by this api's model."""
    written = copy.deepcopy(schema(ProcessingStatus))
    written["$defs"]["OutputStatus"]["properties"]["state"] = {"type": "string", "enum": ["pending", "paused"]}
    written["properties"]["status"] = {"anyOf": [{"type": "string", "enum": ["encoding", "queued_elsewhere"]},
                                                 {"type": "null"}]}
    assert problems_reading(written, schema(ProcessingStatus)) == []
    unmarked = copy.deepcopy(schema(ProcessingStatus))
    del unmarked["$defs"]["OutputStatus"]["properties"]["state"][FALLBACK_KEYWORD]
    assert problems_reading(written, unmarked)


class Marked(Base):
    job: Annotated[JobClass, BeforeValidator(lambda v: v), Fallback(JobClass.DEVELOPER)]


def test_the_fallback_marker_names_an_enum_s_value() -> None:
    assert schema(Marked)["properties"]["job"][FALLBACK_KEYWORD] == "developer"


# --- the verdicts of snapshots --------------------------------------------------------------------------------


def event_snapshot(model: type[BaseModel], **extra: Any) -> dict[str, Any]:
    entry = {"type": "thing.happened", "version": 1, "publishers": ["api"], "readers": ["encode"],
             "schema": schema(model)}
    return {"events": {"thing.happened": entry | extra}}


def request_snapshot(request: type[BaseModel], reply: type[BaseModel], *, subject: str = "thing.ask",
                     callers: tuple[str, ...] = ("api",), beside: str = "") -> dict[str, Any]:
    entry = {"subject": subject, "version": 1, "responder": "encode", "callers": list(callers), "beside": beside,
             "request": {"model": "m:Req", "schema": schema(request)},
             "replies": {"Reply": {"model": "m:Reply", "schema": schema(reply)}}}
    return {"requests": {subject: entry}}


@pytest.mark.parametrize(("old", "new", "mode"), [
    (V1, V2Optional, FULL),
    (V1, V2Required, FORWARD),  # the new consumer cannot read old events; old consumers read the new ones
    (V1, V2WithoutA, BACKWARD),
    (Count, CountAsText, NONE),
])
def test_an_event_change_gets_its_mode(old: type[BaseModel], new: type[BaseModel], mode: str) -> None:
    (change,) = compare(event_snapshot(old), event_snapshot(new))
    assert change.kind == EVENT and change.mode == mode
    assert change.backward.direction == "old publisher -> new consumer"
    assert change.breaking == (mode != FULL)


def test_a_request_change_is_read_both_ways_at_once() -> None:
    # old caller -> new responder: the old caller reads the new reply, which has a closed-set value it does not know;
    # new caller -> old responder: the old responder reads the new request, which lacks a field it requires
    (change,) = compare(request_snapshot(V1, State), request_snapshot(V2WithoutA, StateWithNew))
    assert change.kind == REQUEST and change.mode == NONE
    assert change.backward.direction == "old caller -> new responder"
    assert [p.split(":")[0] for p in change.backward.problems] == ["reply Reply `state`"]
    assert [p.split(":")[0] for p in change.forward.problems] == ["request `a`"]
    (required,) = compare(request_snapshot(V1, V1), request_snapshot(V2Required, V1))
    assert required.mode == FORWARD and required.backward.problems[0].startswith("request `c`")
    (tolerant,) = compare(request_snapshot(V1, StateTolerant), request_snapshot(V2Optional, StateTolerantWithNew))
    assert tolerant.mode == FULL


def test_a_reply_model_added_breaks_old_callers_and_one_removed_new_callers() -> None:
    old = request_snapshot(V1, V1)
    new = copy.deepcopy(old)
    new["requests"]["thing.ask"]["replies"]["Other"] = {"model": "m:Other", "schema": schema(V1)}
    (added,) = compare(old, new)
    assert added.mode == FORWARD
    (removed,) = compare(new, old)
    assert removed.mode == BACKWARD


def test_removing_a_contract_breaks_unless_no_caller_remained() -> None:
    (removed,) = compare(request_snapshot(V1, V1), {"requests": {}})
    assert removed.mode == FORWARD and "api" in removed.backward.problems[0]
    (uncalled,) = compare(request_snapshot(V1, V1, callers=()), {"requests": {}})
    assert uncalled.mode == FULL
    (event,) = compare(event_snapshot(V1), {"events": {}})
    assert event.mode == NONE
    (unpublished,) = compare(event_snapshot(V1, publishers=[], readers=[]), {"events": {}})
    assert unpublished.mode == FULL


def test_a_new_contract_with_callers_must_be_served_beside_an_old_one() -> None:
    old = request_snapshot(V1, V1)
    new = copy.deepcopy(old)
    new["requests"] |= request_snapshot(V1, V1, subject="thing.ask.v2")["requests"]
    (alone,) = compare(old, new)
    assert alone.mode == BACKWARD and "beside" in alone.forward.problems[0]
    new["requests"]["thing.ask.v2"]["beside"] = "thing.ask"
    (beside,) = compare(old, new)
    assert beside.mode == FULL



def test_a_new_contract_its_callers_do_without_needs_no_older_one() -> None:
    """`optional`: the callers go on without an answer, so an older responder that does not serve it breaks none."""
    old = request_snapshot(V1, V1)
    new = copy.deepcopy(old)
    new["requests"] |= request_snapshot(V1, V1, subject="thing.list")["requests"]
    new["requests"]["thing.list"]["optional"] = True
    (optional,) = compare(old, new)
    assert optional.mode == FULL and "optional to its callers" in optional.what[0]


# --- the public HTTP API --------------------------------------------------------------------------------------


def openapi(*, extra_route: bool = False, required_query: bool = False, body: type[BaseModel] = V1,
            answer: type[BaseModel] = V1) -> dict[str, Any]:
    """A small API's OpenAPI document (this module's annotations are strings: the endpoints get real types)."""
    app = FastAPI()

    async def create(**_: Any) -> Any:
        raise NotImplementedError

    async def read(thing_id: str) -> Any:
        raise NotImplementedError

    create.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("thing", inspect.Parameter.KEYWORD_ONLY, annotation=body),
        *([inspect.Parameter("flavour", inspect.Parameter.KEYWORD_ONLY, annotation=str)] if required_query else []),
    ])
    read.__annotations__ = {"thing_id": str}
    app.add_api_route("/v1/things", create, methods=["POST"], response_model=answer)
    if extra_route:
        app.add_api_route("/v1/things/{thing_id}", read, methods=["GET"], response_model=answer)
    document: dict[str, Any] = app.openapi()
    return document


def test_an_api_route_removed_breaks_old_clients_and_one_added_breaks_no_one() -> None:
    (removed,) = compare({"openapi": {"api": openapi(extra_route=True)}}, {"openapi": {"api": openapi()}})
    assert removed.kind == API and removed.mode == FORWARD
    assert removed.backward.direction == "old client -> new server"
    (added,) = compare({"openapi": {"api": openapi()}}, {"openapi": {"api": openapi(extra_route=True)}})
    assert added.mode == FULL


def test_an_api_input_made_required_breaks_old_clients() -> None:
    (change,) = compare({"openapi": {"api": openapi()}}, {"openapi": {"api": openapi(required_query=True)}})
    assert change.mode == FORWARD and "flavour" in change.backward.problems[0]
    (body,) = compare({"openapi": {"api": openapi()}}, {"openapi": {"api": openapi(body=V2Required)}})
    assert body.mode == FORWARD and any("request body" in p for p in body.backward.problems)


def test_an_api_response_losing_a_field_breaks_old_clients() -> None:
    (change,) = compare({"openapi": {"api": openapi()}}, {"openapi": {"api": openapi(answer=V2WithoutA)}})
    assert change.mode == FORWARD and any(p.startswith("response 200") for p in change.backward.problems)
    (more,) = compare({"openapi": {"api": openapi()}}, {"openapi": {"api": openapi(answer=V2Optional)}})
    assert more.mode == FULL


def test_an_undescribed_error_body_may_be_described_but_not_narrowed() -> None:
    """A body an older document names without a schema (`application/problem+json: {}`) says nothing of what that
    server writes: describing it is no break; narrowing a body it described (even as any value) is."""
    undescribed = openapi()
    undescribed["paths"]["/v1/things"]["post"]["responses"]["429"] = {
        "description": "refused", "content": {"application/problem+json": {}}}
    described = copy.deepcopy(undescribed)
    described["paths"]["/v1/things"]["post"]["responses"]["429"]["content"]["application/problem+json"] = {
        "schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}
    (change,) = compare({"openapi": {"api": undescribed}}, {"openapi": {"api": described}})
    assert change.mode == FULL
    anything = copy.deepcopy(undescribed)
    anything["paths"]["/v1/things"]["post"]["responses"]["429"]["content"]["application/problem+json"] = {
        "schema": {}}
    (narrowed,) = compare({"openapi": {"api": anything}}, {"openapi": {"api": described}})
    assert narrowed.mode == BACKWARD and "any value" in narrowed.forward.problems[0]


# --- the remaining keywords, on hand-written schemas ----------------------------------------------------------

INT, TEXT = {"type": "integer"}, {"type": "string"}


@pytest.mark.parametrize(("writer", "reader", "broken"), [
    ({"type": "array", "items": INT}, {"type": "array", "items": INT, "uniqueItems": True}, "unique"),
    ({"type": "array", "items": INT, "uniqueItems": True}, {"type": "array", "items": INT}, None),
    ({"type": "integer", "multipleOf": 5}, {"type": "integer", "multipleOf": 5}, None),
    (INT, {"type": "integer", "multipleOf": 5}, "multiple of 5"),
    # a tuple (prefixItems) read position by position
    ({"type": "array", "prefixItems": [TEXT, INT]}, {"type": "array", "prefixItems": [TEXT, INT]}, None),
    ({"type": "array", "prefixItems": [TEXT, TEXT]}, {"type": "array", "prefixItems": [TEXT, INT]}, "`[1]`"),
    # a map's values, a map read as a model and the reverse
    ({"type": "object", "additionalProperties": INT}, {"type": "object", "additionalProperties": {"type": "number"}},
     None),
    ({"type": "object", "additionalProperties": INT}, {"type": "object", "properties": {"a": TEXT}}, "`a`"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"]},
     {"type": "object", "additionalProperties": INT}, None),
    ({"type": "object", "properties": {"a": TEXT}, "required": ["a"]},
     {"type": "object", "additionalProperties": INT}, "`a`"),
    # anything written, read as something; anything read
    ({}, INT, "any value"),
    (INT, {}, None),
    (INT, True, None),
    (INT, False, "refuses any value"),
    # minimum and maximum, items counts, string lengths
    ({"type": "number", "maximum": 1}, {"type": "number", "maximum": 2}, None),
    ({"type": "number", "maximum": 2}, {"type": "number", "maximum": 1}, "at most 1"),
    ({"type": "number", "exclusiveMaximum": 1}, {"type": "number", "maximum": 1}, None),
    ({"type": "array", "items": INT, "minItems": 2}, {"type": "array", "items": INT, "minItems": 1}, None),
    ({"type": "array", "items": INT}, {"type": "array", "items": INT, "minItems": 1}, "minItems"),
    ({"type": "string", "minLength": 1}, {"type": "string", "minLength": 3}, "minLength"),
    # a union written: each branch must be read
    ({"anyOf": [INT, TEXT]}, {"anyOf": [TEXT, INT, {"type": "null"}]}, None),
    ({"anyOf": [INT, TEXT]}, INT, "string"),
    ({"type": ["integer", "null"]}, {"anyOf": [INT, {"type": "null"}]}, None),
    # a keyword this engine does not judge must be the same
    ({"type": "object", "propertyNames": {"maxLength": 3}}, {"type": "object", "propertyNames": {"maxLength": 4}},
     "propertyNames"),
])
def test_each_keyword_is_read_as_a_reader_would(writer: Any, reader: Any, broken: str | None) -> None:
    found = problems_reading(writer, reader)
    if broken is None:
        assert found == []
    else:
        assert found and broken in " ".join(found), found
