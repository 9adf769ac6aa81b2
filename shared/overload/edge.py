"""The api's shedder: the outermost ASGI app, in front of everything else (the guard and its `auth.check`, the
metrics middleware, FastAPI), so that a request it refuses costs the parse and one short answer.

A request goes through while those in flight are under its priority's ceiling (shared/overload/domain.py). Else it
waits for a slot, which a finishing request hands to the highest priority waiting, but only while the wait is a
burst passing: one that waited past the queue's timeout (`domain.queue_timeout`: a window while the queue empties,
the target once it has stood longer, CoDel's rule as servers apply it) is answered 503 `overloaded` with
Retry-After, and from then on every request over its ceiling is answered so at once, until a window goes by
without a refusal. Below the lowest ceiling nothing is classified: the common path is a
comparison and two counters. Every `window_seconds` the finished requests' mean latency, the peak in flight and
(for `codel`) the event loop's smallest lag move the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from shared.metrics import LAG_BUCKETS, Metrics
from shared.overload import domain
from shared.overload.domain import LimitConfig, LimitState, Policy, Priority, Window
from shared.problems import problem_body
from shared.settings import ShedSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# a request's declared priority by method and path (None: the method decides), or PASS for what is never shed
Classify = Callable[[str, str], "Priority | Pass | None"]
# whether a path's answers are readable from any page (the SDK's and the player's routes): a refusal there carries
# the CORS headers, or a page would see a network error instead of the 503 and its Retry-After
AnyOrigin = Callable[[str], bool]
INTERNAL_HEADER = b"x-weir-internal-token"
LAG_PROBES_PER_WINDOW = 10
OVERLOADED_DETAIL = "more requests than this instance can answer in time; retry after the Retry-After seconds"


class Pass:
    """What `Classify` answers for a path that is never shed nor counted (probes, scrapes: they cost little and
    must answer on an overloaded instance, or its supervisor would restart it for being busy)."""


PASS = Pass()


@dataclass(frozen=True)
class ShedConfig:
    policy: Policy
    limit: LimitConfig
    reserve: float
    step: float
    window_seconds: float
    burst_seconds: float  # ShedSettings.shed_burst_ms


def shed_config(settings: ShedSettings) -> ShedConfig:
    """The shedder's numbers from the service's settings."""
    limit = LimitConfig(initial=settings.shed_initial_limit, minimum=settings.shed_min_limit,
                        maximum=settings.shed_max_limit, tolerance=settings.shed_tolerance,
                        smoothing=settings.shed_smoothing, long_window=settings.shed_long_windows,
                        target=settings.shed_target_ms / 1000, backoff=settings.shed_backoff)
    return ShedConfig(policy=settings.shed_policy, limit=limit, reserve=settings.shed_reserve_share,
                      step=settings.shed_priority_step, window_seconds=settings.shed_window_ms / 1000,
                      burst_seconds=settings.shed_burst_ms / 1000)


class Shedder:
    def __init__(self, app: ASGIApp, *, config: ShedConfig, classify: Classify, internal_token: str,
                 metrics: Metrics, passing: frozenset[str] = frozenset(), any_origin: AnyOrigin | None = None,
                 cors_expose: bytes = b"Retry-After") -> None:
        self.app = app
        self.any_origin = any_origin or (lambda path: path.startswith("/sdk/"))
        self.passing = passing  # paths never shed nor counted, known without classifying (/healthz, /metrics)
        self.config = config
        self.classify = classify
        self.token = internal_token.encode()
        self.metrics = metrics
        self.shares = domain.ceilings(config.reserve, config.step)
        self.floor = min(self.shares.values())  # below floor * limit every priority is admitted
        self.state = LimitState(config.limit.initial)
        self.in_flight = 0
        self.shed: dict[Priority, int] = dict.fromkeys(domain.PRIORITIES, 0)
        self._open = config.policy != "off"
        self._admit_below = self.floor * self.state.limit if self._open else float("inf")
        # the window being measured
        self._window_end = 0.0
        self._finished = 0
        self._latency_sum = 0.0
        self._peak = 0
        self._lag = float("inf")
        self._probe: asyncio.TimerHandle | None = None
        # requests waiting for a slot, by priority, each (when it came, its future: True to go, False to be refused)
        self.waiting: dict[Priority, deque[tuple[float, asyncio.Future[bool]]]] = {
            p: deque() for p in domain.PRIORITIES}
        self.n_waiting = 0
        self.empty_at = 0.0  # when nothing last waited
        self.dropping = False  # a queue stood past its timeout: refuse at once until a window refuses nothing
        self._refused = 0  # refusals in the current window
        self._expiry: asyncio.TimerHandle | None = None
        retry_after = str(domain.retry_after_seconds(config.window_seconds)).encode()
        body = json.dumps(problem_body(503, "overloaded", OVERLOADED_DETAIL)).encode()
        self._answer = (body, [(b"content-type", b"application/problem+json"),
                               (b"content-length", str(len(body)).encode()), (b"retry-after", retry_after)])
        # a page (the SDK, a player) reads the refusal and its Retry-After only with CORS headers; the body is nobody's
        # secret
        self._open_headers = [(b"access-control-allow-origin", b"*"), (b"access-control-expose-headers", cors_expose)]
        for priority in domain.PRIORITIES:
            metrics.inc("shed_total", 0, priority=priority)
        metrics.set("shed_limit", self.state.limit)
        metrics.follow("shed_in_flight", lambda: self.in_flight)
        metrics.follow("shed_waiting", lambda: self.n_waiting)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.passing:
            await self.app(scope, receive, send)
            return
        in_flight = self.in_flight
        if in_flight >= self._admit_below:
            priority = self._priority(scope)
            if priority is None:
                await self.app(scope, receive, send)
                return
            if not domain.admits(self.shares[priority], in_flight, self.state.limit):
                arrived = asyncio.get_running_loop().time()
                at_once = domain.refuses_at_once(priority, self.dropping)
                if at_once or not await self._wait(priority):
                    await self._refuse(scope, send, priority, arrived, "at_once" if at_once else "queued")
                    return
                in_flight = self.in_flight - 1  # the slot was counted when it was handed over
        self.in_flight = in_flight = in_flight + 1
        if in_flight > self._peak:
            self._peak = in_flight
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.n_waiting:
                self._hand_over()
            now = loop.time()
            self._finished += 1
            self._latency_sum += now - started
            if now >= self._window_end:
                self._close_window(now, loop)

    async def _wait(self, priority: Priority) -> bool:
        """Wait for a slot while the queue is a burst passing; False (refuse) once it stands."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.n_waiting:
            self.empty_at = now
        future: asyncio.Future[bool] = loop.create_future()
        self.waiting[priority].append((now, future))
        self.n_waiting += 1
        if self._expiry is None:
            self._expiry = loop.call_at(now + self.config.limit.target, self._expire, loop)
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: its slot, if handed over, goes to the next
            if future.done() and not future.cancelled() and future.result():
                self.in_flight -= 1
                self._hand_over()
            raise

    def _hand_over(self) -> None:
        """A finished request's slot to the highest priority waiting that its ceiling admits."""
        for priority in domain.PRIORITIES:
            queue = self.waiting[priority]
            while queue and queue[0][1].done():  # cancelled while waiting
                queue.popleft()
                self._left()
            if queue and domain.admits(self.shares[priority], self.in_flight, self.state.limit):
                _, future = queue.popleft()
                self._left()
                self.in_flight += 1
                future.set_result(True)
                return

    def _left(self) -> None:
        self.n_waiting -= 1
        if not self.n_waiting:
            self.empty_at = asyncio.get_running_loop().time()

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Refuse the waiters past the queue's timeout; come back in a target's time while any wait."""
        self._expiry = None
        now = loop.time()
        timeout = domain.queue_timeout(now - self.empty_at, self.config.limit.target, self.config.burst_seconds)
        for priority in domain.PRIORITIES:
            queue = self.waiting[priority]
            while queue and (queue[0][1].done() or domain.sheds_queued(priority, now - queue[0][0], timeout)):
                _, future = queue.popleft()
                self._left()
                if not future.done():
                    future.set_result(False)
                    self.dropping = True
        if self.n_waiting:
            self._expiry = loop.call_at(now + self.config.limit.target, self._expire, loop)

    def _priority(self, scope: Scope) -> Priority | None:
        """The request's priority (None: never shed), worked out only when the limit is near."""
        declared = self.classify(scope["method"], scope["path"])
        if isinstance(declared, Pass):
            return None
        internal = False
        if self.token:
            for name, value in scope["headers"]:
                if name == INTERNAL_HEADER:
                    internal = hmac.compare_digest(value, self.token)
                    break
        return domain.priority_of(internal=internal, declared=declared, method=scope["method"])

    async def _refuse(self, scope: Scope, send: Send, priority: Priority, arrived: float, how: str) -> None:
        self.shed[priority] += 1
        self._refused += 1
        self.metrics.inc("shed_total", priority=priority)
        body, headers = self._answer
        if self.any_origin(scope["path"]):
            headers = headers + self._open_headers
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.metrics.observe("shed_refusal_seconds", asyncio.get_running_loop().time() - arrived, buckets=LAG_BUCKETS,
                             how=how)

    def _close_window(self, now: float, loop: asyncio.AbstractEventLoop) -> None:
        if self._window_end:  # the first request only opens the first window
            latency = self._latency_sum / self._finished if self._finished else 0.0
            window = Window(latency=latency, peak_in_flight=self._peak,
                            lag=0.0 if self._lag == float("inf") else self._lag)
            self.state = domain.next_limit(self.config.policy, self.state, window, self.config.limit)
            if self._open:
                self._admit_below = self.floor * self.state.limit
            self.metrics.set("shed_limit", self.state.limit)
            self.metrics.set("shed_in_flight_peak", self._peak)
            if not self._refused:
                self.dropping = False  # the load has receded: a burst may wait again
        self._refused = 0
        self._window_end = now + self.config.window_seconds
        self._finished, self._latency_sum, self._peak, self._lag = 0, 0.0, self.in_flight, float("inf")
        if self.config.policy == "codel" and self._probe is None:
            self._schedule_probe(loop)

    def _schedule_probe(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop's lag, sampled a few times a window: how late a timer runs is how long the ready work
        ahead of it took, the queueing delay every request meets at each step."""
        interval = self.config.window_seconds / LAG_PROBES_PER_WINDOW
        due = loop.time() + interval

        def probe() -> None:
            lag = loop.time() - due
            if lag < self._lag:
                self._lag = lag
            if self.in_flight or loop.time() < self._window_end:
                self._schedule_probe(loop)
            else:
                self._probe = None  # idle: no timer on an idle loop; the next request starts it again

        self._probe = loop.call_at(due, probe)
