"""Which limit rules a request of each route class spends, credential by credential: what the docs say of the limits.

`rules_applying` states in words of the domain what `limits.plan_counts` does with a request (tested against it for
every route class, operation and credential, so the docs cannot drift from what is counted); `limits_in_force` is
every rule with its numbers and, per route class, the rules each credential spends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from services.auth.domain.access import ManagementOperation, RouteClass
from services.auth.domain.credentials import InternalToken
from services.auth.domain.rules import RULE_ORDER, Rule, RuleId


class CredentialCase(StrEnum):
    """What a request's Authorization credential turned out to be (`access.CredentialOutcome`, by kind)."""

    NONE = "none"
    SECRET_KEY = "secret_key"
    PUBLISHABLE_KEY = "publishable_key"
    ACCOUNT_TOKEN = "account_token"
    UPLOAD_TOKEN = "upload_token"
    UNUSABLE_UPLOAD_TOKEN = "unusable_upload_token"
    REJECTED = "rejected"


@dataclass(frozen=True)
class RuleWords:
    keyed_by: str
    counts: str


# SPEC section 3's table, in its words
RULE_WORDS: Final[Mapping[RuleId, RuleWords]] = {
    RuleId.ADDRESS: RuleWords("client address", "every request that is not carried by the valid internal token, an "
                              "accepted secret key or a valid upload token"),
    RuleId.AUTH_FAILURE: RuleWords("client address", "rejected credentials only"),
    RuleId.KEY: RuleWords("secret key id", "requests whose secret key was accepted"),
    RuleId.OWNER: RuleWords("account id", "requests accepted with any secret key of the account, all keys together"),
    RuleId.UPLOAD_TOKEN: RuleWords("upload token", "requests with a valid upload token"),
    RuleId.APP_CREATE: RuleWords("user", "app creations"),
    RuleId.KEY_ROTATE: RuleWords("user", "key rotations"),
}

_CARRIED: Final = frozenset({CredentialCase.SECRET_KEY, CredentialCase.UPLOAD_TOKEN})
_OPERATION_RULES: Final[Mapping[ManagementOperation, RuleId]] = {
    ManagementOperation.APP_CREATE: RuleId.APP_CREATE,
    ManagementOperation.KEY_ROTATE: RuleId.KEY_ROTATE,
}


def rules_applying(route: RouteClass, operation: ManagementOperation | None, credential: CredentialCase,
                   internal: InternalToken = InternalToken.ABSENT) -> tuple[RuleId, ...]:
    """The rules whose budgets such a request spends, in SPEC order."""
    found: set[RuleId] = set()
    # our own traffic is told apart by the token it carries, as are customers' accepted keys and upload tokens
    if internal is not InternalToken.REAL and credential not in _CARRIED:
        found.add(RuleId.ADDRESS)
    if credential is CredentialCase.REJECTED or internal is InternalToken.FORGED:
        found.add(RuleId.AUTH_FAILURE)
    if credential is CredentialCase.SECRET_KEY:
        found |= {RuleId.KEY, RuleId.OWNER}
    if credential is CredentialCase.UPLOAD_TOKEN:
        found.add(RuleId.UPLOAD_TOKEN)
    if credential is CredentialCase.ACCOUNT_TOKEN and route is RouteClass.MANAGEMENT and operation is not None:
        found.add(_OPERATION_RULES[operation])
    return tuple(sorted(found, key=RULE_ORDER.__getitem__))


@dataclass(frozen=True)
class DocumentedCase:
    """A request as the docs describe it: its credential and internal token, in words."""

    name: str
    description: str
    credential: CredentialCase
    internal: InternalToken = InternalToken.ABSENT


DOCUMENTED_CASES: Final[tuple[DocumentedCase, ...]] = (
    DocumentedCase("none", "no credential", CredentialCase.NONE),
    DocumentedCase("secret_key", "an accepted secret key", CredentialCase.SECRET_KEY),
    DocumentedCase("publishable_key", "an accepted publishable key", CredentialCase.PUBLISHABLE_KEY),
    DocumentedCase("account_token", "an accepted account token", CredentialCase.ACCOUNT_TOKEN),
    DocumentedCase("upload_token", "a valid upload token", CredentialCase.UPLOAD_TOKEN),
    DocumentedCase("unusable_upload_token", "an upload token that expired or whose key was revoked",
                   CredentialCase.UNUSABLE_UPLOAD_TOKEN),
    DocumentedCase("rejected", "a rejected credential (unknown, revoked or malformed)", CredentialCase.REJECTED),
    DocumentedCase("internal_token", "Weir's internal token (X-Weir-Internal-Token)", CredentialCase.NONE,
                   InternalToken.REAL),
    DocumentedCase("forged_internal_token", "a wrong internal token", CredentialCase.NONE, InternalToken.FORGED),
)


@dataclass(frozen=True)
class CaseRules:
    case: DocumentedCase
    rules: tuple[RuleId, ...]


@dataclass(frozen=True)
class RouteScope:
    """The rules each documented credential spends on a route class (and management operation)."""

    route: RouteClass
    operation: ManagementOperation | None
    cases: tuple[CaseRules, ...]


@dataclass(frozen=True)
class LimitsInForce:
    rules: tuple[Rule, ...]  # in SPEC order
    routes: tuple[RouteScope, ...]


def route_scopes() -> tuple[tuple[RouteClass, ManagementOperation | None], ...]:
    """Every route class, and each limited management operation beside management routes without one."""
    scopes: list[tuple[RouteClass, ManagementOperation | None]] = [(route, None) for route in RouteClass]
    scopes += [(RouteClass.MANAGEMENT, operation) for operation in ManagementOperation]
    return tuple(scopes)


def limits_in_force(rules: Mapping[RuleId, Rule]) -> LimitsInForce:
    """Every rule with its current numbers (`rules.rules_from(settings)`) and where each applies."""
    return LimitsInForce(
        rules=tuple(rules[rule] for rule in RuleId),
        routes=tuple(RouteScope(route, operation, tuple(
            CaseRules(case, rules_applying(route, operation, case.credential, case.internal))
            for case in DOCUMENTED_CASES)) for route, operation in route_scopes()),
    )
