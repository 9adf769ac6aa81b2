"""What the docs say of the limits (services/auth/domain/applicable.py) is what `plan_counts` counts: every route
class, operation, credential and internal token, compared with the plan itself."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    CredentialOutcome,
    ManagementOperation,
    NoCredential,
    RejectedCredential,
    RejectionReason,
    RequestFacts,
    RouteClass,
    UnusableReason,
    UnusableUploadToken,
    ValidUploadToken,
)
from services.auth.domain.applicable import (
    DOCUMENTED_CASES,
    RULE_WORDS,
    CredentialCase,
    limits_in_force,
    route_scopes,
    rules_applying,
)
from services.auth.domain.credentials import InternalToken
from services.auth.domain.limits import plan_counts
from services.auth.domain.rules import RuleId, rules_from
from services.auth.domain.upload_tokens import UploadTokenClaims
from tests.unit.authfixtures import ADDRESS, SMALL

CLAIMS = UploadTokenClaims(video_id="v1", app_id="p1", key_id="k1", expires_at=2_000_000_000)
OUTCOMES: dict[CredentialCase, CredentialOutcome] = {
    CredentialCase.NONE: NoCredential(),
    CredentialCase.SECRET_KEY: AcceptedSecretKey("k1", "a1", "p1"),
    CredentialCase.PUBLISHABLE_KEY: AcceptedPublishableKey("k2", "a1", "p1"),
    CredentialCase.ACCOUNT_TOKEN: AcceptedAccountToken("u1", "a1"),
    CredentialCase.UPLOAD_TOKEN: ValidUploadToken("t1", CLAIMS),
    CredentialCase.UNUSABLE_UPLOAD_TOKEN: UnusableUploadToken("t2", CLAIMS, UnusableReason.EXPIRED),
    CredentialCase.REJECTED: RejectedCredential("secret_key", RejectionReason.UNKNOWN, "wsk_abcd"),
}
RULES = rules_from(SMALL)


def test_every_credential_outcome_has_its_case() -> None:
    """A new kind of credential outcome must be given a case here (and in the docs) before it can be counted."""
    assert {type(o) for o in OUTCOMES.values()} == set(get_args(CredentialOutcome))
    assert set(OUTCOMES) == set(CredentialCase)


@pytest.mark.parametrize(("route", "operation"), list(itertools.product(RouteClass, [None, *ManagementOperation])))
def test_the_rules_said_to_apply_are_the_budgets_plan_counts_spends(
    route: RouteClass, operation: ManagementOperation | None
) -> None:
    for case, internal, recent in itertools.product(CredentialCase, InternalToken, (False, True)):
        facts = RequestFacts(route=route, address=ADDRESS, credential=OUTCOMES[case], internal=internal,
                             operation=operation, video_id="v1", recently_accepted_key=recent)
        counted = [key.rule.id for key in plan_counts(facts, RULES).increments]
        assert len(counted) == len(set(counted))
        assert sorted(counted) == sorted(rules_applying(route, operation, case, internal)), (case, internal)


def test_the_secret_routes_and_the_internal_ones_read_as_spec_3_says() -> None:
    secret = {c.name: rules_applying(RouteClass.SECRET, None, c.credential, c.internal) for c in DOCUMENTED_CASES}
    assert secret["secret_key"] == (RuleId.KEY, RuleId.OWNER)
    assert secret["rejected"] == (RuleId.ADDRESS, RuleId.AUTH_FAILURE)
    assert secret["none"] == secret["publishable_key"] == (RuleId.ADDRESS,)
    internal = {c.name: rules_applying(RouteClass.INTERNAL, None, c.credential, c.internal) for c in DOCUMENTED_CASES}
    assert internal["internal_token"] == ()  # the post-mortem's lesson: never counted by address
    assert internal["forged_internal_token"] == (RuleId.ADDRESS, RuleId.AUTH_FAILURE)
    assert rules_applying(RouteClass.MANAGEMENT, ManagementOperation.KEY_ROTATE, CredentialCase.ACCOUNT_TOKEN) == (
        RuleId.ADDRESS, RuleId.KEY_ROTATE)


def test_limits_in_force_carry_the_settings_numbers_and_every_scope() -> None:
    found = limits_in_force(RULES)
    assert [r.id for r in found.rules] == list(RuleId) and set(RULE_WORDS) == set(RuleId)
    assert {r.id: (r.limit, r.window_seconds) for r in found.rules} == {
        rule: (RULES[rule].limit, RULES[rule].window_seconds) for rule in RuleId}
    assert [(s.route, s.operation) for s in found.routes] == list(route_scopes())
    assert {(s.route, s.operation) for s in found.routes} >= {(r, None) for r in RouteClass}
    for scope in found.routes:
        assert [c.case for c in scope.cases] == list(DOCUMENTED_CASES)
    assert len({c.name for c in DOCUMENTED_CASES}) == len(DOCUMENTED_CASES)
