"""What each request spends and how it is decided (SPEC section 3), rule by rule through a whole instance.

Every count is derived from the settings; no limit is repeated as a literal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.auth.counters import LocalCounters
from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedSecretKey,
    ManagementOperation,
    RejectedCredential,
    RejectionReason,
    RequestFacts,
    RouteClass,
    ValidUploadToken,
    credential_refusal,
    rejections,
)
from services.auth.domain.credentials import KEY_BODY_LENGTH, InternalToken, key_prefix
from services.auth.domain.limits import Decision, decide, plan_counts
from services.auth.domain.rules import HOUR_SECONDS, CounterKey, Rule, RuleId, rules_from
from services.auth.domain.windows import WindowsAt, retry_after
from services.auth.settings import AuthSettings
from tests.unit.authfixtures import (
    ACCOUNT_TOKEN,
    ADDRESS,
    BOTH,
    EXPIRED_TOKEN,
    INVALID,
    MISSING,
    OTHER_ADDRESS,
    OUTCOMES,
    PUBLISHABLE_KEY,
    REJECTED_KEY,
    REJECTED_TOKEN,
    SECRET_KEY,
    SMALL,
    T0,
    UPLOAD_TOKEN,
    WINDOW,
    Instance,
    count_locally,
    facts,
    statuses,
)

# --- the plan: every credential outcome x internal token x route x operation ------------------------------------------


def _carried(f: RequestFacts) -> bool:
    return f.internal is InternalToken.REAL or isinstance(f.credential, AcceptedSecretKey | ValidUploadToken)


def _rejected(f: RequestFacts) -> bool:
    return isinstance(f.credential, RejectedCredential) or f.internal is InternalToken.FORGED


MATRIX = [
    pytest.param(route, name, internal, operation, recent, id=f"{route}-{name}-{internal}-{operation}-{recent}")
    for route, name, internal, operation, recent in itertools.product(
        list(RouteClass), list(OUTCOMES), list(InternalToken), [None, *ManagementOperation], [False, True]
    )
]


@pytest.mark.parametrize(("route", "name", "internal", "operation", "recent"), MATRIX)
def test_the_plan_matrix(
    route: RouteClass, name: str, internal: InternalToken, operation: ManagementOperation | None, recent: bool
) -> None:
    rules = rules_from(SMALL)
    f = facts(route, OUTCOMES[name], internal, operation=operation, recently_accepted_key=recent, video_id="video-1")
    plan = plan_counts(f, rules)
    counted = {key.rule.id for key in plan.increments}

    assert len(plan.increments) == len(set(plan.increments)) == len(counted), "each budget at most once"
    assert (RuleId.ADDRESS in counted) is not _carried(f)
    if internal is InternalToken.REAL:
        assert RuleId.ADDRESS not in counted
    assert (RuleId.AUTH_FAILURE in counted) is _rejected(f)
    assert ({RuleId.KEY, RuleId.OWNER} <= counted) is isinstance(f.credential, AcceptedSecretKey)
    assert ({RuleId.KEY, RuleId.OWNER} & counted == set()) is not isinstance(f.credential, AcceptedSecretKey)
    if isinstance(f.credential, RejectedCredential):
        assert not counted & {RuleId.KEY, RuleId.OWNER, RuleId.UPLOAD_TOKEN, RuleId.APP_CREATE, RuleId.KEY_ROTATE}
    assert (RuleId.UPLOAD_TOKEN in counted) is isinstance(f.credential, ValidUploadToken)
    manages = isinstance(f.credential, AcceptedAccountToken) and route is RouteClass.MANAGEMENT
    assert (RuleId.APP_CREATE in counted) is (manages and operation is ManagementOperation.APP_CREATE)
    assert (RuleId.KEY_ROTATE in counted) is (manages and operation is ManagementOperation.KEY_ROTATE)

    exempt = internal is InternalToken.REAL or (isinstance(f.credential, AcceptedSecretKey) and recent)
    assert (plan.block_check is None) is exempt
    if plan.block_check is not None:
        assert plan.block_check == CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS)
        assert plan.reads == (() if RuleId.AUTH_FAILURE in counted else (plan.block_check,))
    assert len(rejections(f)) == int(isinstance(f.credential, RejectedCredential)) + int(
        internal is InternalToken.FORGED
    )


def test_the_plan_keys_each_budget_by_its_subject() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY, InternalToken.FORGED), rules)
    assert set(plan.increments) == {
        CounterKey.of(rules[RuleId.KEY], SECRET_KEY.key_id),
        CounterKey.of(rules[RuleId.OWNER], SECRET_KEY.account_id),
        CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS),
    }
    plan = plan_counts(facts(RouteClass.SDK, UPLOAD_TOKEN), rules)
    assert plan.increments == (CounterKey.of(rules[RuleId.UPLOAD_TOKEN], UPLOAD_TOKEN.token_id),)
    plan = plan_counts(facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE), rules)
    assert set(plan.increments) == {
        CounterKey.of(rules[RuleId.ADDRESS], ADDRESS),
        CounterKey.of(rules[RuleId.APP_CREATE], ACCOUNT_TOKEN.user_id),
    }
    assert plan_counts(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), rules).increments == ()


# --- limits, rule by rule, through a whole instance -------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    rule: RuleId
    request: Callable[[int], RequestFacts]
    """The i-th request of a flood on this rule's budget."""
    within_status: int
    """What a request within budget gets (401 for the rejected credentials that spend auth_failure)."""


