"""The limit counters in a real JetStream counter stream: exact across instances, batched, and a circuit breaker.

Everything about counting runs against a real nats-server (the session's, or a private one for outages).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError

from services.auth.counters import (
    COUNTER_STREAM,
    INCR_HEADER,
    CounterStoreError,
    CounterStoreFailingOver,
    CounterStoreUnavailable,
    InvalidCounterSubject,
    JetStreamCounters,
    LocalCounters,
    Mode,
    ResilientCounters,
    counter_stream,
    counter_subject,
)
from services.auth.domain.lease_rules import LeasePolicy
from services.auth.domain.rules import HOUR_SECONDS, RuleId
from services.auth.domain.windows import window_start
from services.auth.leases import LeasedCounters
from services.auth.settings import AuthSettings
from shared.bus import connect
from shared.metrics import Metrics
from shared.settings import CommonSettings
from shared.streams import StreamSpec, apply_streams
from tests.integration.privatenats import PrivateNats, running_private_nats
from tests.waiting import wait_for

INSTANCES = 3
CONCURRENT = 2000
# The exactness tests measure counting, not latency: 2,000 callers on one event loop of a 2-core machine can
# take longer than the production budget just to be scheduled, so they get a generous one.
EXACTNESS_BUDGET_MS = 10_000
T = TypeVar("T")


@pytest.fixture(scope="module")
def auth_settings(prepared: CommonSettings) -> AuthSettings:
    return AuthSettings.model_validate(prepared.model_dump())


@pytest.fixture(scope="module")
async def counter_streams(prepared: CommonSettings, auth_settings: AuthSettings) -> StreamSpec:
    spec = counter_stream(auth_settings)
    nc = await connect(prepared, name="counter-tests-setup")
    try:
        await apply_streams(nc.jetstream(), prepared, (spec,))
        await apply_streams(nc.jetstream(), prepared, (spec,))  # applying again is an update, not an error
    finally:
        await nc.close()
    return spec


@pytest.fixture
async def instances(prepared: CommonSettings, counter_streams: StreamSpec) -> AsyncIterator[list[JetStreamCounters]]:
    """Three auth instances' stores, each on its own NATS connection."""
    conns = [await connect(prepared, name=f"counter-instance-{i}") for i in range(INSTANCES)]
    stores = [JetStreamCounters(c, stream=counter_streams.name, timeout_ms=EXACTNESS_BUDGET_MS) for c in conns]
    yield stores
    for store, conn in zip(stores, conns, strict=True):
        await store.close()
        await conn.close()


def fresh_key() -> str:
    return uuid.uuid4().hex[:12]


async def stored_total(nc: NATS, stream: str, subject: str) -> int:
    msg = await nc.jetstream().get_last_msg(stream, subject)
    value: str = json.loads(msg.data or b"{}")["val"]
    return int(value)


async def jittered(calls: Sequence[Callable[[], Awaitable[T]]], spread_s: float) -> list[T]:
    """Run the calls concurrently, each starting at a random moment in `spread_s`, so publishes interleave."""

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        await asyncio.sleep(random.random() * spread_s)
        return await call()

    return await asyncio.gather(*(one(c) for c in calls))


# ------------------------------------------------------------------------------------------------ exactness


async def test_concurrent_increments_through_three_instances_are_exactly_1_to_n(
    instances: list[JetStreamCounters], nc: NATS, counter_streams: StreamSpec
) -> None:
    subject = counter_subject("key", fresh_key(), window_start(time.time(), 60))
    stores = itertools.cycle(instances)
    calls = [functools.partial(next(stores).incr, subject) for _ in range(CONCURRENT)]

    counts = await jittered(calls, spread_s=0.3)

    assert sorted(counts) == list(range(1, CONCURRENT + 1))  # every caller its own count, none twice
    assert await stored_total(nc, counter_streams.name, subject) == CONCURRENT
    publishes = sum(s.publishes for s in instances)
    assert INSTANCES <= publishes <= CONCURRENT


