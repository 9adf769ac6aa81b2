"""What an instance remembers: spent budgets and recently accepted secret keys."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.auth.domain.access import RouteClass
from services.auth.domain.credentials import InternalToken
from services.auth.domain.limits import plan_counts
from services.auth.domain.memory import PURGES_PER_HORIZON, RecentAcceptedKeys, RefusalMemory, refusal_from_memory
from services.auth.domain.rules import CounterKey, RuleId, rules_from
from services.auth.domain.windows import retry_after
from tests.unit.authfixtures import (
    ADDRESS,
    OTHER_ADDRESS,
    REJECTED_KEY,
    SECRET_KEY,
    SMALL,
    T0,
    WINDOW,
    Instance,
    facts,
    statuses,
)


def test_refusal_memory_holds_until_the_window_end() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    key = CounterKey.of(rule, ADDRESS)
    memory = RefusalMemory()
    end = key.window_end(T0)
    memory.remember(key, end, T0)
    assert memory.refused_until(key, T0) == end
    assert memory.refused_until(key, math.nextafter(end, 0)) == end
    assert memory.refused_until(key, end) is None
    assert len(memory) == 0
    memory.remember(key, end, end)  # already over: not kept
    assert len(memory) == 0


def test_refusal_memory_forgets_ended_windows_by_itself() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    memory = RefusalMemory()
    for i in range(50):
        key = CounterKey.of(rule, f"192.0.2.{i}")
        memory.remember(key, key.window_end(T0), T0)
    assert len(memory) == 50
    later = T0 + rule.window_seconds
    fresh = CounterKey.of(rule, OTHER_ADDRESS)
    memory.remember(fresh, fresh.window_end(later), later)
    assert len(memory) == 1
    assert memory.purge(later + rule.window_seconds) == 1 and len(memory) == 0


def test_a_spent_budget_is_remembered_at_the_request_that_spent_it() -> None:
    instance = Instance(SMALL)
    limit = SMALL.limit_key_per_minute
    decisions = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0) for _ in range(limit)]
    assert all(d.allowed for d in decisions)
    assert [bool(d.remember) for d in decisions] == [False] * (limit - 1) + [True]
    calls = instance.store_calls
    flood = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 1) for _ in range(limit * 10)]
    assert set(statuses(flood)) == {429}
    assert instance.store_calls == calls, "a flood costs the store nothing"


def test_memory_of_auth_failure_does_not_refuse_the_exempt() -> None:
    rules = rules_from(SMALL)
    memory = RefusalMemory()
    key = CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS)
    memory.remember(key, key.window_end(T0), T0)
    exempt = plan_counts(facts(RouteClass.SECRET, REJECTED_KEY, InternalToken.REAL), rules)
    assert key in exempt.increments and refusal_from_memory(exempt, memory, T0) is None
    recent = plan_counts(facts(RouteClass.SECRET, SECRET_KEY, recently_accepted_key=True), rules)
    assert refusal_from_memory(recent, memory, T0) is None
    blocked = refusal_from_memory(plan_counts(facts(RouteClass.PUBLIC), rules), memory, T0 + 1)
    assert blocked is not None and blocked.refused_by == rules[RuleId.AUTH_FAILURE]
    assert blocked.retry_after == retry_after(T0 + 1, SMALL.limit_window_seconds)
    assert refusal_from_memory(plan_counts(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS), rules), memory, T0) is None


@given(st.lists(st.floats(min_value=0, max_value=3 * WINDOW, allow_nan=False), max_size=60))
@settings(max_examples=60)
def test_memory_changes_no_answer_of_a_single_budget(offsets: list[float]) -> None:
    with_memory, without = Instance(SMALL), Instance(SMALL, use_memory=False)
    for offset in sorted(offsets):
        a = with_memory.check(facts(RouteClass.PUBLIC), T0 + offset)
        b = without.check(facts(RouteClass.PUBLIC), T0 + offset)
        assert (a.status, a.retry_after, a.refused_by) == (b.status, b.retry_after, b.refused_by)


def test_recent_accepted_keys() -> None:
    horizon = SMALL.limit_window_seconds
    recent = RecentAcceptedKeys(horizon)
    recent.record(ADDRESS, "key-1", T0)
    assert recent.accepted_within(ADDRESS, "key-1", T0)
    assert recent.accepted_within(ADDRESS, "key-1", math.nextafter(T0 + horizon, 0))
    assert not recent.accepted_within(ADDRESS, "key-1", T0 + horizon)
    assert not recent.accepted_within(OTHER_ADDRESS, "key-1", T0)
    assert not recent.accepted_within(ADDRESS, "key-2", T0)
    assert not recent.accepted_within(ADDRESS, "key-1", T0 - 1)
    recent.record(ADDRESS, "key-2", T0 + 1)
    recent.record(ADDRESS, "key-1", T0 - 5)  # an earlier sighting (another instance's record) keeps the later one
    assert recent.accepted_from(ADDRESS, T0 + 1) == {"key-1": T0, "key-2": T0 + 1}
    assert recent.accepted_from(ADDRESS, T0 + horizon) == {"key-2": T0 + 1}
    assert recent.accepted_from(OTHER_ADDRESS, T0) == {}
    recent.record(OTHER_ADDRESS, "key-1", T0 + horizon)  # purges what has aged out
    assert len(recent) == 2
    assert recent.purge(T0 + horizon + 1) == 1
    assert recent.purge(T0 + 2 * horizon) == 1 and len(recent) == 0


def test_recent_accepted_keys_purge_a_bounded_number_of_times_and_keep_a_bounded_excess() -> None:
    """Addresses each seen once age out one after another: the purges (each reads every entry) stay at most
    PURGES_PER_HORIZON per horizon, and an aged-out entry lingers at most a PURGES_PER_HORIZON-th of the horizon."""
    horizon = SMALL.limit_window_seconds
    recent = RecentAcceptedKeys(horizon)
    purges = 0
    real_purge = recent.purge

    def counted(now: float) -> int:
        nonlocal purges
        purges += 1
        return real_purge(now)

    recent.purge = counted  # type: ignore[method-assign]
    step = horizon / 1000  # a new address every thousandth of the horizon, for three horizons
    for i in range(3000):
        now = T0 + i * step
        recent.record(f"10.0.{i // 256}.{i % 256}", "key-1", now)
        assert len(recent) <= 1000 + 1000 / PURGES_PER_HORIZON + 1  # within the horizon, and the lingering tenth
    assert purges <= 2 * PURGES_PER_HORIZON + 1  # none before the first horizon; then at most ten per horizon
    assert recent.accepted_from("10.0.0.0", T0 + 3000 * step) == {}  # lingering or not, an old entry answers nothing


def test_recent_keys_recorded_as_a_batch_are_recorded_as_one_by_one() -> None:
    horizon = SMALL.limit_window_seconds
    pairs = [(f"10.0.0.{i % 5}", f"key-{i % 3}") for i in range(20)]
    one, many = RecentAcceptedKeys(horizon), RecentAcceptedKeys(horizon)
    for step, now in enumerate([T0, T0 + 1, T0 + 0.5, T0 + horizon * 2]):  # an earlier moment never moves one back
        batch = pairs[step * 5:] if step < 3 else pairs[:2]
        for address, key_id in batch:
            one.record(address, key_id, now)
        many.record_many(batch, now)
        assert one._last == many._last
        for address, key_id in pairs:
            assert many.accepted_within(address, key_id, now + 1) == one.accepted_within(address, key_id, now + 1)

def test_a_spent_budget_is_not_refused_from_memory_while_leased_counts_are_held() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    key_counter = next(k for k in plan.increments if k.rule.id is RuleId.KEY)
    memory = RefusalMemory()
    memory.remember(key_counter, int(key_counter.window_end(T0)), T0)
    assert refusal_from_memory(plan, memory, T0) is not None
    assert refusal_from_memory(plan, memory, T0, lambda k: k == key_counter) is None
    memory.forget(key_counter)  # given back elsewhere: room again
    assert refusal_from_memory(plan, memory, T0) is None
