"""The rules of shedding (shared/overload/domain.py), exhaustively over their inputs' cases."""

from __future__ import annotations

import itertools

import pytest

from shared.overload import domain
from shared.overload.domain import PRIORITIES, LimitConfig, LimitState, Window
from shared.settings import ShedSettings

S = ShedSettings()
CONFIG = LimitConfig(initial=S.shed_initial_limit, minimum=S.shed_min_limit, maximum=S.shed_max_limit,
                     tolerance=S.shed_tolerance, smoothing=S.shed_smoothing, long_window=S.shed_long_windows,
                     target=S.shed_target_ms / 1000, backoff=S.shed_backoff)


@pytest.mark.parametrize(("internal", "declared", "method"), list(itertools.product(
    (True, False), (None, "completion"), ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"))))
def test_priority_of(internal: bool, declared: domain.Priority | None, method: str) -> None:
    got = domain.priority_of(internal=internal, declared=declared, method=method)
    if internal:
        assert got == "internal"
    elif declared is not None:
        assert got == declared
    else:
        assert got == ("read" if method in ("GET", "HEAD", "OPTIONS") else "write")


@pytest.mark.parametrize(("reserve", "step"), list(itertools.product((0.0, 0.1, 0.2, 0.5, 0.9), (0.0, 0.05, 0.1, 0.3))))
def test_ceilings_keep_the_reserve_and_order(reserve: float, step: float) -> None:
    shares = domain.ceilings(reserve, step)
    assert list(shares) == list(PRIORITIES)
    assert shares["internal"] == 1.0
    for higher, lower in itertools.pairwise(PRIORITIES):
        assert shares[higher] >= shares[lower] >= 0.1
    for p in PRIORITIES[1:]:
        assert shares[p] <= 1.0 - reserve + 1e-9  # the top share's reserve is never taken


def test_the_reserve_is_kept_at_the_default_limit() -> None:
    """At the default limit, lower priorities together stop at 1 - reserve of it: internal traffic still starts."""
    shares = domain.ceilings(S.shed_reserve_share, S.shed_priority_step)
    limit = S.shed_initial_limit
    for p in PRIORITIES[1:]:
        full = next(n for n in range(1000) if not domain.admits(shares[p], n, limit))
        assert full <= round(limit * (1 - S.shed_reserve_share))
        assert domain.admits(shares["internal"], full, limit)


@pytest.mark.parametrize(("share", "in_flight", "limit"), list(itertools.product(
    (0.1, 0.6, 0.8, 1.0), range(0, 12), (0.5, 1.0, 4.0, 10.0))))
def test_admits(share: float, in_flight: int, limit: float) -> None:
    assert domain.admits(share, in_flight, limit) == (in_flight == 0 or in_flight + 1 <= round(share * limit, 6))


def test_nothing_running_is_always_admitted() -> None:
    assert all(domain.admits(0.1, 0, limit) for limit in (0.01, 1, 100))


def window(latency: float, peak: int, lag: float = 0.0) -> Window:
    return Window(latency=latency, peak_in_flight=peak, lag=lag)


@pytest.mark.parametrize("policy", ["off", "fixed"])
def test_off_and_fixed_never_move(policy: domain.Policy) -> None:
    state = LimitState(10.0, 0.01)
    for w in (window(0.5, 10, 1.0), window(0.001, 10), window(0.0, 0), window(0.01, 10, 0.0)):
        assert domain.next_limit(policy, state, w, CONFIG) == state


def test_gradient_grows_while_latency_holds_and_the_limit_is_used() -> None:
    state = LimitState(CONFIG.initial)
    for _ in range(50):
        state = domain.next_limit("gradient", state, window(0.01, int(state.limit)), CONFIG)
    assert state.limit > CONFIG.initial
    assert state.limit <= CONFIG.maximum


def test_gradient_does_not_grow_an_unused_limit() -> None:
    state = LimitState(CONFIG.initial)
    for _ in range(50):
        state = domain.next_limit("gradient", state, window(0.01, int(CONFIG.initial / 2) - 1), CONFIG)
    assert state.limit == CONFIG.initial


def test_gradient_shrinks_when_latency_passes_the_tolerance() -> None:
    state = LimitState(100.0)
    for _ in range(20):  # a long-term latency of 10 ms
        state = domain.next_limit("gradient", state, window(0.01, 100), CONFIG)
    before = state.limit
    slow = 0.01 * CONFIG.tolerance * 4
    for _ in range(5):
        state = domain.next_limit("gradient", state, window(slow, int(state.limit)), CONFIG)
    assert state.limit < before
    for _ in range(500):
        state = domain.next_limit("gradient", state, window(10.0, int(state.limit)), CONFIG)
    assert state.limit >= CONFIG.minimum


def test_gradient_ignores_a_window_that_finished_nothing() -> None:
    state = LimitState(20.0, 0.01)
    assert domain.next_limit("gradient", state, window(0.0, 20), CONFIG) == state


def test_gradient_forgets_a_slow_past() -> None:
    state = LimitState(20.0, 1.0)
    after = domain.next_limit("gradient", state, window(0.01, 0), CONFIG)
    assert after.long_latency < 1.0 * 0.99


@pytest.mark.parametrize("lag_ratio", (0.5, 0.99, 1.01, 3.0))
def test_codel_backs_off_over_the_target_and_grows_by_one_when_full(lag_ratio: float) -> None:
    state = LimitState(20.0)
    lag = CONFIG.target * lag_ratio
    full = domain.next_limit("codel", state, window(0.01, 20, lag), CONFIG)
    idle = domain.next_limit("codel", state, window(0.01, 5, lag), CONFIG)
    if lag > CONFIG.target:
        assert full.limit == idle.limit == 20.0 * CONFIG.backoff
    else:
        assert full.limit == 21.0
        assert idle.limit == 20.0


def test_codel_stays_within_bounds() -> None:
    low = LimitState(CONFIG.minimum)
    assert domain.next_limit("codel", low, window(0.01, 1, 1.0), CONFIG).limit == CONFIG.minimum
    high = LimitState(CONFIG.maximum)
    assert domain.next_limit("codel", high, window(0.01, int(CONFIG.maximum), 0.0), CONFIG).limit == CONFIG.maximum


@pytest.mark.parametrize(("standing", "expected"), ((0.0, "interval"), (0.05, "interval"), (0.1, "interval"),
                                                    (0.1001, "target"), (5.0, "target")))
def test_queue_timeout(standing: float, expected: str) -> None:
    target, interval = S.shed_target_ms / 1000, S.shed_window_ms / 1000
    got = domain.queue_timeout(standing, target, interval)
    assert got == (target if expected == "target" else interval)


@pytest.mark.parametrize(("priority", "waited"), list(itertools.product(PRIORITIES, (0.0, 0.004, 0.006, 1.0))))
def test_sheds_queued(priority: domain.Priority, waited: float) -> None:
    timeout = 0.005
    assert domain.sheds_queued(priority, waited, timeout) == (priority != "internal" and waited > timeout)


@pytest.mark.parametrize(("window_seconds", "expected"), ((0.001, 1), (0.1, 1), (1.0, 1), (1.5, 2), (3.0, 3)))
def test_retry_after(window_seconds: float, expected: int) -> None:
    assert domain.retry_after_seconds(window_seconds) == expected


@pytest.mark.parametrize(("priority", "dropping"), list(itertools.product(PRIORITIES, (False, True))))
def test_refuses_at_once(priority: domain.Priority, dropping: bool) -> None:
    assert domain.refuses_at_once(priority, dropping) == (dropping and priority != "internal")
