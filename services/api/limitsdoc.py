"""The request limits in the api's OpenAPI document: per guarded route, the rules that apply with auth's numbers,
the rate-limit headers, the 429 and 503 problems (SPEC 3).

auth owns the numbers (its settings); the api asks it (`auth.manage.limits.list`) and `with_limits` writes the
answer into the document FastAPI builds. Without an answer the document still declares the headers and refusals,
and says that the numbers are not known yet: none is made up here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from fastapi import FastAPI

from shared.authcheck import LimitList, RouteLimits
from shared.problems import PROBLEM_TYPE_BASE
from shared.routeclass import OPERATION, ROUTE_CLASS

LIMITS: Final = "x-weir-limits"
PROBLEM_SCHEMA: Final = "Problem"
PROBLEM_MEDIA: Final = "application/problem+json"
HEADING: Final = "**Request limits**"
NOT_KNOWN: Final = "not known yet: auth has not told this api instance its limits (each answer's headers carry them)"

_REF = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}

PROBLEM: Final[dict[str, Any]] = {
    "title": PROBLEM_SCHEMA,
    "description": "An error (RFC 9457 problem details) with Weir's stable `code`; other members are extensions, "
                   "such as a 429's `rule` and `retry_after`.",
    "type": "object",
    "properties": {
        "type": {"type": "string", "description": f"{PROBLEM_TYPE_BASE}<code>"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": ["string", "null"]},
        "code": {"type": "string", "description": "stable: what a client acts on, e.g. `rate_limited`"},
        "rule": {"type": "string", "description": "429: the limit rule that refused the request"},
        "retry_after": {"type": "integer", "description": "429: the seconds until its window ends"},
    },
    "required": ["type", "title", "status", "code"],
    "additionalProperties": True,
}

_TIGHTEST = "of the tightest limit rule that applied (absent when none did, e.g. with Weir's internal token)"
LIMIT_HEADERS: Final[dict[str, dict[str, Any]]] = {
    "RateLimit-Policy": {"description": f"the policy {_TIGHTEST}: `\"<rule>\";q=<limit>;w=<window seconds>` "
                         "(draft-ietf-httpapi-ratelimit-headers)", "schema": {"type": "string"}},
    "RateLimit": {"description": f"what is left {_TIGHTEST}: `\"<rule>\";r=<remaining>;t=<seconds until its window "
                  "ends>`", "schema": {"type": "string"}},
    "X-RateLimit-Limit": {"description": f"the limit {_TIGHTEST}", "schema": {"type": "integer"}},
    "X-RateLimit-Remaining": {"description": f"the requests left {_TIGHTEST}", "schema": {"type": "integer"}},
    "X-RateLimit-Reset": {"description": f"the seconds until the window ends {_TIGHTEST}",
                          "schema": {"type": "integer"}},
}
RETRY_AFTER: Final[dict[str, Any]] = {"description": "the whole seconds to wait before sending it again",
                                      "schema": {"type": "integer"}}

REFUSED: Final = (
    "Too many requests: a limit rule refused it (problem `rate_limited`, naming the `rule`); send it again after "
    "Retry-After seconds, when the rule's window ends.")
UNDECIDED: Final = (
    "The request was not decided: `unavailable` (auth does not answer, or the limits store is failing over) or "
    "`overloaded` (auth is over capacity and shed it); send it again after Retry-After seconds.")


def _example(status: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"value": {"type": PROBLEM_TYPE_BASE + code, "title": HTTPStatus(status).phrase, "status": status,
                      "detail": detail, "code": code, **extra}}


def _rule_phrase(rule: Mapping[str, Any]) -> str:
    return f"`{rule['rule']}` {rule['limit']} per {rule['window_seconds']} s per {rule['keyed_by']}"


def route_limits(limits: LimitList, route_class: str, operation: str | None) -> RouteLimits | None:
    """What auth says of a route class (and management operation); its class alone when it says nothing of the
    operation; None when it does not know the class."""
    by_scope = {(r.route_class, r.operation): r for r in limits.routes}
    return by_scope.get((route_class, operation)) or by_scope.get((route_class, None))


def limits_extension(limits: LimitList | None, route_class: str, operation: str | None) -> dict[str, Any]:
    """`x-weir-limits` of one route: each rule that applies with its numbers and when, and who is not counted."""
    scope = None if limits is None else route_limits(limits, route_class, operation)
    if limits is None or scope is None:
        return {"known": False, "detail": NOT_KNOWN}
    rules = {r.id: r for r in limits.rules}
    applied: dict[str, dict[str, Any]] = {}
    not_counted: list[str] = []
    for case in scope.credentials:
        known = [rules[rule_id] for rule_id in case.rules if rule_id in rules]
        if not known:
            not_counted.append(case.description)
        for rule in known:
            entry = applied.setdefault(rule.id, {
                "rule": rule.id, "limit": rule.limit, "window_seconds": rule.window_seconds,
                "keyed_by": rule.keyed_by, "counts": rule.counts, "when": []})
            entry["when"].append(case.description)
    order = [r.id for r in limits.rules]
    return {"known": True, "rules": sorted(applied.values(), key=lambda e: order.index(e["rule"])),
            "not_counted": not_counted}


def limits_paragraph(extension: Mapping[str, Any]) -> str:
    """The "Request limits" paragraph of an operation's description, from its `x-weir-limits`."""
    if not extension.get("known"):
        lines = [f"{HEADING}: {NOT_KNOWN}."]
    else:
        lines = [f"{HEADING}:"]
        for rule in extension["rules"]:
            lines.append(f"- {_rule_phrase(rule)}, with {'; '.join(rule['when'])}")
        if extension["not_counted"]:
            lines.append(f"- not counted: {'; '.join(extension['not_counted'])}")
    lines.append("")
    lines.append("Answers carry the tightest rule that applied in RateLimit-Policy, RateLimit and X-RateLimit-*; a "
                 "refusal is 429 with Retry-After and a problem naming the `rule`. Past `auth_failure`, its address "
                 "gets 429 until the window ends (a secret key accepted there within the window excepted).")
    return "\n".join(lines)


