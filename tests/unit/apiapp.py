"""The api's FastAPI app as `build_http` makes it at start, without servers: its routes, the guard's table of them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from services.api.app import SERVICE
from services.api.guard import RouteTable
from services.api.settings import ApiSettings
from shared.metrics import Metrics
from shared.runtime import Runtime, ServiceDefinition, build_http


def api_app(definition: ServiceDefinition = SERVICE) -> FastAPI:
    """Nothing is connected: the routes only keep what they are given (placeholders) until a request comes."""
    unused: Any = object()
    rt = Runtime(definition=definition, settings=ApiSettings(), metrics=Metrics(definition.name), nc=unused,
                 js=unused, pool=unused)
    return build_http(rt)


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