SCENARIOS = [
    Scenario(RuleId.ADDRESS, lambda i: facts(RouteClass.PUBLIC), 200),
    Scenario(RuleId.AUTH_FAILURE, lambda i: facts(RouteClass.SECRET, REJECTED_KEY), 401),
    Scenario(RuleId.KEY, lambda i: facts(RouteClass.SECRET, SECRET_KEY), 200),
    Scenario(RuleId.UPLOAD_TOKEN, lambda i: facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"), 200),
    Scenario(
        RuleId.APP_CREATE,
        lambda i: facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE,
                        address=f"192.0.2.{i % 250}"),
        200,
    ),
    Scenario(
        RuleId.KEY_ROTATE,
        lambda i: facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.KEY_ROTATE,
                        address=f"192.0.2.{i % 250}"),
        200,
    ),
    Scenario(
        RuleId.OWNER,
        # a new key of the same account every time: no key budget binds, only the account's
        lambda i: facts(RouteClass.SECRET, AcceptedSecretKey(f"key-{i}", "acct-1", "app-1")),
        200,
    ),
]


def _limit_for(cfg: AuthSettings, scenario: Scenario) -> Rule:
    return rules_from(cfg)[scenario.rule]


@BOTH
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.rule.value for s in SCENARIOS])
def test_each_rule_admits_exactly_its_limit_in_a_window(cfg: AuthSettings, scenario: Scenario) -> None:
    rule = _limit_for(cfg, scenario)
    instance = Instance(cfg)
    now = T0 + 0.25
    within = [instance.check(scenario.request(i), now) for i in range(rule.limit)]
    assert set(statuses(within)) == {scenario.within_status}
    refused = instance.check(scenario.request(rule.limit), now)
    assert refused.status == 429 and refused.code == "rate_limited"
    assert refused.refused_by == rule
    assert refused.retry_after == retry_after(now, rule.window_seconds) == refused.applied.reset  # type: ignore[union-attr]
    assert refused.headers()["Retry-After"] == str(refused.retry_after)
    # refused for the rest of the window, answered without the store
    calls = instance.store_calls
    last = math.nextafter(T0 + rule.window_seconds, 0)
    assert instance.check(scenario.request(rule.limit + 1), last).status == 429
    assert instance.store_calls == calls
    # and the next window starts afresh
    assert instance.check(scenario.request(rule.limit + 2), T0 + rule.window_seconds).status == scenario.within_status


@BOTH
def test_remaining_counts_down_to_zero_and_never_below(cfg: AuthSettings) -> None:
    rule = rules_from(cfg)[RuleId.KEY]
    instance = Instance(cfg, use_memory=False)
    remaining = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0).headers()["X-RateLimit-Remaining"]
                 for _ in range(rule.limit + 3)]
    assert [int(r) for r in remaining] == [*range(rule.limit - 1, -1, -1), 0, 0, 0]


@BOTH
def test_an_account_is_held_to_the_owner_limit_over_many_keys(cfg: AuthSettings) -> None:
    rules = rules_from(cfg)
    key_limit, owner_limit = rules[RuleId.KEY].limit, rules[RuleId.OWNER].limit
    keys = owner_limit // key_limit + 1  # enough keys that, each under its own limit, they pass the account's
    assert keys * key_limit > owner_limit
    instance = Instance(cfg)
    admitted: dict[str, int] = dict.fromkeys((f"key-{k}" for k in range(keys)), 0)
    refused_by: set[RuleId] = set()
    for i in range(keys * key_limit):
        key_id = f"key-{i % keys}"
        decision = instance.check(facts(RouteClass.SECRET, AcceptedSecretKey(key_id, "acct-1", "app-1")), T0)
        if decision.allowed:
            admitted[key_id] += 1
        else:
            assert decision.refused_by is not None
            refused_by.add(decision.refused_by.id)
    assert sum(admitted.values()) == owner_limit
    assert all(n <= key_limit for n in admitted.values())
    assert refused_by == {RuleId.OWNER}
    # another account is untouched
    assert instance.check(facts(RouteClass.SECRET, AcceptedSecretKey("key-x", "acct-2", "app-2")), T0).allowed


