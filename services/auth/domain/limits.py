"""Which budgets a request spends (`plan_counts`) and, from the counts after spending them, its outcome (`decide`).

Limits come first: the address's `auth_failure` block, then every rule past its limit (a 429 naming the rule whose
window ends last, ties in SPEC section 3's order), since rejected credentials count and a flood of them must meet
429s, not 401s. Then the route's credential refusal (`access`, 401 or 403); otherwise the request is allowed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, NamedTuple

from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedSecretKey,
    ManagementOperation,
    ProblemCode,
    Refusal,
    RejectedCredential,
    Rejection,
    RequestFacts,
    RouteClass,
    ValidUploadToken,
    credential_refusal,
    rejections,
)
from services.auth.domain.credentials import InternalToken
from services.auth.domain.headers import AppliedLimit, rate_limit_headers, rate_limit_headers_json, tightness
from services.auth.domain.rules import RULE_ORDER, CounterKey, Rule, RuleId
from services.auth.domain.windows import WindowsAt, seconds_until
from shared.problems import PROBLEM_TYPE_BASE

# the shared counter store is failing over (a replicated store electing a leader) and this instance holds no leased
# count for the request: counting stays exact, so the request is not decided; it may be sent again in a moment
FAILOVER_RETRY_AFTER_S: Final = 1


# --- the plan ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CountPlan:
    """The counters a request increments (each at most once), and the `auth_failure` counter its block depends on.

    `block_check` is None when the request is exempt from the block; when it is not also incremented, the caller
    reads its current value (or skips the read and relies on `RefusalMemory`, giving up exactness across instances).
    """

    facts: RequestFacts
    increments: tuple[CounterKey, ...]
    block_check: CounterKey | None

    # the plan is kept with its remembered payload and serves each of its requests: what follows from it alone is
    # worked out once (functools.cached_property on a frozen dataclass: set in the instance's own dict)

    @functools.cached_property
    def reads(self) -> tuple[CounterKey, ...]:
        if self.block_check is None or self.block_check in self.increments:
            return ()
        return (self.block_check,)

    @functools.cached_property
    def rejections(self) -> tuple[Rejection, ...]:
        """`rejections` of the facts."""
        return rejections(self.facts)

    @functools.cached_property
    def accepted_key_id(self) -> str | None:
        """The secret key an allowed request of this plan was accepted with, for `RecentAcceptedKeys`."""
        credential = self.facts.credential
        return credential.key_id if isinstance(credential, AcceptedSecretKey) else None

    @functools.cached_property
    def refusal(self) -> Refusal | None:
        """`credential_refusal` of the facts."""
        return credential_refusal(self.facts)


def carried_by_identity(facts: RequestFacts) -> bool:
    """Carried by the real internal token, an accepted secret key or a valid upload token: not counted by address."""
    return facts.internal is InternalToken.REAL or isinstance(
        facts.credential, AcceptedSecretKey | ValidUploadToken
    )


def exempt_from_block(facts: RequestFacts) -> bool:
    """The two ways through an address's `auth_failure` block."""
    # Weir's own edges share a few addresses with everyone they serve: identity, not address, lets them through
    if facts.internal is InternalToken.REAL:
        return True
    # a customer behind a shared address keeps working while someone else there guesses keys
    return isinstance(facts.credential, AcceptedSecretKey) and facts.recently_accepted_key


def plan_counts(facts: RequestFacts, rules: Mapping[RuleId, Rule]) -> CountPlan:
    """Which budgets this request spends. Rejected credentials spend the address's, never a key's or an account's.

    Counters are incremented before the decision (that is what keeps them exact across instances), so a request
    refused by another rule still spends its budgets; `app_create` and `key_rotate` therefore count attempts.
    """
    increments: list[CounterKey] = []
    credential = facts.credential
    # the post-mortem's lesson: our own traffic is told apart by the token it carries, not by where it comes from
    if not carried_by_identity(facts):
        increments.append(CounterKey.of(rules[RuleId.ADDRESS], facts.address))
    auth_failure = CounterKey.of(rules[RuleId.AUTH_FAILURE], facts.address)
    if isinstance(credential, RejectedCredential) or facts.internal is InternalToken.FORGED:
        increments.append(auth_failure)
    if isinstance(credential, AcceptedSecretKey):
        increments.append(CounterKey.of(rules[RuleId.KEY], credential.key_id))
        increments.append(CounterKey.of(rules[RuleId.OWNER], credential.account_id))
    if isinstance(credential, ValidUploadToken):
        increments.append(CounterKey.of(rules[RuleId.UPLOAD_TOKEN], credential.token_id))
    if isinstance(credential, AcceptedAccountToken) and facts.route is RouteClass.MANAGEMENT:
        if facts.operation is ManagementOperation.APP_CREATE:
            increments.append(CounterKey.of(rules[RuleId.APP_CREATE], credential.user_id))
        elif facts.operation is ManagementOperation.KEY_ROTATE:
            increments.append(CounterKey.of(rules[RuleId.KEY_ROTATE], credential.user_id))
    block_check = None if exempt_from_block(facts) else auth_failure
    return CountPlan(facts, tuple(increments), block_check)


