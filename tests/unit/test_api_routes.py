"""Each api route declares its route class once, on the route (shared/routeclass.py); the guard's table is derived
from the routes at start (services/api/guard.py), and a route that declares none stops the api from starting."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI

from services.api.guard import DEFAULT_BODY_LIMIT, RouteTable
from shared.routeclass import (
    BODY_LIMIT,
    OPERATION,
    ROUTE_CLASS,
    ROUTE_CLASSES,
    UndeclaredRoute,
    declared_routes,
    route_class,
    served_routes,
)
from tests.unit.apiapp import api_app, with_routes_added

APP = api_app()
TABLE = RouteTable.of(APP)
OPENAPI_METHODS = {"get", "post", "put", "patch", "delete", "head", "options"}


def _example(template: str) -> str:
    """A concrete path of the template, each parameter named after itself."""
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: f"{m.group(1)}-1", template)


def test_every_route_of_the_app_declares_a_class() -> None:
    served = list(served_routes(APP.routes))
    assert len(served) > len(TABLE.rules)  # the operations routes too
    undeclared = [(path, methods) for path, methods, extra in served
                  if (extra or {}).get(ROUTE_CLASS) not in ROUTE_CLASSES and path != APP.openapi_url]
    assert undeclared == []


def test_the_guards_table_is_what_the_routes_declare() -> None:
    declared = declared_routes(APP.routes, undeclared_ok=frozenset({APP.openapi_url or ""}))
    guarded = {(d.name, d.route_class, d.operation, d.body_limit or DEFAULT_BODY_LIMIT)
               for d in declared if d.route_class != "operations"}
    assert {(r.name, r.route_class, r.operation, r.body_limit) for r in TABLE.rules} == guarded
    assert len(TABLE.rules) == len(guarded)
    for d in declared:
        path = _example(d.path)
        if d.route_class == "operations":
            assert TABLE.unchecked(path) and TABLE.classify(d.method, path) == (None, None), d.name
        else:
            rule, video_id = TABLE.classify(d.method, path)
            assert rule is not None and rule.name == d.name and not TABLE.unchecked(path), d.name
            assert video_id == ("video_id-1" if "{video_id}" in d.path else None)
    assert TABLE.classify("GET", "/nowhere") == (None, None) and not TABLE.unchecked("/nowhere")


def test_the_preflights_are_the_sdk_routes_paths_with_their_methods() -> None:
    sdk: dict[str, set[str]] = {}
    for rule in TABLE.rules:
        if rule.route_class == "sdk":
            sdk.setdefault(rule.name.split(" ", 1)[1], set()).add(rule.method)
    assert sdk and len(TABLE.preflights) == len(sdk)
    for path, methods in sdk.items():
        preflight = TABLE.preflight(_example(path))
        assert preflight is not None and set(preflight.methods.decode().split(", ")) == methods
        assert TABLE.methods_of(_example(path)) == sorted(methods)
    assert TABLE.preflight(_example("/v1/videos/{video_id}")) is None  # secret routes: no browser calls them


def test_the_openapi_document_shows_each_operations_class_as_the_guard_has_it() -> None:
    document = APP.openapi()
    shown = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method not in OPENAPI_METHODS:
                continue
            shown += 1
            name = operation.get(ROUTE_CLASS)
            assert name in ROUTE_CLASSES, (method, path)
            rule, _ = TABLE.classify(method.upper(), _example(path))
            if name == "operations":
                assert rule is None and TABLE.unchecked(_example(path))
            else:
                assert rule is not None and rule.route_class == name
                assert operation.get(OPERATION) == rule.operation
                assert operation.get(BODY_LIMIT, DEFAULT_BODY_LIMIT) == rule.body_limit
    assert shown >= len(TABLE.rules)


def test_the_limited_operations_are_declared_on_their_routes() -> None:
    operations = {r.name: r.operation for r in TABLE.rules if r.operation is not None}
    assert operations == {"POST /v1/account/apps": "app_create",
                          "POST /v1/account/apps/{app_id}/keys/rotate": "key_rotate"}


def _undeclared(app: FastAPI) -> None:
    @app.get("/v1/forgotten")
    async def forgotten() -> dict[str, Any]:
        return {}


def _undeclared_in_a_router(app: FastAPI) -> None:
    r = APIRouter(prefix="/v1/account")

    @r.delete("/everything")
    async def everything() -> None:
        return None

    app.include_router(r)


def _unknown_class(app: FastAPI) -> None:
    @app.get("/v1/typo", openapi_extra={ROUTE_CLASS: "secert"})
    async def typo() -> dict[str, Any]:
        return {}


def _unknown_operation(app: FastAPI) -> None:
    @app.post("/v1/account/things", openapi_extra={ROUTE_CLASS: "management", OPERATION: "thing_create"})
    async def things() -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(("add", "named"), [
    (_undeclared, "GET /v1/forgotten"),
    (_undeclared_in_a_router, "DELETE /v1/account/everything"),
    (_unknown_class, "GET /v1/typo: route class 'secert'"),
    (_unknown_operation, "POST /v1/account/things: operation 'thing_create'"),
])
def test_a_route_that_declares_no_valid_class_stops_the_api_at_start(add: Any, named: str) -> None:
    with pytest.raises(UndeclaredRoute) as stopped:
        api_app(with_routes_added(add))
    assert named in str(stopped.value)
    assert len(str(stopped.value).split("; ")) == 1  # that route alone: every other one is declared


def test_a_declared_route_added_the_same_way_starts() -> None:
    def declared(app: FastAPI) -> None:
        @app.get("/v1/declared", **route_class("secret", body_limit=1024))
        async def declared_route() -> dict[str, Any]:
            return {}

    table = RouteTable.of(api_app(with_routes_added(declared)))
    rule, _ = table.classify("GET", "/v1/declared")
    assert rule is not None and (rule.route_class, rule.body_limit) == ("secret", 1024)
    assert len(table.rules) == len(TABLE.rules) + 1