@BOTH
def test_rejected_credentials_leave_the_keys_and_the_accounts_remaining_unchanged(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    before = instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0)
    # near misses of the very key, garbled upload tokens and forged internal tokens, up to the block and beyond
    near_miss = RejectedCredential("secret_key", RejectionReason.UNKNOWN, key_prefix("wsk_" + "a" * KEY_BODY_LENGTH))
    for _ in range(cfg.limit_auth_failure_per_minute * 2):
        instance.check(facts(RouteClass.SECRET, near_miss), T0)
        instance.check(facts(RouteClass.SDK, REJECTED_TOKEN, video_id="video-1"), T0)
        instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.FORGED), T0)
    rules = rules_from(cfg)
    assert instance.count(CounterKey.of(rules[RuleId.KEY], SECRET_KEY.key_id), T0) == 1
    assert instance.count(CounterKey.of(rules[RuleId.OWNER], SECRET_KEY.account_id), T0) == 1
    after = instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0)
    assert before.applied is not None and after.applied is not None
    assert after.applied.remaining == before.applied.remaining - 1


# --- the auth_failure block -------------------------------------------------------------------------------------------


def _spend_auth_failures(instance: Instance, cfg: AuthSettings, now: float, address: str = ADDRESS) -> None:
    for _ in range(cfg.limit_auth_failure_per_minute):
        assert instance.check(facts(RouteClass.SECRET, REJECTED_KEY, address=address), now).status == 401


@BOTH
def test_past_auth_failure_every_request_from_the_address_waits_for_the_window_end(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    now = T0 + 10.5
    _spend_auth_failures(instance, cfg, now)
    others = [
        facts(RouteClass.PUBLIC),
        facts(RouteClass.SECRET),
        facts(RouteClass.SECRET, REJECTED_KEY),
        facts(RouteClass.SECRET, SECRET_KEY),  # a key not accepted here before the block
        facts(RouteClass.SDK, PUBLISHABLE_KEY),
        facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"),
        facts(RouteClass.SDK, EXPIRED_TOKEN, video_id="video-1"),
        facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN),
        facts(RouteClass.INTERNAL, internal=InternalToken.FORGED),
    ]
    for f in others:
        d = instance.check(f, now)
        assert (d.status, d.refused_by) == (429, rules_from(cfg)[RuleId.AUTH_FAILURE]), f
        assert d.retry_after == retry_after(now, cfg.limit_window_seconds)
        assert d.problem() is not None and d.problem()["rule"] == "auth_failure"  # type: ignore[index]
    # another address is not affected, and the window's end lifts the block
    assert instance.check(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS), now).allowed
    assert all(instance.check(f, T0 + cfg.limit_window_seconds).status != 429 for f in others)


@BOTH
def test_the_block_starts_after_exactly_the_limit_of_rejections(cfg: AuthSettings) -> None:
    # with the store read only: a fresh instance per request has no memory of refusals
    store = LocalCounters()
    rules = rules_from(cfg)

    def check(f: RequestFacts) -> Decision:
        plan = plan_counts(f, rules)
        return decide(plan, count_locally(store, plan, T0), T0)

    for _ in range(cfg.limit_auth_failure_per_minute - 1):
        assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 401
        assert check(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS)).allowed
    assert check(facts(RouteClass.PUBLIC)).allowed
    assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 401  # the limit-th rejection is still answered
    assert check(facts(RouteClass.PUBLIC)).status == 429
    assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 429


@BOTH
def test_a_key_accepted_here_within_the_last_window_passes_the_block(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    accepted_at = T0 + 1
    assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), accepted_at).allowed
    _spend_auth_failures(instance, cfg, T0 + 2)
    assert instance.check(facts(RouteClass.PUBLIC), T0 + 3).status == 429
    decision = instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 3)
    assert decision.allowed and decision.applied is not None and decision.applied.rule.id is RuleId.KEY
    # another key of the account, or the same key from another blocked address: no exemption
    other_key = AcceptedSecretKey("key-9", SECRET_KEY.account_id, SECRET_KEY.app_id)
    assert instance.check(facts(RouteClass.SECRET, other_key), T0 + 3).status == 429
    _spend_auth_failures(instance, cfg, T0 + 3, OTHER_ADDRESS)
    assert instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0 + 4).status == 429


