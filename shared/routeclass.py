"""Which credential an HTTP route takes, declared once, on the route itself.

`@router.post(path, **route_class("management", operation="app_create"))` puts the route's class (and its limited
operation, and its body limit where not the guard's default) in its OpenAPI operation as `x-weir-*` extensions:
developers read them in /openapi.json, and the api's guard builds its table from them at start
(services/api/guard.py), failing on any route that declares none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

from shared.authcheck import OperationName, RouteClassName
from shared.overload.domain import PRIORITIES, Priority

ROUTE_CLASS = "x-weir-route-class"
OPERATION = "x-weir-operation"
BODY_LIMIT = "x-weir-body-limit"
PRIORITY = "x-weir-priority"  # where a route stands when the api sheds (shared/overload), if not by its method

# "operations": served without auth.check (probes, scrapes, the docs and demo pages: nothing of anyone's); the
# others are what auth.check judges the credential by (shared/authcheck.py)
RouteClass = RouteClassName | Literal["operations"]
ROUTE_CLASSES: frozenset[str] = frozenset((*get_args(RouteClassName), "operations"))
OPERATIONS: frozenset[str] = frozenset(get_args(OperationName))


class RouteDeclaration(TypedDict):
    openapi_extra: dict[str, Any]


def route_class(name: RouteClass, *, operation: OperationName | None = None,
                body_limit: int | None = None, priority: Priority | None = None) -> RouteDeclaration:
    """The keyword arguments of a FastAPI route decorator that declare the route's class."""
    extra: dict[str, Any] = {ROUTE_CLASS: name}
    if operation is not None:
        extra[OPERATION] = operation
    if body_limit is not None:
        extra[BODY_LIMIT] = body_limit
    if priority is not None:
        extra[PRIORITY] = priority
    return {"openapi_extra": extra}


OPERATIONS_ROUTE = route_class("operations")


class UndeclaredRoute(Exception):
    """A route without a valid route class: the service must not start, or the route would be served unguarded."""


@dataclass(frozen=True)
class DeclaredRoute:
    method: str
    path: str  # the template the route is served under (routers' prefixes included), e.g. /v1/videos/{video_id}
    route_class: RouteClass
    operation: OperationName | None
    body_limit: int | None
    priority: Priority | None = None

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


def served_routes(routes: Sequence[Any]) -> Iterator[tuple[str, frozenset[str], Mapping[str, Any] | None]]:
    """Each route's template, methods and OpenAPI extensions (None: a route that has none, e.g. Starlette's own),
    with the prefixes of the routers it was included through."""
    try:  # FastAPI 0.16x keeps an included router as one entry, which lists its routes with their prefixes
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older versions copy them in, prefixed
        listed: Sequence[Any] = routes
    else:
        listed = list(iter_route_contexts(routes))
    for route in listed:
        path = getattr(route, "path", None)
        if path:
            extra = getattr(route, "openapi_extra", None)
            yield str(path), frozenset(getattr(route, "methods", None) or ()), extra


def declared_routes(routes: Sequence[Any], *, undeclared_ok: frozenset[str] = frozenset()) -> list[DeclaredRoute]:
    """What every route declares, one entry per method; `undeclared_ok` names paths served as operations without a
    declaration (FastAPI's own /openapi.json, a plain Starlette route). Raises UndeclaredRoute naming each route
    that declares no class, an unknown one, or an unknown operation."""
    found: list[DeclaredRoute] = []
    wrong: list[str] = []
    for path, methods, extensions in served_routes(routes):
        extra = extensions or {}
        name, operation, limit = extra.get(ROUTE_CLASS), extra.get(OPERATION), extra.get(BODY_LIMIT)
        priority = extra.get(PRIORITY)
        if name is None and path in undeclared_ok:
            name = "operations"
        for method in sorted(methods) or ["*"]:
            if name not in ROUTE_CLASSES:
                wrong.append(f"{method} {path}: route class {name!r}" if name is not None else f"{method} {path}")
            elif operation is not None and operation not in OPERATIONS:
                wrong.append(f"{method} {path}: operation {operation!r}")
            elif limit is not None and (not isinstance(limit, int) or limit <= 0):
                wrong.append(f"{method} {path}: body limit {limit!r}")
            elif priority is not None and priority not in PRIORITIES:
                wrong.append(f"{method} {path}: priority {priority!r}")
            else:
                found.append(DeclaredRoute(method, path, name, operation, limit, priority))
    if wrong:
        raise UndeclaredRoute("routes without a valid route class (declare one with shared.routeclass.route_class, "
                              f"one of {sorted(ROUTE_CLASSES)}): " + "; ".join(wrong))
    return found
