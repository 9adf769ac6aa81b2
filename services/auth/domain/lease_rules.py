"""Budget leases: counts an instance takes from a shared counter ahead of its requests, and admits on locally.

A grant of s counts (`+s`) that brings the store's total to T owns the numbers T-s+1 ... T. A request is admitted on
a number no greater than the limit, so instances together never admit more than it; unused numbers go back (`-k`)
when an instance stops seeing a counter, so the shared total always covers every number used or held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.auth.domain.rules import RuleId


@dataclass(frozen=True)
class LeasePolicy:
    """How far ahead of its requests an instance counts. `max_lease` 1 turns leases off."""

    max_lease: int
    fraction: int  # a lease takes at most this fraction of what is left of the budget

    def __post_init__(self) -> None:
        if self.max_lease < 1 or self.fraction < 1:
            raise ValueError("max_lease and fraction must be at least 1")


def leases_for(rule: RuleId) -> bool:
    """Rules whose counts may be leased. The auth_failure block reads its counter's total, so it is never leased."""
    return rule is not RuleId.AUTH_FAILURE


def lease_size(
    policy: LeasePolicy, rule: RuleId, wanted: int, limit: int, seen: int, previous: int, demand: int
) -> int:
    """How many counts to take for `wanted` requests waiting now (0 when prefetching): always those, and beyond them
    the counter's recent (decayed) `demand` here, growing at most by doubling from the `previous` grant, capped by
    `max_lease` and 1/`fraction` of what was last seen left: a rarely used counter takes one count at a time, and
    near the limit each count is asked for when it is needed."""
    if min(wanted, limit, previous, demand) < 0:
        raise ValueError("counts are never negative")
    headroom = limit - seen
    if not leases_for(rule) or headroom <= wanted:
        return wanted
    ramp = 2 * previous if previous else 1
    return max(wanted, min(ramp, demand, policy.max_lease, headroom // policy.fraction))


def prefetch_size(
    policy: LeasePolicy, rule: RuleId, held: int, limit: int, seen: int, previous: int, demand: int
) -> int:
    """How many counts to take ahead of need, or 0: once what is held covers less than half of the demand expected
    over the horizon (at most `max_lease`), so that a busy counter never waits for the store."""
    target = min(demand, policy.max_lease)
    if target < 2 or held * 2 > target:
        return 0
    return lease_size(policy, rule, 0, limit, seen, previous, demand)


def decayed(count: float, since: float, now: float, horizon: float) -> float:
    """A count of uses, decayed exponentially over `horizon` seconds: about the uses of the last horizon."""
    if now <= since:
        return count
    return count * math.exp((since - now) / horizon)


def granted_numbers(total: int, size: int) -> range:
    """The numbers a grant of `size` counts owns, from the counter's total after it."""
    if size < 0:
        raise ValueError("a grant is never negative")
    return range(total - size + 1, total + 1)


def usable(numbers: range, limit: int) -> range:
    """The numbers of a grant that can admit a request (those over the limit only refuse)."""
    return range(numbers.start, min(numbers.stop, limit + 1)) if numbers.start <= limit else range(0)


def give_back_due(held: int, last_used: float, now: float, idle_seconds: float) -> bool:
    """Unused counts go back to the shared counter once nothing here has used them for `idle_seconds`."""
    return held > 0 and now - last_used >= idle_seconds
