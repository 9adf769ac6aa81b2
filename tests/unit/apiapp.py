"""The api's FastAPI app as `build_http` makes it at start, without servers: its routes, the guard's table of them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from services.api.app import SERVICE, offline_app
from services.api.guard import RouteTable
from shared.runtime import Runtime, ServiceDefinition


def api_app(definition: ServiceDefinition = SERVICE) -> FastAPI:
    return offline_app(definition)


def api_table() -> RouteTable:
    return RouteTable.of(api_app())


def with_routes_added(add: Any) -> ServiceDefinition:
    """The api's definition with `add(app)` run before its own routes (and its guard's table)."""
    assert SERVICE.routes is not None
    own = SERVICE.routes

    def routes(app: FastAPI, rt: Runtime) -> None:
        add(app)
        own(app, rt)

    return replace(SERVICE, routes=routes)
