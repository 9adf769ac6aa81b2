"""What one instance remembers between requests: budgets known to be spent, and secret keys it recently accepted.

A budget is remembered as soon as it is spent (count == limit), which is exact because counts in a fixed window never
go down: every later request on it would be past the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Final

from services.auth.domain.limits import CountPlan, Decision, limit_refusal
from services.auth.domain.rules import CounterKey, RuleId


class RefusalMemory:
    """Budgets known to be spent until their window ends, so that a flood is refused without asking the store."""

    def __init__(self) -> None:
        self._until: dict[CounterKey, int] = {}
        self._next_purge = math.inf

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, key: CounterKey, until: int, now: float) -> None:
        self._maybe_purge(now)
        if until > now:
            self._until[key] = max(until, self._until.get(key, until))
            self._next_purge = min(self._next_purge, until)

    def remember_decision(self, decision: Decision, now: float) -> None:
        for key, until in decision.remember:
            self.remember(key, until, now)

    def forget(self, key: CounterKey) -> None:
        """Counts of `key` were given back to the store: it may have room again."""
        self._until.pop(key, None)

    def refused_until(self, key: CounterKey, now: float) -> int | None:
        """The end of the window in which `key` is spent, or None."""
        until = self._until.get(key)
        if until is None:
            return None
        if now >= until:
            del self._until[key]
            return None
        return until

    def purge(self, now: float) -> int:
        expired = [key for key, until in self._until.items() if until <= now]
        for key in expired:
            del self._until[key]
        self._next_purge = min(self._until.values(), default=math.inf)
        return len(expired)

    def _maybe_purge(self, now: float) -> None:
        if now >= self._next_purge:
            self.purge(now)


PURGES_PER_HORIZON: Final = 10
"""RecentAcceptedKeys purges at most this many times per horizon: an aged-out entry lingers at most a tenth of it."""


class RecentAcceptedKeys:
    """When this instance last accepted each secret key from each address."""

    def __init__(self, horizon_seconds: float) -> None:
        self.horizon_seconds = horizon_seconds
        self._last: dict[str, dict[str, float]] = {}  # address -> key id -> when last accepted
        self._next_purge = math.inf

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._last.values())

    def record(self, address: str, key_id: str, now: float) -> None:
        self.record_many(((address, key_id),), now)

    def record_many(self, accepted: Iterable[tuple[str, str]], now: float) -> None:
        """Each (address, key id) accepted at `now`."""
        if now >= self._next_purge:
            self.purge(now)
        last = self._last
        for address, key_id in accepted:
            keys = last.get(address)
            if keys is None:
                keys = last[address] = {}
            was = keys.get(key_id)
            if was is None or was < now:
                keys[key_id] = now
        self._next_purge = min(self._next_purge, now + self.horizon_seconds)

    def accepted_within(self, address: str, key_id: str, now: float) -> bool:
        """Accepted from `address` less than `horizon_seconds` before `now`."""
        last = self._last.get(address, {}).get(key_id)
        return last is not None and 0 <= now - last < self.horizon_seconds

    def accepted_from(self, address: str, now: float) -> dict[str, float]:
        """Every key accepted from `address` within the horizon, with when it last was."""
        return {k: last for k, last in self._last.get(address, {}).items() if 0 <= now - last < self.horizon_seconds}

    def purge(self, now: float) -> int:
        stale = 0
        for address in list(self._last):
            keys = self._last[address]
            for key_id in [k for k, last in keys.items() if now - last >= self.horizon_seconds]:
                del keys[key_id]
                stale += 1
            if not keys:
                del self._last[address]
        earliest = min((last + self.horizon_seconds for keys in self._last.values() for last in keys.values()),
                       default=math.inf)
        # a purge reads every entry: with addresses each seen once, entries age out one after another, so purging at
        # each one's end would read them all on nearly every request; entries past the horizon answer nothing
        # (accepted_within and accepted_from check the time), so purging a little late only keeps them longer
        self._next_purge = max(earliest, now + self.horizon_seconds / PURGES_PER_HORIZON)
        return stale


def _holds_nothing(key: CounterKey) -> bool:
    return False


def refusal_from_memory(
    plan: CountPlan, memory: RefusalMemory, now: float, holds: Callable[[CounterKey], bool] = _holds_nothing
) -> Decision | None:
    """A 429 answered without the store, when a budget this request needs is remembered as spent.

    A budget spent in the store while this instance still holds leased counts of it (`holds`) is not refused:
    those counts are this instance's to admit.
    """
    refusing: list[tuple[CounterKey, int]] = []
    for key in plan.increments:
        until = memory.refused_until(key, now)
        if until is not None and key.rule.id is not RuleId.AUTH_FAILURE and not holds(key):
            refusing.append((key, until))
    if plan.block_check is not None:
        until = memory.refused_until(plan.block_check, now)
        if until is not None:
            refusing.append((plan.block_check, until))
    return limit_refusal(refusing, now) if refusing else None
