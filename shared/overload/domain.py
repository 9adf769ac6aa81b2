"""The rules of shedding (SPEC 15), pure: who is admitted at a given load, and how the concurrency limit moves.

A service admits a request while the requests in flight are under its priority's ceiling, a share of the current
concurrency limit. The highest priority's ceiling is the whole limit and every other is at most `1 - reserve` of it,
so the highest keeps `reserve` of the capacity that lower ones cannot take; each lower priority's ceiling is a
`step` below the one above, so reads go first, then other writes, then upload completions (Stripe's load shedder).

The limit itself stays where it is set (`fixed`: a queueing-delay target on the queue in front of a fixed
concurrency, as servers with a worker pool apply CoDel) or moves by one of two policies, all measured in
bench/overload.py:
- `gradient`, an adaptive concurrency limit (Netflix's Gradient2): the limit shrinks by the ratio of the long-term
  to the recent latency of admitted requests when that passes a tolerance, and grows by a queue allowance while the
  latency holds and the limit is in use;
- `codel`, a queueing-delay target (CoDel's rule on the event loop's lag): while the smallest lag seen over an
  interval stays above the target the limit shrinks multiplicatively, otherwise it grows by one while in use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

# in the order they are shed last to first: internal and management, upload completion, other writes, reads
Priority = Literal["internal", "completion", "write", "read"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)
Policy = Literal["gradient", "codel", "fixed", "off"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def priority_of(*, internal: bool, declared: Priority | None, method: str) -> Priority:
    """A request's priority: internal traffic (Weir's token, internal and management routes) first, then what the
    route declares (upload completion), then writes before reads by the method."""
    if internal:
        return "internal"
    if declared is not None:
        return declared
    return "read" if method in READ_METHODS else "write"


def ceilings(reserve: float, step: float) -> dict[Priority, float]:
    """Each priority's share of the limit: 1 for the highest, `1 - reserve` for the next, each further one `step`
    (a fraction of the limit) lower, never below a tenth."""
    shares: dict[Priority, float] = {}
    for rank, priority in enumerate(PRIORITIES):
        # rounded: 1 - 0.2 - 2 * 0.1 is 0.6000000000000001 in floating point, which admits one more at 5
        shares[priority] = 1.0 if rank == 0 else max(0.1, round(1.0 - reserve - step * (rank - 1), 9))
    return shares


def admits(share: float, in_flight: int, limit: float) -> bool:
    """Whether one more request of a priority with `share` of `limit` may start with `in_flight` running: always
    when nothing runs (a limit never starves a service), else while it still fits under the priority's ceiling (a
    ceiling of 38.4 admits 38: the 39th would take part of the share kept for the priorities above)."""
    return in_flight == 0 or in_flight + 1 <= share * limit + 1e-9


@dataclass(frozen=True)
class LimitConfig:
    initial: float
    minimum: float
    maximum: float
    tolerance: float  # gradient: how much slower than the long-term latency the recent one may be
    smoothing: float  # gradient: the weight of a new estimate
    long_window: int  # gradient: the long-term latency's memory, in windows
    target: float  # codel: the queueing delay (event-loop lag) allowed to stand, seconds
    backoff: float  # codel: the factor the limit shrinks by per window over the target


@dataclass(frozen=True)
class LimitState:
    limit: float
    long_latency: float = 0.0  # gradient: the long-term (exponential) mean of windows' latency; 0 until known


@dataclass(frozen=True)
class Window:
    """What one window saw: the mean latency of the requests admitted and finished in it, the most requests in
    flight at once, and the smallest event-loop lag measured in it (the queueing delay)."""

    latency: float
    peak_in_flight: int
    lag: float


def next_limit(policy: Policy, state: LimitState, window: Window, config: LimitConfig) -> LimitState:
    """The limit after a window (unchanged by `fixed` and `off`, and by any policy for a window that finished
    nothing)."""
    if policy == "gradient":
        return _gradient(state, window, config)
    if policy == "codel":
        return _codel(state, window, config)
    return state


def _clamped(limit: float, config: LimitConfig) -> float:
    return min(config.maximum, max(config.minimum, limit))


def _in_use(state: LimitState, window: Window) -> bool:
    """Only a limit the load reached may grow: an idle service would otherwise raise it without bound."""
    return window.peak_in_flight >= state.limit / 2


def _gradient(state: LimitState, window: Window, config: LimitConfig) -> LimitState:
    if window.latency <= 0:
        return state
    long = window.latency if state.long_latency <= 0 else (
        state.long_latency + (window.latency - state.long_latency) / config.long_window)
    if long > 2 * window.latency:  # the load went away: forget the slow past sooner (Gradient2's drift rule)
        long *= 0.95
    if not _in_use(state, window):
        return replace(state, long_latency=long)
    gradient = max(0.5, min(1.0, config.tolerance * long / window.latency))
    estimate = state.limit * gradient + math.sqrt(state.limit)  # sqrt: the queue allowed, Gradient2's default
    limit = state.limit * (1 - config.smoothing) + estimate * config.smoothing
    return LimitState(_clamped(limit, config), long)


def _codel(state: LimitState, window: Window, config: LimitConfig) -> LimitState:
    if window.lag > config.target:
        return replace(state, limit=_clamped(state.limit * config.backoff, config))
    if _in_use(state, window) and window.peak_in_flight >= state.limit - 1:
        return replace(state, limit=_clamped(state.limit + 1, config))
    return state


def retry_after_seconds(window_seconds: float) -> int:
    """Retry-After for a shed answer: whole seconds (RFC 9110), at least 1, about the time the limit takes to move."""
    return max(1, math.ceil(window_seconds))


def queue_timeout(standing: float, target: float, interval: float) -> float:
    """How long a queued request may have waited before it is answered `overloaded`: `interval` while the queue has
    been empty within the last interval (a burst passing), `target` once it has stood longer (a standing queue:
    CoDel's rule as servers use it, "Fail at Scale", ACM Queue 2015). `standing`: time since it was last empty."""
    return target if standing > interval else interval


def sheds_queued(priority: Priority, waited: float, timeout: float) -> bool:
    """Whether a request that waited `waited` in a queue is answered `overloaded` instead of being served: never
    the highest priority (its share is kept), the others once past the timeout."""
    return priority != "internal" and waited > timeout


def refuses_at_once(priority: Priority, dropping: bool) -> bool:
    """Whether a request over its ceiling is refused without waiting: while the queue is dropping (a wait ran past
    its timeout and the load has not receded since), every priority but the highest."""
    return dropping and priority != "internal"
