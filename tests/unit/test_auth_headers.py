"""The rate-limit headers and problem bodies a decision carries."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.access import RouteClass
from services.auth.domain.credentials import InternalToken
from services.auth.domain.headers import AppliedLimit, rate_limit_headers, rate_limit_headers_json, tightest
from services.auth.domain.limits import CountPlan, Decision, decide, plan_counts
from services.auth.domain.rules import CounterKey, RuleId, rules_from
from services.auth.domain.windows import retry_after, seconds_until
from services.auth.settings import AuthSettings
from tests.unit.authfixtures import BOTH, DEFAULTS, REJECTED_KEY, SECRET_KEY, SMALL, T0, UPLOAD_TOKEN, Instance, facts

POLICY = re.compile(r'"(?P<name>[a-z_]+)";q=(?P<q>\d+);w=(?P<w>\d+)')
RATELIMIT = re.compile(r'"(?P<name>[a-z_]+)";r=(?P<r>\d+);t=(?P<t>\d+)')


@BOTH
def test_headers_follow_the_draft_and_the_common_trio(cfg: AuthSettings) -> None:
    rule = rules_from(cfg)[RuleId.KEY]
    instance = Instance(cfg)
    now = T0 + 17.25
    d = instance.check(facts(RouteClass.SECRET, SECRET_KEY), now)
    h = d.headers()
    policy, current = POLICY.fullmatch(h["RateLimit-Policy"]), RATELIMIT.fullmatch(h["RateLimit"])
    assert policy and current
    assert policy["name"] == current["name"] == "key"
    assert (int(policy["q"]), int(policy["w"])) == (rule.limit, rule.window_seconds)
    assert int(current["r"]) == rule.limit - 1 == int(h["X-RateLimit-Remaining"])
    assert int(current["t"]) == retry_after(now, rule.window_seconds) == int(h["X-RateLimit-Reset"])
    assert int(h["X-RateLimit-Limit"]) == rule.limit
    assert "Retry-After" not in h


def test_rate_limit_headers_exactly() -> None:
    rule = rules_from(DEFAULTS)[RuleId.KEY]
    h = rate_limit_headers(AppliedLimit(rule, 123, 42))
    assert h == {
        "RateLimit-Policy": f'"key";q={rule.limit};w={rule.window_seconds}',
        "RateLimit": '"key";r=123;t=42',
        "X-RateLimit-Limit": str(rule.limit),
        "X-RateLimit-Remaining": "123",
        "X-RateLimit-Reset": "42",
    }
    assert rate_limit_headers(AppliedLimit(rule, 0, 42), 42)["Retry-After"] == "42"


def test_a_refusal_carries_retry_after_equal_to_the_reset_and_nothing_left() -> None:
    instance = Instance(SMALL)
    for _ in range(SMALL.limit_address_per_minute):
        instance.check(facts(RouteClass.PUBLIC), T0 + 59.5)
    h = instance.check(facts(RouteClass.PUBLIC), T0 + 59.5).headers()
    assert h["Retry-After"] == h["X-RateLimit-Reset"] == "1"
    assert RATELIMIT.fullmatch(h["RateLimit"])["r"] == "0"  # type: ignore[index]


def test_the_tightest_rule_is_the_one_with_fewest_remaining_then_shortest_reset() -> None:
    rules = rules_from(SMALL)
    a, k, o = rules[RuleId.ADDRESS], rules[RuleId.KEY], rules[RuleId.OWNER]
    assert tightest([AppliedLimit(a, 5, 10), AppliedLimit(k, 3, 50)]) == AppliedLimit(k, 3, 50)
    assert tightest([AppliedLimit(a, 3, 10), AppliedLimit(k, 3, 50)]) == AppliedLimit(a, 3, 10)
    assert tightest([AppliedLimit(o, 3, 10), AppliedLimit(k, 3, 10)]) == AppliedLimit(k, 3, 10)
    assert tightest([]) is None


def test_a_decision_shows_the_tightest_of_the_rules_it_counted() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    checked = 0
    for counts in itertools.product(*(range(1, k.rule.limit + 2) for k in plan.increments)):
        by_key = dict(zip(plan.increments, counts, strict=True))
        applied = [AppliedLimit(k.rule, max(0, k.rule.limit - c), seconds_until(T0, k.window_end(T0)))
                   for k, c in by_key.items()]
        decision = decide(plan, by_key, T0)
        if decision.status != 429:  # a 429 shows the rule that refused (see the refusal tests)
            assert decision.applied == tightest(applied)
            checked += 1
    assert checked == math.prod(k.rule.limit for k in plan.increments)  # every count within the limits


def test_a_rejected_credential_shows_its_tighter_auth_failure_budget() -> None:
    d = Instance(SMALL).check(facts(RouteClass.SECRET, REJECTED_KEY), T0)
    assert d.applied is not None and d.applied.rule.id is RuleId.AUTH_FAILURE
    assert d.applied.remaining == SMALL.limit_auth_failure_per_minute - 1


def test_nothing_counted_means_no_rate_limit_headers() -> None:
    d = Instance(SMALL).check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0)
    assert d.allowed and d.headers() == {} and d.problem() is None


def test_problem_bodies() -> None:
    instance = Instance(SMALL)
    for _ in range(SMALL.limit_address_per_minute):
        instance.check(facts(RouteClass.PUBLIC), T0)
    refused = instance.check(facts(RouteClass.PUBLIC), T0 + 20)
    body = refused.problem()
    assert body == {
        "type": "https://weir.dev/problems/rate_limited",  # as every other Weir problem
        "title": "Too Many Requests",
        "status": 429,
        "detail": refused.detail,
        "code": "rate_limited",
        "rule": "address",
        "retry_after": SMALL.limit_window_seconds - 20,
    }
    missing = Instance(SMALL).check(facts(RouteClass.SECRET), T0).problem()
    assert missing is not None
    assert {k: missing[k] for k in ("title", "status", "code")} == {
        "title": "Unauthorized", "status": 401, "code": "missing_credential"
    }
    assert "rule" not in missing
    forbidden = Instance(SMALL).check(facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-2"), T0).problem()
    assert forbidden is not None and (forbidden["status"], forbidden["code"]) == (403, "forbidden")


@given(st.sampled_from(list(RuleId)), st.integers(min_value=0, max_value=10_000))
def test_remaining_is_never_below_zero_nor_above_the_limit(rule_id: RuleId, count: int) -> None:
    rules = rules_from(SMALL)
    key = CounterKey.of(rules[rule_id], "x")
    plan = CountPlan(facts(RouteClass.PUBLIC, internal=InternalToken.REAL), (key,), None)
    d = decide(plan, {key: count}, T0)
    assert d.applied is not None and 0 <= d.applied.remaining <= rules[rule_id].limit
    assert int(d.headers()["X-RateLimit-Remaining"]) >= 0


@pytest.mark.parametrize("rule_id", list(RuleId))
def test_headers_written_as_json_are_the_headers(rule_id: RuleId) -> None:
    rule = rules_from(SMALL)[rule_id]
    for remaining, reset, retry in itertools.product([0, 1, rule.limit], [1, rule.window_seconds], [None, 0, 7]):
        applied = AppliedLimit(rule, remaining, reset)
        assert json.loads(rate_limit_headers_json(applied, retry)) == rate_limit_headers(applied, retry)
        decision = Decision(429 if retry else 200, applied=applied, retry_after=retry)
        assert json.loads(decision.headers_json()) == decision.headers()
    for retry in (None, 3):
        assert json.loads(Decision(401, retry_after=retry).headers_json()) == Decision(401, retry_after=retry).headers()
