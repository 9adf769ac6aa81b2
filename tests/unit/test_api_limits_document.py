"""The limits in the api's OpenAPI document (services/api/limitsdoc.py): every guarded route says which rules apply
with auth's numbers (from its settings, through `auth.manage.limits.list`'s answer), declares the rate-limit headers,
the 429 and the 503 problems; without auth's answer it says the numbers are not known yet."""

from __future__ import annotations

from typing import Any

import pytest

from services.api.app import SERVICE
from services.api.limitsdoc import LIMIT_HEADERS, LIMITS, NOT_KNOWN, PROBLEM_SCHEMA, LimitsDocument
from services.api.settings import ApiSettings
from services.auth.domain.access import ManagementOperation, RouteClass
from services.auth.domain.applicable import DOCUMENTED_CASES, rules_applying
from services.auth.domain.rules import rules_from
from services.auth.manage import list_limits
from shared.metrics import Metrics
from shared.routeclass import OPERATION, ROUTE_CLASS
from shared.runtime import Runtime, build_http
from tests.unit.authfixtures import SMALL

METHODS = {"get", "post", "put", "patch", "delete", "head", "options"}


@pytest.fixture
def document() -> LimitsDocument:
    unused: Any = object()
    rt = Runtime(definition=SERVICE, settings=ApiSettings(), metrics=Metrics(SERVICE.name), nc=unused, js=unused,
                 pool=unused)
    build_http(rt)
    return rt.parts_of(LimitsDocument)


def guarded(openapi: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [(f"{method.upper()} {path}", op) for path, ops in openapi["paths"].items() for method, op in ops.items()
             if method in METHODS and op.get(ROUTE_CLASS) != "operations"]
    assert {op[ROUTE_CLASS] for _, op in found} == {c.value for c in RouteClass}  # every class is served
    return found


def assert_refusals_declared(name: str, op: dict[str, Any]) -> None:
    responses = op["responses"]
    for status in ("429", "503"):
        problem = responses[status]["content"]["application/problem+json"]
        assert problem["schema"] == {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}, name
        assert "Retry-After" in responses[status]["headers"], name
    assert responses["429"]["content"]["application/problem+json"]["examples"]["rate_limited"]["value"]["code"] == (
        "rate_limited")
    assert set(responses["503"]["content"]["application/problem+json"]["examples"]) == {"unavailable", "overloaded"}
    for response in responses.values():
        assert set(LIMIT_HEADERS) <= set(response["headers"]), name
    assert "**Request limits**" in op["description"], name


def test_without_auth_s_answer_every_guarded_route_says_the_numbers_are_not_known(document: LimitsDocument) -> None:
    openapi = document.app.openapi()
    for name, op in guarded(openapi):
        assert op[LIMITS] == {"known": False, "detail": NOT_KNOWN}, name
        assert NOT_KNOWN in op["description"], name
        assert_refusals_declared(name, op)
    assert set(openapi["components"]["schemas"][PROBLEM_SCHEMA]["required"]) == {"type", "title", "status", "code"}
    operations = [op for ops in openapi["paths"].values() for op in ops.values() if op.get(ROUTE_CLASS) ==
                  "operations"]
    assert operations and all(LIMITS not in op for op in operations)


def test_each_route_shows_the_rules_auth_counts_by_with_their_numbers(document: LimitsDocument) -> None:
    unknown = document.app.openapi()
    document.learn(list_limits(SMALL))
    openapi = document.app.openapi()
    assert openapi is not unknown  # made again for the new answer
    rules = rules_from(SMALL)
    for name, op in guarded(openapi):
        route = RouteClass(op[ROUTE_CLASS])
        operation = ManagementOperation(op[OPERATION]) if OPERATION in op else None
        limits = op[LIMITS]
        assert limits["known"] is True, name
        expected = {rule for case in DOCUMENTED_CASES
                    for rule in rules_applying(route, operation, case.credential, case.internal)}
        assert {r["rule"] for r in limits["rules"]} == {str(rule) for rule in expected}, name
        for shown in limits["rules"]:
            rule = rules[shown["rule"]]
            assert (shown["limit"], shown["window_seconds"]) == (rule.limit, rule.window_seconds), name
            assert f"`{rule.id}` {rule.limit} per {rule.window_seconds} s" in op["description"], name
            assert shown["when"], name
        assert_refusals_declared(name, op)
    # the same answer again changes nothing: the document is not made again
    document.learn(list_limits(SMALL))
    assert document.app.openapi() is openapi


def test_the_description_is_written_once_however_often_the_limits_change(document: LimitsDocument) -> None:
    document.learn(list_limits(SMALL))
    document.learn(list_limits(SMALL.model_copy(update={"limit_address_per_minute": 8})))
    for name, op in guarded(document.app.openapi()):
        assert op["description"].count("**Request limits**") == 1, name
        assert "`address` 7 per" not in op["description"], name