async def test_exactly_the_limit_is_admitted_across_instances(
    instances: list[JetStreamCounters], auth_settings: AuthSettings
) -> None:
    limit = auth_settings.limit_key_per_minute
    subject = counter_subject("key", fresh_key(), window_start(time.time(), auth_settings.limit_window_seconds))
    stores = itertools.cycle(instances)
    calls = [functools.partial(next(stores).incr, subject) for _ in range(max(CONCURRENT, 2 * limit))]

    counts = await jittered(calls, spread_s=0.3)

    assert sum(1 for c in counts if c <= limit) == limit


async def test_callers_arriving_during_a_publish_share_the_next_one_and_each_gets_its_own_count(
    instances: list[JetStreamCounters],
) -> None:
    store = instances[0]
    subject = counter_subject("key", fresh_key(), window_start(time.time(), 60))
    wave = 10

    # the first caller finds the counter idle and publishes +1; the rest queue behind it and go out as one +9
    assert sorted(await asyncio.gather(*(store.incr(subject) for _ in range(wave)))) == list(range(1, wave + 1))
    assert store.publishes == 2

    # callers that arrive while a publish is in flight go out together in the next one
    leader = asyncio.create_task(store.incr(subject))
    deadline = time.monotonic() + 5
    while store.publishes < 3:  # the leader's publish is in flight
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    followers = [asyncio.create_task(store.incr(subject, by=2)) for _ in range(wave)]
    led, followed = await asyncio.gather(leader, asyncio.gather(*followers))

    assert store.publishes == 4
    assert led == wave + 1
    # callers adding 2 each own two counts: their totals are every second count above the leader's
    assert sorted(followed) == list(range(wave + 3, 3 * wave + 2, 2))


async def test_different_subjects_are_independent(instances: list[JetStreamCounters], nc: NATS) -> None:
    start = window_start(time.time(), 60)
    key = fresh_key()
    sizes = {counter_subject("key", key, start): 150, counter_subject("owner", key, start): 70}
    sizes[counter_subject("key", fresh_key(), start)] = 40
    stores = itertools.cycle(instances)
    calls: list[Callable[[], Awaitable[tuple[str, int]]]] = []
    for subject, n in sizes.items():
        for _ in range(n):

            async def call(s: JetStreamCounters = next(stores), subject: str = subject) -> tuple[str, int]:
                return subject, await s.incr(subject)

            calls.append(call)
    random.shuffle(calls)

    results = await jittered(calls, spread_s=0.2)

    for subject, n in sizes.items():
        assert sorted(c for s, c in results if s == subject) == list(range(1, n + 1))
        assert await stored_total(nc, COUNTER_STREAM.name, subject) == n


async def test_a_read_is_the_total_any_instance_counted_and_writes_nothing(
    instances: list[JetStreamCounters], nc: NATS
) -> None:
    """The auth_failure block is read on instances that did not count it: a direct get, not an increment by 0."""
    subject = counter_subject("auth_failure", fresh_key(), window_start(time.time(), 60))
    assert [await s.read(subject) for s in instances] == [0] * INSTANCES  # never counted: 0, not an error
    counted = 7
    for i in range(counted):
        await instances[i % INSTANCES].incr(subject)
    last = await nc.jetstream().get_last_msg(COUNTER_STREAM.name, subject)
    assert [await s.read(subject) for s in instances] == [counted] * INSTANCES
    assert (await nc.jetstream().get_last_msg(COUNTER_STREAM.name, subject)).seq == last.seq  # nothing written
    assert await instances[0].incr(subject) == counted + 1
    with pytest.raises(InvalidCounterSubject):
        await instances[0].read("not.a.counter")


# ------------------------------------------------------------------------------------------------ windows