def test_the_recent_key_exemption_lasts_one_window_from_the_last_acceptance() -> None:
    window = SMALL.limit_window_seconds
    for asked_at, expected in ((T0 + window + 0.5, 200), (T0 + window + 1, 429)):
        instance = Instance(SMALL)
        assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 1).allowed
        _spend_auth_failures(instance, SMALL, T0 + window)  # the next window: the address is blocked
        assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), asked_at).status == expected, asked_at


@BOTH
def test_the_real_internal_token_always_passes_the_block(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    _spend_auth_failures(instance, cfg, T0)
    assert instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0).allowed
    # even beside a rejected credential, it is not held by the block (the route still refuses the bad key)
    d = instance.check(facts(RouteClass.SECRET, REJECTED_KEY, InternalToken.REAL), T0)
    assert (d.status, d.code) == INVALID


def test_a_skipped_block_read_means_not_blocked() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.PUBLIC), rules)
    assert plan.reads
    assert decide(plan, dict.fromkeys(plan.increments, 1), T0).allowed
    blocked = {**dict.fromkeys(plan.increments, 1), plan.reads[0]: SMALL.limit_auth_failure_per_minute}
    assert decide(plan, blocked, T0).status == 429


def test_a_count_missing_for_an_increment_is_an_error() -> None:
    plan = plan_counts(facts(RouteClass.PUBLIC), rules_from(SMALL))
    with pytest.raises(ValueError):
        decide(plan, {}, T0)


# --- the post-mortem's three, with the address limit small ------------------------------------------------------------


@BOTH
def test_the_internal_token_never_counts_against_the_address(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    many = rules_from(cfg)[RuleId.ADDRESS].limit * 4
    real = [instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0) for _ in range(many)]
    assert set(statuses(real)) == {200}
    first_ordinary = instance.check(facts(RouteClass.PUBLIC), T0)
    assert first_ordinary.headers()["X-RateLimit-Remaining"] == str(cfg.limit_address_per_minute - 1)


@BOTH
def test_ordinary_requests_pass_up_to_the_address_limit_then_wait(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    limit = rules_from(cfg)[RuleId.ADDRESS].limit
    results = [instance.check(facts(RouteClass.PUBLIC), T0 + 5) for _ in range(limit * 4)]
    assert statuses(results) == [200] * limit + [429] * (limit * 3)
    assert {r.retry_after for r in results[limit:]} == {retry_after(T0 + 5, cfg.limit_window_seconds)}


def test_forged_internal_tokens_are_refused_like_ordinary_requests() -> None:
    # the address limit below the auth_failure limit, as in the post-mortem's test, so only the address binds
    cfg = SMALL.model_copy(update={"limit_address_per_minute": 5, "limit_auth_failure_per_minute": 50})
    limit = cfg.limit_address_per_minute
    many = limit * 4
    forged = Instance(cfg)
    ordinary = Instance(cfg)
    forged_results = [
        forged.check(facts(RouteClass.INTERNAL, internal=InternalToken.FORGED), T0) for _ in range(many)
    ]
    ordinary_results = [ordinary.check(facts(RouteClass.PUBLIC), T0) for _ in range(many)]
    assert [s == 429 for s in statuses(forged_results)] == [s == 429 for s in statuses(ordinary_results)]
    # /internal answers 401 until the 429s start
    assert statuses(forged_results) == [401] * limit + [429] * (many - limit)
    # each forged token that reached the store counted as a rejected credential; once the address budget was
    # spent (at the limit-th request) the rest met the instance's memory and cost the store nothing
    key = CounterKey.of(rules_from(cfg)[RuleId.AUTH_FAILURE], ADDRESS)
    assert forged.count(key, T0) == limit == forged.store_calls
    assert all(r.code == "invalid_credential" for r in forged_results[:limit])


# --- refusal order and naming -----------------------------------------------------------------------------------------


def test_limits_come_before_credential_refusals() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET), rules)
    over = {**dict.fromkeys(plan.increments, SMALL.limit_address_per_minute + 1), **dict.fromkeys(plan.reads, 0)}
    assert decide(plan, over, T0).status == 429
    within = {**dict.fromkeys(plan.increments, 1), **dict.fromkeys(plan.reads, 0)}
    assert (decide(plan, within, T0).status, decide(plan, within, T0).code) == MISSING


