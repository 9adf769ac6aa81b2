"""The lease rules: how many counts an instance takes ahead, which it may admit on, and when it gives them back;
and, simulated on the rules alone, that instances sharing one counter never admit more than the limit and, while each
keeps seeing requests, admit exactly the limit. Every bound is derived from the policy and the limit under test."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.auth.domain.lease_rules import (
    LeasePolicy,
    decayed,
    give_back_due,
    granted_numbers,
    lease_size,
    leases_for,
    prefetch_size,
    usable,
)
from services.auth.domain.rules import RuleId
from services.auth.settings import AuthSettings

DEFAULTS = AuthSettings()
POLICY = LeasePolicy(DEFAULTS.counter_lease_max, DEFAULTS.counter_lease_fraction)
LEASED_RULES = [r for r in RuleId if leases_for(r)]


def test_only_the_auth_failure_counter_is_never_leased() -> None:
    assert [r for r in RuleId if not leases_for(r)] == [RuleId.AUTH_FAILURE]


def test_a_policy_needs_positive_sizes() -> None:
    with pytest.raises(ValueError):
        LeasePolicy(0, 8)
    with pytest.raises(ValueError):
        LeasePolicy(8, 0)


@pytest.mark.parametrize("rule", list(RuleId))
def test_lease_size_bounds(rule: RuleId) -> None:
    limits = [1, 5, DEFAULTS.limit_key_per_minute, DEFAULTS.limit_owner_per_minute, 10**9]
    sizes = [0, 1, 2, 64, POLICY.max_lease, POLICY.max_lease * 4]
    for wanted, limit, seen_part, previous, demand in itertools.product(
        [0, 1, 2, 7], limits, [0, .5, .9, 1, 2], sizes, sizes
    ):
        seen = int(limit * seen_part)
        size = lease_size(POLICY, rule, wanted, limit, seen, previous, demand)
        headroom = limit - seen
        assert size >= wanted  # the waiting requests are always covered by one grant
        if not leases_for(rule) or headroom <= wanted:
            assert size == wanted
            continue
        beyond = size - wanted
        if beyond:
            assert size <= min(POLICY.max_lease, headroom // POLICY.fraction)  # the caps, beyond what waits
            assert size <= demand  # never more than this instance used over the horizon
            assert size <= max(2 * previous, 1)  # grows at most by doubling
        else:
            assert min(max(2 * previous, 1), demand, POLICY.max_lease, headroom // POLICY.fraction) <= wanted


def test_a_counter_not_used_lately_takes_only_what_waits() -> None:
    for previous in (0, 1, POLICY.max_lease):
        assert lease_size(POLICY, RuleId.KEY, 1, 10**9, 0, previous, 0) == 1
        assert prefetch_size(POLICY, RuleId.KEY, 0, 10**9, 0, previous, 0) == 0


def test_a_busy_counter_doubles_up_to_the_cap_then_stays() -> None:
    limit = 10**9
    sizes, previous = [], 0
    for _ in range(20):
        previous = lease_size(POLICY, RuleId.KEY, 1, limit, 0, previous, POLICY.max_lease * 4)
        sizes.append(previous)
    assert sizes == [min(2**i, POLICY.max_lease) for i in range(20)]


def test_a_grant_follows_the_demand() -> None:
    for demand in (1, 3, 40, POLICY.max_lease - 1):
        assert lease_size(POLICY, RuleId.KEY, 1, 10**9, 0, POLICY.max_lease, demand) == demand


def test_near_the_limit_every_count_is_asked_for_when_needed() -> None:
    limit = DEFAULTS.limit_key_per_minute
    for seen in range(limit - POLICY.fraction + 1, limit + 2):
        assert lease_size(POLICY, RuleId.KEY, 1, limit, seen, POLICY.max_lease, POLICY.max_lease) == 1
        assert lease_size(POLICY, RuleId.KEY, 0, limit, seen, POLICY.max_lease, POLICY.max_lease) == 0
        assert prefetch_size(POLICY, RuleId.KEY, 0, limit, seen, POLICY.max_lease, POLICY.max_lease) == 0


def test_counts_are_never_negative() -> None:
    for args in [(-1, 5, 0, 0, 0), (1, -5, 0, 0, 0), (1, 5, 0, -1, 0), (1, 5, 0, 0, -1)]:
        with pytest.raises(ValueError):
            lease_size(POLICY, RuleId.KEY, *args)


@pytest.mark.parametrize("demand", [0, 1, 2, 3, 8, POLICY.max_lease, POLICY.max_lease * 4])
def test_prefetch_once_what_is_held_covers_less_than_half_the_demand(demand: int) -> None:
    limit = 10**9
    target = min(demand, POLICY.max_lease)
    for held in range(target + 2):
        size = prefetch_size(POLICY, RuleId.KEY, held, limit, 0, POLICY.max_lease, demand)
        if target < 2 or held * 2 > target:
            assert size == 0
        else:
            assert size == lease_size(POLICY, RuleId.KEY, 0, limit, 0, POLICY.max_lease, demand) > 0
    assert prefetch_size(POLICY, RuleId.AUTH_FAILURE, 0, limit, 0, POLICY.max_lease, demand) == 0


def test_demand_decays_over_the_horizon() -> None:
    horizon = DEFAULTS.counter_lease_idle_ms / 1000 / 2
    assert decayed(100.0, 5.0, 5.0, horizon) == 100.0
    assert decayed(100.0, 5.0, 4.0, horizon) == 100.0  # a clock that steps back decays nothing
    assert decayed(100.0, 5.0, 5.0 + horizon, horizon) == pytest.approx(100.0 / math.e)
    assert decayed(100.0, 5.0, 5.0 + 20 * horizon, horizon) < 1e-6


def test_granted_numbers_and_the_usable_part() -> None:
    assert list(granted_numbers(10, 4)) == [7, 8, 9, 10]
    assert list(granted_numbers(10, 0)) == []
    with pytest.raises(ValueError):
        granted_numbers(10, -1)
    limit = 8
    assert list(usable(granted_numbers(10, 4), limit)) == [7, 8]
    assert list(usable(granted_numbers(6, 4), limit)) == [3, 4, 5, 6]
    assert list(usable(granted_numbers(20, 4), limit)) == []
    for total, size in itertools.product(range(0, 3 * limit), range(0, limit + 2)):
        numbers = granted_numbers(total, size)
        kept = usable(numbers, limit)
        assert all(n <= limit for n in kept) and set(kept) <= set(numbers)
        assert len(kept) == len([n for n in numbers if n <= limit])


def test_give_back_once_idle() -> None:
    idle = DEFAULTS.counter_lease_idle_ms / 1000
    assert give_back_due(3, 0.0, idle, idle)
    assert not give_back_due(3, 0.0, idle * 0.99, idle)
    assert not give_back_due(0, 0.0, idle * 10, idle)


# --- a simulation of instances sharing one counter, on the pure rules -------------------------------------------------


class SimInstance:
    """One instance's lease of one counter, driven by the pure rules; the shared counter is a plain int."""

    def __init__(self, policy: LeasePolicy, limit: int) -> None:
        self.policy, self.limit = policy, limit
        self.held: list[int] = []
        self.demand = policy.max_lease  # a busy counter
        self.seen = 0
        self.previous = 0
        self.admitted = 0

    def grant(self, shared: list[int], wanted: int) -> list[int]:
        size = lease_size(self.policy, RuleId.KEY, wanted, self.limit, self.seen, self.previous, self.demand)
        shared[0] += size
        self.seen, self.previous = max(self.seen, shared[0]), size
        numbers = granted_numbers(shared[0], size)
        self.held += list(usable(numbers[wanted:], self.limit))
        return list(numbers[:wanted])

    def request(self, shared: list[int]) -> None:
        number = self.held.pop(0) if self.held else self.grant(shared, 1)[0]
        if number <= self.limit:
            self.admitted += 1
        size = prefetch_size(self.policy, RuleId.KEY, len(self.held), self.limit, self.seen, self.previous,
                             self.demand)
        if size:
            self.grant(shared, 0)

    def give_back(self, shared: list[int]) -> None:
        shared[0] -= len(self.held)
        self.seen -= len(self.held)
        self.held.clear()
        self.previous = 0