async def test_counter_stream_refuses_per_message_ttls_and_windows_expire_by_max_age(
    nc: NATS, counter_streams: StreamSpec, auth_settings: AuthSettings, prepared: CommonSettings
) -> None:
    js = nc.jetstream()
    info = await js.stream_info(counter_streams.name)
    assert info.config.allow_msg_counter is True
    assert info.config.max_msgs_per_subject == 1  # only each counter's latest message (its total) is kept
    # no window's counter can age out while the window still counts
    assert info.config.max_age is not None
    assert info.config.max_age >= 2 * max(HOUR_SECONDS, auth_settings.limit_window_seconds)

    # a per-message TTL is refused on the publish, and a counter stream cannot be created to allow one
    subject = counter_subject("address", fresh_key(), window_start(time.time(), 60))
    reply = await nc.request(subject, b"", timeout=5, headers={INCR_HEADER: "+1", "Nats-TTL": "5"})
    assert "error" in json.loads(reply.data), reply.data
    with pytest.raises(APIError, match="TTL"):
        await js.add_stream(
            api.StreamConfig(name=f"TTL{fresh_key()}", subjects=[f"ttl{fresh_key()}.>"], allow_msg_counter=True,
                             allow_msg_ttl=True)
        )  # fmt: skip

    # a new window is a new subject, counting from 1
    key = fresh_key()
    now = time.time()
    this_window = counter_subject("address", key, window_start(now, auth_settings.limit_window_seconds))
    next_window = counter_subject(
        "address", key, window_start(now + auth_settings.limit_window_seconds, auth_settings.limit_window_seconds)
    )
    store = JetStreamCounters(nc, stream=counter_streams.name, timeout_ms=EXACTNESS_BUDGET_MS)
    assert [await store.incr(this_window) for _ in range(3)] == [1, 2, 3]
    assert await store.incr(next_window) == 1

    # an old window's counter leaves the stream by max_age: shown on a stream with a one-second max_age
    short = StreamSpec(f"LIMITSAGE{fresh_key().upper()}", (f"age{fresh_key()}.>",), "max_age demo",
                       max_age_seconds=1, extra=dict(COUNTER_STREAM.extra))  # fmt: skip
    # the duplicate window may not exceed max_age
    await apply_streams(js, prepared.model_copy(update={"stream_duplicate_window_seconds": 1}), (short,))
    try:
        aging = JetStreamCounters(nc, stream=short.name, timeout_ms=EXACTNESS_BUDGET_MS, subjects=short.subjects,
                                  probe_subject=short.subjects[0].replace(">", "probe"))  # fmt: skip
        old = short.subjects[0].replace(">", "address.k.0")
        assert [await aging.incr(old) for _ in range(2)] == [1, 2]

        async def expired() -> bool:
            return (await js.stream_info(short.name)).state.messages == 0

        await wait_for(expired, 15, "the counter expired by max_age")
        assert await aging.incr(old) == 1
    finally:
        await js.delete_stream(short.name)


# ------------------------------------------------------------------------------------------------ bad input


async def test_bad_subjects_and_missing_streams_give_clear_errors_not_hangs(
    nc: NATS, counter_streams: StreamSpec, prepared: CommonSettings
) -> None:
    store = JetStreamCounters(nc, stream=counter_streams.name, timeout_ms=EXACTNESS_BUDGET_MS)
    async with asyncio.timeout(5):
        # the server would count a wildcard against some other counter: refused before any publish
        for bad in ("limits.*", "limits.key.>", "limits..x", "limits.key x.1", "limits", "other.key.x.1", ""):
            with pytest.raises(InvalidCounterSubject):
                await store.incr(bad)
        with pytest.raises(ValueError):
            await store.incr(counter_subject("key", "k", 0), by=-1)
        assert store.publishes == 0

        # no stream captures the subject (or the stream was never applied): no responders, at once
        missing = JetStreamCounters(nc, stream="NOSUCHSTREAM", timeout_ms=EXACTNESS_BUDGET_MS,
                                    subjects=("nosuch.>",), probe_subject="nosuch.probe")  # fmt: skip
        started = time.monotonic()
        with pytest.raises(CounterStoreUnavailable, match="NOSUCHSTREAM"):
            await missing.incr("nosuch.key.k.0")
        assert time.monotonic() - started < 1.0

        # the subject's stream is not a counter stream: the server's refusal, named
        plain = StreamSpec(f"PLAIN{fresh_key().upper()}", (f"plain{fresh_key()}.>",), "not a counter stream")
        await apply_streams(nc.jetstream(), prepared, (plain,))
        try:
            wrong = JetStreamCounters(nc, stream=plain.name, timeout_ms=EXACTNESS_BUDGET_MS, subjects=plain.subjects,
                                      probe_subject=plain.subjects[0].replace(">", "probe"))  # fmt: skip
            with pytest.raises(CounterStoreError, match="counter"):
                await wrong.incr(plain.subjects[0].replace(">", "key.k.0"))
        finally:
            await nc.jetstream().delete_stream(plain.name)

        # the subject is stored by another stream than the one configured
        misnamed = JetStreamCounters(nc, stream="NOTLIMITS", timeout_ms=EXACTNESS_BUDGET_MS)
        with pytest.raises(CounterStoreError, match="NOTLIMITS"):
            await misnamed.incr(counter_subject("key", fresh_key(), 0))

        # a bad subject is the caller's bug: the breaker raises it and stays on the shared store
        resilient = ResilientCounters(store, LocalCounters())
        with pytest.raises(InvalidCounterSubject):
            await resilient.incr("limits.*")
        assert resilient.mode == "shared"
        await resilient.close()


