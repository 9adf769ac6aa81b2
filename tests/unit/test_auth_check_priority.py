"""Where a request stands when shedding, as the api's shedder and auth each work it out: the shedder from the routes'
declarations (`RouteTable.shed_priority`), auth from the encoded check's bytes (services/auth/batched.py
`check_priority`). For every guarded route of the api and every credential header, both agree with the rule."""

from __future__ import annotations

import itertools

import pytest

from services.api.guard import RouteRule
from services.auth.batched import check_priority
from shared.overload import domain
from shared.overload.edge import PASS
from tests.unit.apiapp import api_table

TABLE = api_table()
RULES = TABLE.rules


def path_of(rule: RouteRule) -> str:
    """A path the rule serves, its parameters filled."""
    template = rule.name.split(" ", 1)[1]
    return template.replace("{video_id}", "vid_1").replace("{app_id}", "app_1").replace("{key_id}", "key_1")


def expected(rule: RouteRule, internal_token: bool) -> domain.Priority:
    declared: domain.Priority | None = "internal" if rule.route_class == "management" else rule.priority
    return domain.priority_of(internal=internal_token, declared=declared, method=rule.method)


def test_the_routes_declare_what_spec_15_orders() -> None:
    by_class = {(r.route_class, r.priority) for r in RULES}
    assert ("management", "internal") in by_class and ("internal", None) in by_class
    completions = [r.name for r in RULES if r.priority == "completion"]
    assert sorted(completions) == ["POST /sdk/v1/videos/{video_id}/upload/complete",
                                   "POST /v1/videos/{video_id}/upload/complete"]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_the_shedder_classifies_each_route(rule: RouteRule) -> None:
    declared = TABLE.shed_priority(rule.method, path_of(rule))
    assert declared is not PASS
    got = domain.priority_of(internal=False, declared=declared if not isinstance(declared, type(PASS)) else None,
                             method=rule.method)
    assert got == expected(rule, internal_token=False)


def test_operations_routes_pass() -> None:
    for path in TABLE.operations_paths:
        assert TABLE.shed_priority("GET", path) is PASS


@pytest.mark.parametrize(("rule", "token"), list(itertools.product(RULES, (False, True))),
                         ids=lambda v: v.name if isinstance(v, RouteRule) else str(v))
def test_auth_reads_the_same_priority_from_the_bytes(rule: RouteRule, token: bool) -> None:
    payload = rule.encode_check(authorization="Bearer sk_x", internal_token="t0ken" if token else None,
                                peer="10.0.0.1", forwarded_for=None, video_id=None, origin=None)
    assert check_priority(payload) == expected(rule, internal_token=token)
