"""The counter store's failover phase (services/auth/counters.py ResilientCounters): while a replicated store elects
a leader, nothing is counted locally; past `failover_s` local windows take over, as in any outage."""

from __future__ import annotations

from typing import Any

import pytest

from services.auth.counters import CounterStoreFailingOver, CounterStoreUnavailable, LocalCounters, ResilientCounters

SUBJECT = "limits.key.k1.1764547200"


class DownStore:
    """A shared store that does not answer (pure wiring: the real store is tested in tests/integration)."""

    subjects = ("limits.>",)

    async def incr(self, subject: str, by: int = 1) -> int:
        raise CounterStoreUnavailable("no responders")

    async def read(self, subject: str) -> int:
        raise CounterStoreUnavailable("no responders")

    async def ping(self) -> None:
        raise CounterStoreUnavailable("no responders")

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counters(failover_s: float, clock: Clock) -> ResilientCounters:
    store: Any = DownStore()
    return ResilientCounters(store, LocalCounters(), failover_s=failover_s, probe_interval_s=3600, clock=clock)


async def test_during_the_failover_nothing_is_counted_locally_then_local_windows_take_over() -> None:
    clock = Clock()
    c = counters(5.0, clock)
    try:
        with pytest.raises(CounterStoreFailingOver):
            await c.incr(SUBJECT)
        assert c.mode == "local" and c.failing_over
        clock.now += 5.0 - 0.001
        with pytest.raises(CounterStoreFailingOver):
            await c.incr(SUBJECT)
        assert c.local.peek(SUBJECT) == 0  # nothing was counted while failing over
        clock.now += 0.001
        assert not c.failing_over
        assert await c.incr(SUBJECT) == 1  # past the failover: an outage, local windows as SPEC 3 says
    finally:
        await c.close()


async def test_without_a_failover_phase_local_windows_answer_at_once() -> None:
    c = counters(0.0, Clock())
    try:
        assert await c.incr(SUBJECT, 2) == 2 and c.mode == "local" and not c.failing_over
    finally:
        await c.close()


async def test_reads_answer_from_the_local_window_while_failing_over() -> None:
    c = counters(5.0, Clock())
    try:
        assert await c.read(SUBJECT) == 0 and c.failing_over
    finally:
        await c.close()