# ------------------------------------------------------------------------------------------------ outages


@pytest.fixture
def private_nats() -> Iterator[PrivateNats]:
    with running_private_nats("weir-counter-nats-") as server:
        yield server


async def _connect_when_up(url: str, deadline_s: float = 15) -> NATS:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.05, connect_timeout=1,
                                    allow_reconnect=True)  # fmt: skip
            await nc.jetstream().account_info()
            return nc
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def mode_of(counters: ResilientCounters) -> Mode:
    return counters.mode  # read through a call: the mode changes behind mypy's narrowing


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
async def test_store_outage_falls_back_to_local_windows_without_waiting_and_comes_back(
    outage: str, private_nats: PrivateNats, prepared: CommonSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """`stopped`: the server is gone (connection refused); `frozen`: it is up but answers nothing (a timeout)."""
    settings = AuthSettings.model_validate({**prepared.model_dump(), "nats_url": private_nats.url})
    budget_s = settings.counter_store_timeout_ms / 1000
    caplog.set_level(logging.WARNING, logger="weir.auth.counters")
    nc = await _connect_when_up(private_nats.url)
    switches: list[Mode] = []
    reasons: list[str] = []

    def record(mode: Mode, reason: str) -> None:
        switches.append(mode)
        reasons.append(reason)

    metrics = Metrics("auth")
    counters = ResilientCounters(
        JetStreamCounters.from_settings(nc, settings),
        LocalCounters(),
        probe_interval_s=0.1,
        metrics=metrics,
        on_switch=record,
    )
    try:
        await apply_streams(nc.jetstream(), settings, (counter_stream(settings),))
        subject = counter_subject("address", fresh_key(), window_start(time.time(), settings.limit_window_seconds))
        before = 3
        assert [await counters.incr(subject) for _ in range(before)] == list(range(1, before + 1))
        assert counters.mode == "shared" and metrics.value("counter_store_shared") == 1

        if outage == "stopped":
            private_nats.stop()
        else:
            private_nats.freeze(True)

        durations: list[float] = []
        counts: list[int] = []
        local_calls = 50
        for _ in range(local_calls):
            started = time.perf_counter()
            counts.append(await counters.incr(subject))
            durations.append(time.perf_counter() - started)

        # local windows continue from the last shared total; only the first call may wait out the budget
        assert counts == list(range(before + 1, before + local_calls + 1))
        assert durations[0] < budget_s + 0.5
        if outage == "frozen":
            assert durations[0] >= budget_s * 0.9, reasons  # it really waited for the budget, and no longer
        assert max(durations[1:]) < budget_s, durations
        assert mode_of(counters) == "local"
        assert switches == ["local"]
        assert metrics.value("counter_store_shared") == 0
        assert metrics.value("counter_store_switches_total", to="local") == 1
        assert any("local windows on" in r.getMessage() for r in caplog.records)

        if outage == "stopped":
            private_nats.start()  # same port, same data directory
        else:
            private_nats.freeze(False)

        async def shared_again() -> bool:
            return counters.mode == "shared"

        await wait_for(shared_again, 20, "back on the shared store")
        assert switches == ["local", "shared"]
        assert metrics.value("counter_store_shared") == 1
        assert any("shared counting on again" in r.getMessage() for r in caplog.records)

        # what was counted locally was added to the shared counter (a frozen server may also have kept the
        # increment that timed out: the store over-counts by that one, never under-counts)
        expected = before + local_calls
        late = 1 if outage == "frozen" else 0

        async def synced() -> bool:
            return await stored_total(nc, "LIMITS", subject) >= expected

        await wait_for(synced, 10, "local counts added to the store")
        stored = await stored_total(nc, "LIMITS", subject)
        assert expected <= stored <= expected + late
        # and counts come from JetStream again
        assert await counters.incr(subject) == stored + 1
        fresh = counter_subject("address", fresh_key(), window_start(time.time(), settings.limit_window_seconds))
        assert [await counters.incr(fresh) for _ in range(3)] == [1, 2, 3]
        assert await stored_total(nc, "LIMITS", fresh) == 3
    finally:
        await counters.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await nc.close()


def test_local_windows_count_from_the_last_shared_total_and_forget_old_counters() -> None:
    now = [1000.0]
    local = LocalCounters(retain_seconds=120, max_counters=3, clock=lambda: now[0])
    local.observe("limits.key.a.0", 7)
    assert [local.incr_now("limits.key.a.0") for _ in range(2)] == [8, 9]
    assert local.incr_now("limits.key.a.60", by=3) == 3
    assert local.take_unsynced() == {"limits.key.a.0": 2, "limits.key.a.60": 3}
    assert local.take_unsynced() == {}
    now[0] += 121  # both counters are older than the retention: a new one makes room by forgetting them
    assert local.incr_now("limits.key.a.180") == 1
    assert len(local) == 1
    for n in range(4):  # at most max_counters, oldest dropped first
        local.incr_now(f"limits.key.b.{n}")
    assert len(local) == 3


async def test_an_increment_applied_after_its_budget_is_neither_lost_nor_counted_twice(
    private_nats: PrivateNats, prepared: CommonSettings
) -> None:
    """A store that answers late (frozen, then thawed) applies the increment whose budget ran out; its PubAck, still
    awaited, says so. While the store fails over, its requests were answered 503: the counts it owns go to the lease
    and admit the next requests, rather than being lost (a slow store would make the instances refuse below the
    limit). On local windows, its requests were counted locally: the late increment has counted them in the store,
    and they are not added again when it is back (before, they were: the store over-counted by them)."""
    settings = AuthSettings.model_validate({**prepared.model_dump(), "nats_url": private_nats.url,
                                            "counter_store_timeout_ms": 200})
    nc = await _connect_when_up(private_nats.url)
    metrics = Metrics("auth")
    shared = JetStreamCounters.from_settings(nc, settings)
    assert shared.late_ack_s == settings.counter_store_late_ack_ms / 1000
    counters = ResilientCounters(shared, LocalCounters(), probe_interval_s=0.1, metrics=metrics, failover_s=3600)
    leases: LeasedCounters[str] = LeasedCounters(counters, LeasePolicy(max_lease=1, fraction=1),
                                                 idle_seconds=3600, metrics=metrics)  # no grant ahead of need
    counters.send_late_totals_to(leases.late_grant)
    limit = 100
    late = 3  # counts of each increment that is answered late
    try:
        await apply_streams(nc.jetstream(), settings, (counter_stream(settings),))
        subject = counter_subject("key", fresh_key(), window_start(time.time(), settings.limit_window_seconds))
        window_end = window_start(time.time(), settings.limit_window_seconds) + settings.limit_window_seconds

        async def take(k: int) -> list[int]:
            return await leases.take(subject, k, "tag", RuleId.KEY, limit, window_end)

        async def shared_again() -> bool:
            return counters.mode == "shared"

        assert await take(2) == [1, 2]

        # failing over: the requests are not decided (503), and the late increment's counts admit the next ones
        private_nats.freeze(True)
        with pytest.raises(CounterStoreFailingOver):
            await take(late)
        private_nats.freeze(False)

        async def held() -> bool:
            return leases.held(subject) == late

        await wait_for(held, 10, "the late increment's counts held by the lease")
        assert metrics.value("counter_late_counts_total", outcome="held") == late
        await wait_for(shared_again, 10, "back on the shared store")
        assert await take(late) == [3, 4, 5]  # the lowest first, and nothing more counted for them
        assert await stored_total(nc, "LIMITS", subject) == 2 + late

        # on local windows: decided here, counted in the store by the late increment, not added again
        counters.failover_s = 0
        private_nats.freeze(True)
        assert await take(late) == [6, 7, 8] and counters.mode == "local"  # from the last shared total
        private_nats.freeze(False)
        await wait_for(shared_again, 10, "back on the shared store")
        assert await take(1) == [9]  # the next count comes from the store: the three counted once
        assert await stored_total(nc, "LIMITS", subject) == 2 + 2 * late + 1
        assert leases.held(subject) == 0
        assert metrics.value("counter_late_counts_total", outcome="held") == late
    finally:
        private_nats.freeze(False)
        await counters.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await nc.close()


async def test_counts_the_store_may_keep_unused_are_reported_and_bound_what_goes_unadmitted(
    private_nats: PrivateNats, prepared: CommonSettings
) -> None:
    """An increment whose PubAck never comes in time (a leader killed between applying and answering; here a frozen
    store thawed after the late wait) is counted by the store and taken by nobody; a give-back while the store is
    away does not reach it. The instances then admit fewer than the limit, never more, by what
    `counter_counts_unusable_total` says."""
    settings = AuthSettings.model_validate({**prepared.model_dump(), "nats_url": private_nats.url,
                                            "counter_store_timeout_ms": 100, "counter_store_late_ack_ms": 300})
    nc = await _connect_when_up(private_nats.url)
    metrics = Metrics("auth")
    counters = ResilientCounters(JetStreamCounters.from_settings(nc, settings), LocalCounters(),
                                 probe_interval_s=0.1, metrics=metrics, failover_s=3600)
    leases: LeasedCounters[str] = LeasedCounters(counters, LeasePolicy(max_lease=1, fraction=1),
                                                 idle_seconds=3600, metrics=metrics)
    counters.send_late_totals_to(leases.late_grant)
    limit, lost, kept_back = 100, 3, 2
    try:
        await apply_streams(nc.jetstream(), settings, (counter_stream(settings),))
        subject = counter_subject("key", fresh_key(), window_start(time.time(), settings.limit_window_seconds))
        window_end = window_start(time.time(), settings.limit_window_seconds) + settings.limit_window_seconds

        async def take(k: int) -> list[int]:
            return await leases.take(subject, k, "tag", RuleId.KEY, limit, window_end)

        def unusable(why: str) -> float:
            return metrics.value("counter_counts_unusable_total", why=why)

        async def reported() -> bool:
            return unusable("unacked") == lost

        async def shared_again() -> bool:
            return counters.mode == "shared"

        assert await take(2) == [1, 2]
        private_nats.freeze(True)
        with pytest.raises(CounterStoreFailingOver):
            await take(lost)
        await wait_for(reported, 10, "the unacknowledged increment reported")
        await counters.give_back(subject, kept_back)  # the store is away: kept there
        assert unusable("give_back_failed") == kept_back
        private_nats.freeze(False)
        await wait_for(shared_again, 10, "back on the shared store")
        assert await stored_total(nc, "LIMITS", subject) == 2 + lost  # applied, and its counts held by nobody
        assert leases.held(subject) == 0
        assert await take(1) == [2 + lost + 1]  # the next request skips them: fewer admitted, by the metric
    finally:
        private_nats.freeze(False)
        await counters.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await nc.close()
