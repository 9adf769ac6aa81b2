"""Budget leases: counts taken from the shared counters ahead of requests, so most decisions need no round trip.

A lease is a run of numbers of one counter that the store granted this instance (`domain.lease_rules` say how many,
and why instances together never admit more than the limit). A request takes the lowest number held, or waits for a
grant; a counter unused here for `idle_seconds` gives its numbers back, and `on_give_back` tells the other instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from services.auth.counters import CounterStore
from services.auth.domain.lease_rules import (
    LeasePolicy,
    decayed,
    give_back_due,
    granted_numbers,
    lease_size,
    prefetch_size,
    usable,
)
from services.auth.domain.rules import RuleId
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.leases")

Tag = TypeVar("Tag")


@dataclass(eq=False)
class _Lease(Generic[Tag]):
    tag: Tag
    rule: RuleId
    limit: int
    window_end: float
    runs: deque[list[int]] = field(default_factory=deque)  # [next, last] inclusive, ascending, all <= limit
    held: int = 0
    seen: int = 0  # the highest total of the counter this instance has been told
    previous: int = 0  # the size of the last grant
    demand: float = 0.0  # counts used here, decayed over the lease horizon
    demand_at: float = 0.0
    last_used: float = 0.0
    grant: asyncio.Future[None] | None = None  # a grant in flight (at most one per counter)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        runs = self.runs
        while runs and len(out) < k:
            run = runs[0]
            n = min(k - len(out), run[1] - run[0] + 1)
            out.extend(range(run[0], run[0] + n))
            run[0] += n
            if run[0] > run[1]:
                runs.popleft()
        self.held -= len(out)
        return out

    def keep(self, numbers: range) -> None:
        if numbers:
            self.runs.append([numbers.start, numbers.stop - 1])
            self.held += len(numbers)

    def drop(self) -> int:
        held, self.held = self.held, 0
        self.runs.clear()
        return held


class LeasedCounters(Generic[Tag]):
    """Counts for requests, from leases of the shared counters; `store` is the shared store (with its fallback)."""

    def __init__(
        self,
        store: CounterStore,
        policy: LeasePolicy,
        *,
        idle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        on_give_back: Callable[[Tag], None] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.idle_seconds = idle_seconds
        self.horizon = idle_seconds / 2  # a lease should be used up well before it counts as idle
        self.clock = clock
        self.metrics = metrics or Metrics("auth")
        self.on_give_back = on_give_back
        self._leases: dict[str, _Lease[Tag]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.grants = 0  # round trips to the store, for tests and the benchmark

    def put_back(self, subject: str, numbers: list[int]) -> None:
        """Numbers taken for requests that were not decided after all: held again, for the next requests."""
        lease = self._leases.get(subject)
        if lease is not None:
            for n in numbers:
                lease.keep(range(n, n + 1))

    def late_grant(self, subject: str, size: int, total: int) -> None:
        """A grant whose PubAck came after its budget while its requests were answered 503 (services/auth/counters.py
        ResilientCounters): the store counted it and nobody took its numbers. Those that can still admit are held for
        the next requests, as if granted ahead of need; without a lease of the counter (idle and forgotten, or its
        window over) they stay counted."""
        lease = self._leases.get(subject)
        if lease is None or lease.window_end <= time.time():
            self._count_late("not_held", size)
            return
        numbers = usable(granted_numbers(total, size), lease.limit)
        lease.seen = max(lease.seen, total)
        lease.keep(numbers)
        if len(lease.runs) > 1:
            lease.runs = deque(sorted(lease.runs))  # the lowest numbers are taken first
        self._count_late("held", len(numbers))
        self._count_late("over_limit", size - len(numbers))

    def _count_late(self, outcome: str, n: int) -> None:
        if n:
            self.metrics.inc("counter_late_counts_total", n, "counts of increments applied after their budget",
                             outcome=outcome)

    def held(self, subject: str) -> int:
        lease = self._leases.get(subject)
        return 0 if lease is None else lease.held

    def take_now(self, subject: str, k: int, tag: Tag, rule: RuleId, limit: int, window_end: float) -> list[int]:
        """Up to `k` numbers from what this instance holds, without waiting (fewer when it holds fewer)."""
        lease = self._leases.get(subject)
        if lease is None:
            lease = self._leases[subject] = _Lease(tag, rule, limit, window_end)
        now = self.clock()
        lease.demand = decayed(lease.demand, lease.demand_at, now, self.horizon) + k
        lease.demand_at = lease.last_used = now
        out = lease.take(k) if lease.held else []
        self._prefetch(subject, lease, math.ceil(lease.demand))  # the demand as of now, just worked out
        return out

    async def take(self, subject: str, k: int, tag: Tag, rule: RuleId, limit: int,
                   window_end: float) -> list[int]:
        """`k` numbers for `k` requests, in order: held ones first, then from a grant of the shared counter."""
        out = self.take_now(subject, k, tag, rule, limit, window_end)
        lease = self._leases[subject]
        while len(out) < k:
            if lease.grant is not None:  # a grant ahead of need is on its way: it may cover these requests
                await asyncio.shield(lease.grant)
                out += lease.take(k - len(out))
                continue
            need = k - len(out)
            size = lease_size(self.policy, rule, need, limit, lease.seen, lease.previous, self._demand(lease))
            numbers = await self._grant(subject, lease, size, self._claim(lease))
            out += numbers[:need]  # these requests get the lowest numbers of the grant
            lease.keep(usable(numbers[need:], limit))
        self._prefetch(subject, lease)
        return out

    @staticmethod
    def _claim(lease: _Lease[Tag]) -> asyncio.Future[None]:
        """Mark a grant in flight at once (not when its task first runs), so that no second one starts meanwhile."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lease.grant = done
        return done

    async def _grant(self, subject: str, lease: _Lease[Tag], size: int, done: asyncio.Future[None]) -> range:
        try:
            self.grants += 1
            total = await self.store.incr(subject, size)
            lease.seen = max(lease.seen, total)
            lease.previous = size
            return granted_numbers(total, size)
        finally:
            lease.grant = None
            done.set_result(None)

    def _demand(self, lease: _Lease[Tag]) -> int:
        return math.ceil(decayed(lease.demand, lease.demand_at, self.clock(), self.horizon))

    def _prefetch(self, subject: str, lease: _Lease[Tag], demand: int | None = None) -> None:
        if lease.grant is not None:
            return
        size = prefetch_size(self.policy, lease.rule, lease.held, lease.limit, lease.seen, lease.previous,
                                    self._demand(lease) if demand is None else demand)
        if size:
            self._spawn(self._ahead(subject, lease, size, self._claim(lease)))

    async def _ahead(self, subject: str, lease: _Lease[Tag], size: int, done: asyncio.Future[None]) -> None:
        try:
            numbers = await self._grant(subject, lease, size, done)
        except Exception as exc:  # the store's own fallback answers requests; a missed prefetch only costs a wait
            log.debug("lease ahead of need for %s failed: %s", subject, exc)
            return
        lease.keep(usable(numbers, lease.limit))
        self.metrics.inc("counter_leases_ahead_total", help="grants of counts taken ahead of need")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def give_back_idle(self, *, everything: bool = False) -> int:
        """Give back the numbers of counters unused for `idle_seconds` (all of them with `everything`), and forget
        counters whose window has ended. Returns how many numbers went back."""
        now = self.clock()
        wall = time.time()
        back: list[tuple[str, _Lease[Tag], int]] = []
        for subject, lease in list(self._leases.items()):
            if lease.window_end <= wall:
                lease.drop()  # an ended window's counts are worth nothing to anyone
                if lease.grant is None:
                    del self._leases[subject]
                continue
            if everything or give_back_due(lease.held, lease.last_used, now, self.idle_seconds):
                held = lease.drop()
                if held:
                    back.append((subject, lease, held))
            elif not lease.held and lease.grant is None and now - lease.last_used >= self.idle_seconds:
                del self._leases[subject]  # nothing held and unused: a later request starts a new lease
        if not back:
            return 0
        results = await asyncio.gather(*(self.store.give_back(s, n) for s, _, n in back), return_exceptions=True)
        returned = 0
        for (subject, lease, held), result in zip(back, results, strict=True):
            if isinstance(result, BaseException):  # kept by the store: the budget is over-counted, never under
                log.warning("could not give back %d counts of %s: %s", held, subject, result)
                continue
            returned += held
            lease.seen -= held
            if self.on_give_back is not None:
                self.on_give_back(lease.tag)
        self.metrics.inc("counter_lease_returned_total", returned, "leased counts given back unused")
        return returned

    async def run(self, stop: asyncio.Event) -> None:
        """Give back idle leases until `stop` (`close` then gives back the rest, once no request can take more)."""
        interval = max(0.05, self.idle_seconds / 2)
        while not stop.is_set():
            try:
                await self.give_back_idle()
            except Exception:
                log.exception("giving back idle leases failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)

    async def close(self) -> None:
        """Everything held goes back, so that a stopped instance keeps no budget from the others."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.give_back_idle(everything=True)