def test_a_refusal_names_the_rule_whose_window_ends_last() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(
        facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE), rules
    )
    counts = {key: key.rule.limit + 1 for key in plan.increments} | dict.fromkeys(plan.reads, 0)
    now = T0 + 30
    d = decide(plan, counts, now)
    assert d.refused_by == rules[RuleId.APP_CREATE]
    assert d.retry_after == retry_after(now, HOUR_SECONDS)


def test_ties_between_refusals_go_to_spec_order() -> None:
    rules = rules_from(SMALL)
    f = facts(RouteClass.SECRET, REJECTED_KEY)
    plan = plan_counts(f, rules)
    counts = {key: key.rule.limit + 1 for key in plan.increments}
    assert decide(plan, counts, T0).refused_by == rules[RuleId.ADDRESS]
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    counts = {key: key.rule.limit + 1 for key in plan.increments} | dict.fromkeys(plan.reads, 0)
    assert decide(plan, counts, T0).refused_by == rules[RuleId.KEY]


# --- properties -------------------------------------------------------------------------------------------------------

_REQUEST_FACTS = [
    facts(RouteClass.PUBLIC),
    facts(RouteClass.PUBLIC, address=OTHER_ADDRESS),
    facts(RouteClass.SECRET, SECRET_KEY),
    facts(RouteClass.SECRET, AcceptedSecretKey("key-2", "acct-1", "app-1")),
    facts(RouteClass.SECRET, REJECTED_KEY),
    facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"),
    facts(RouteClass.INTERNAL, internal=InternalToken.FORGED),
    facts(RouteClass.INTERNAL, internal=InternalToken.REAL),
    facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE),
]
_REQUESTS = st.sampled_from(_REQUEST_FACTS)


@given(st.lists(st.tuples(_REQUESTS, st.floats(min_value=0, max_value=WINDOW * 0.999)), max_size=120))
@settings(max_examples=80)
def test_no_budget_ever_admits_more_than_its_limit_in_a_window(requests: list[tuple[RequestFacts, float]]) -> None:
    instance = Instance(SMALL)
    rules = instance.rules
    admitted: dict[CounterKey, int] = {}
    for f, offset in sorted(requests, key=lambda r: r[1]):
        d = instance.check(f, T0 + offset)
        if d.status != 429:
            for key in plan_counts(replace(f, recently_accepted_key=False), rules).increments:
                admitted[key] = admitted.get(key, 0) + 1
    for key, n in admitted.items():
        assert n <= key.rule.limit, key


@given(st.lists(st.tuples(_REQUESTS, st.integers(min_value=0, max_value=40)), min_size=1, max_size=30),
       st.floats(min_value=0, max_value=HOUR_SECONDS * 2, allow_nan=False), st.booleans())
@settings(max_examples=200)
def test_a_batch_decided_with_shared_windows_is_decided_as_each_alone(
    requests: list[tuple[RequestFacts, int]], offset: float, block_spent: bool
) -> None:
    """`decide` with one `WindowsAt` for a batch gives what it gives each request alone, at every count: under,
    at and past every limit, with the block's counter read or incremented."""
    rules = rules_from(SMALL)
    now = T0 + offset
    at = WindowsAt(now)
    for f, count in requests:
        plan = plan_counts(f, rules)
        counts = {key: count for key in plan.increments}
        for key in plan.reads:
            counts[key] = key.rule.limit if block_spent else count
        assert decide(plan, counts, now, at) == decide(plan, counts, now)
    stale = WindowsAt(now - WINDOW)  # windows of another moment are not used
    f, count = requests[0]
    plan = plan_counts(f, rules)
    counts = {key: count for key in [*plan.increments, *plan.reads]}
    assert decide(plan, counts, now, stale) == decide(plan, counts, now)


def test_what_a_plan_alone_decides_is_what_the_functions_say() -> None:
    rules = rules_from(SMALL)
    for f in _REQUEST_FACTS:
        plan = plan_counts(f, rules)
        assert plan.rejections == rejections(f)
        assert plan.refusal == credential_refusal(f)
        key_id = f.credential.key_id if isinstance(f.credential, AcceptedSecretKey) else None
        assert plan.accepted_key_id == key_id
        if plan.refusal is None:
            counts = {key: 0 for key in [*plan.increments, *plan.reads]}
            assert decide(plan, counts, T0).accepted_key_id == key_id