@given(
    limit=st.integers(1, 2000),
    max_lease=st.integers(1, 512),
    fraction=st.integers(1, 16),
    steps=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=3000),
)
@settings(max_examples=150, deadline=None)
def test_simulated_instances_never_admit_more_than_the_limit(
    limit: int, max_lease: int, fraction: int, steps: list[tuple[int, bool]]
) -> None:
    policy = LeasePolicy(max_lease, fraction)
    shared = [0]
    instances = [SimInstance(policy, limit) for _ in range(3)]
    for who, give_back in steps:
        if give_back and instances[who].held and who == 2:  # now and then an idle instance gives its counts back
            instances[who].give_back(shared)
        else:
            instances[who].request(shared)
        assert sum(i.admitted for i in instances) <= limit
        # the shared total covers every number used or held: nothing can be handed out twice
        assert shared[0] >= sum(i.admitted for i in instances) + sum(len(i.held) for i in instances)


@given(limit=st.integers(1, 2000), max_lease=st.integers(1, 512), fraction=st.integers(1, 16),
       order=st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_instances_that_keep_seeing_requests_admit_exactly_the_limit(
    limit: int, max_lease: int, fraction: int, order: random.Random
) -> None:
    policy = LeasePolicy(max_lease, fraction)
    shared = [0]
    instances = [SimInstance(policy, limit) for _ in range(3)]
    for _ in range(3 * limit + 3 * max_lease):
        order.choice(instances).request(shared)
    for inst in instances:  # every instance keeps getting requests until its held counts are used
        while inst.held:
            inst.request(shared)
    assert sum(i.admitted for i in instances) == limit


def test_a_given_back_lease_is_admitted_elsewhere() -> None:
    limit = DEFAULTS.limit_key_per_minute
    shared = [0]
    a, b = SimInstance(POLICY, limit), SimInstance(POLICY, limit)
    for _ in range(POLICY.fraction * 4):
        a.request(shared)
    assert a.held  # a busy instance holds counts ahead
    a.give_back(shared)
    for _ in range(limit * 2):
        b.request(shared)
    assert a.admitted + b.admitted == limit