def _response(responses: dict[str, Any], status: str, description: str) -> dict[str, Any]:
    response: dict[str, Any] = responses.setdefault(status, {"description": description})
    response["description"] = description
    return response


def _problem_content(response: dict[str, Any], examples: dict[str, Any]) -> None:
    content = response.setdefault("content", {})
    media = content.setdefault(PROBLEM_MEDIA, {})
    media["schema"] = _REF
    media["examples"] = examples


def _document_operation(op: dict[str, Any], limits: LimitList | None) -> None:
    extension = limits_extension(limits, op[ROUTE_CLASS], op.get(OPERATION))
    op[LIMITS] = extension
    own = op.get("description", "").split(f"\n\n{HEADING}", 1)[0]
    op["description"] = f"{own}\n\n{limits_paragraph(extension)}" if own else limits_paragraph(extension)
    responses: dict[str, Any] = op.setdefault("responses", {})
    refused = _response(responses, "429", REFUSED)
    _problem_content(refused, {"rate_limited": _example(
        429, "rate_limited", "the address limit is spent; retry after the Retry-After seconds", rule="address")})
    undecided = _response(responses, "503", UNDECIDED)
    _problem_content(undecided, {
        "unavailable": _example(503, "unavailable", "auth does not answer; retry shortly"),
        "overloaded": _example(503, "overloaded", "auth is over capacity; retry after the Retry-After seconds")})
    for status, response in responses.items():
        problem_media = response.get("content", {}).get(PROBLEM_MEDIA)
        if isinstance(problem_media, dict):  # every refusal the route declares is a problem body of this shape
            problem_media.setdefault("schema", _REF)
        headers = response.setdefault("headers", {})
        headers.update(copy.deepcopy(LIMIT_HEADERS))
        if status in ("429", "503"):
            headers["Retry-After"] = dict(RETRY_AFTER)


def with_limits(document: Mapping[str, Any], limits: LimitList | None) -> dict[str, Any]:
    """A copy of the api's OpenAPI document with the limits on every guarded route (its `x-weir-route-class` not
    `operations`), and the problem schema its error answers use."""
    out: dict[str, Any] = copy.deepcopy(dict(document))
    for operations in out.get("paths", {}).values():
        for op in operations.values():
            if isinstance(op, dict) and op.get(ROUTE_CLASS) not in (None, "operations"):
                _document_operation(op, limits)
    out.setdefault("components", {}).setdefault("schemas", {})[PROBLEM_SCHEMA] = copy.deepcopy(PROBLEM)
    return out


class LimitsDocument:
    """The app's /openapi.json with the limits auth last told (`learn`): FastAPI's document, built once, and the
    limits written into it again whenever auth's answer changes."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.limits: LimitList | None = None
        self._build = app.openapi  # FastAPI's own builder (it keeps what it built in app.openapi_schema)
        self._base: dict[str, Any] | None = None
        app.openapi = self.openapi  # type: ignore[method-assign]

    def learn(self, limits: LimitList) -> None:
        if limits != self.limits:
            self.limits = limits
            self.app.openapi_schema = None  # made again at the next request for the document

    def openapi(self) -> dict[str, Any]:
        if self.app.openapi_schema is None:
            if self._base is None:
                self._base = self._build()
            self.app.openapi_schema = with_limits(self._base, self.limits)
        return self.app.openapi_schema