# --- the decision -----------------------------------------------------------------------------------------------------


class Decision(NamedTuple):
    """One request's outcome. status 200 means "go on" (the route picks its own success status).

    `remember` lists budgets spent to the end of their window (key, window end) for `RefusalMemory`;
    `accepted_key_id` is a secret key to record in `RecentAcceptedKeys` (set only when the request is allowed).
    """

    status: int
    code: ProblemCode | None = None
    detail: str | None = None
    refused_by: Rule | None = None
    retry_after: int | None = None
    applied: AppliedLimit | None = None
    remember: tuple[tuple[CounterKey, int], ...] = ()
    accepted_key_id: str | None = None

    @property
    def allowed(self) -> bool:
        return self.status == 200

    def headers(self) -> dict[str, str]:
        if self.applied is not None:
            return rate_limit_headers(self.applied, self.retry_after)
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def headers_json(self) -> str:
        """`headers()` as a JSON object."""
        return rate_limit_headers_json(self.applied, self.retry_after)

    def problem(self) -> dict[str, object] | None:
        """The RFC 9457 body of a refusal, with the stable `code`; a 429 also names `rule` and `retry_after`."""
        if self.allowed or self.code is None:
            return None
        body: dict[str, object] = {
            "type": PROBLEM_TYPE_BASE + self.code,  # as every other Weir problem (shared/problems.py)
            "title": HTTPStatus(self.status).phrase,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.refused_by is not None:
            body["rule"] = str(self.refused_by.id)
            body["retry_after"] = self.retry_after
        return body


def limit_refusal(refusing: Sequence[tuple[CounterKey, int]], now: float) -> Decision:
    """429 naming the rule whose window ends last: the earliest moment a retry can succeed."""
    key, until = max(refusing, key=lambda item: (item[1], -RULE_ORDER[item[0].rule.id]))
    rule = key.rule
    wait = seconds_until(now, until)
    if rule.id is RuleId.AUTH_FAILURE:
        detail = f"too many rejected credentials from this address; retry in {wait}s"
    else:
        detail = f"the {rule.id} limit of {rule.limit} requests per {rule.window_seconds}s is spent; retry in {wait}s"
    return Decision(
        status=429,
        code="rate_limited",
        detail=detail,
        refused_by=rule,
        retry_after=wait,
        applied=AppliedLimit(rule, 0, wait),
    )


def decide(plan: CountPlan, counts: Mapping[CounterKey, int], now: float, at: WindowsAt | None = None) -> Decision:
    """The full outcome of a request from its plan and the counts after incrementing (and the block read).

    `at` is the windows at `now`, shared by the requests of a batch (made here when not given)."""
    if at is None or at.now != now:
        at = WindowsAt(now)
    refusing: list[tuple[CounterKey, int]] = []
    spent: list[tuple[CounterKey, int]] = []
    best: tuple[int, int, int] | None = None  # the tightest rule so far, as `tightness` orders them
    best_rule: Rule | None = None
    for key in plan.increments:
        count = counts.get(key)
        if count is None:
            raise ValueError(f"no count for {key.rule.id}:{key.key}")
        rule = key.rule
        limit = rule.limit
        end, reset = at.end_and_reset(rule.window_seconds)
        candidate = tightness(limit - count if count < limit else 0, reset, rule)
        if best is None or candidate < best:
            best, best_rule = candidate, rule
        if count >= limit:
            spent.append((key, end))
            # auth_failure refuses only through the block, so that its two exceptions hold for counted requests too
            if count > limit and rule.id is not RuleId.AUTH_FAILURE:
                refusing.append((key, end))
    block = plan.block_check
    if block is not None:
        incremented = block in plan.increments
        count = counts.get(block, 0)
        before = count - 1 if incremented else count
        limit = block.rule.limit
        end = at.end_and_reset(block.rule.window_seconds)[0]
        if not incremented and count >= limit:
            spent.append((block, end))
        # "past auth_failure": once the address has spent its rejected-credential budget, everything else waits
        if before >= limit:
            refusing.append((block, end))
    remember = tuple(spent)
    if refusing:
        return limit_refusal(refusing, now)._replace(remember=remember)
    chosen = None if best is None or best_rule is None else AppliedLimit(best_rule, best[0], best[1])
    refused = plan.refusal
    if refused is not None:
        return Decision(refused.status, refused.code, refused.detail, applied=chosen, remember=remember)
    # positional: made for every request, and a named tuple's keywords cost more than the rest of this line
    return Decision(200, None, None, None, None, chosen, remember, plan.accepted_key_id)


def failing_over() -> Decision:
    """A request the limits cannot decide exactly right now (the store is failing over): 503, retry shortly."""
    return Decision(503, "unavailable", "the limits store is failing over; retry in a moment",
                    retry_after=FAILOVER_RETRY_AFTER_S)
