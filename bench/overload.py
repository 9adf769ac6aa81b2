"""Overload (issue 30, SPEC 15): open-loop load at 1x, 2x and 4x of the stack's capacity, each shed policy in one run.

    python -m bench.overload [--seconds 30] [--warm-seconds 5] [--multiples 1,2,4] [--policies off,gradient,codel]
                             [--soak-minutes 10] [--soak-policy gradient] [--calibrate-seconds 8] [--out FILE]
    python -m bench.overload --unloaded [--seconds 30] [--rounds 3] [--policies fixed,gradient,codel]
                                                        (needs wrk; --unloaded also gcc)

Each policy gets a `weir up` stack of its own (WEIR_SHED_POLICY, every request limit raised so that only capacity
refuses). The capacity is bench.api's way, once, on the first policy's stack (`off` by default: nothing shed, so
the closed loop measures the stack, not a limit): wrk, closed loop, 32 connections, on the mix (reads, lists,
creates and a trickle of internal-token reads, bench/soak.lua). Each multiple of it is then offered in an open loop
for a warm-up and `--seconds`: goodput (2xx/s of the non-internal traffic) and its ratio to 1x, the admitted
(2xx) requests' p50/p99 and p99 ratio to 1x, the shed answers (503 `overloaded`) and their p99, the internal
requests answered 2xx, and errors (other statuses, lost answers, requests the client could not send within
LATE_SECONDS of their time). Beside the goodput in requests, its work: each public kind's capacity alone is
calibrated too (the same closed loop, that kind only), and a step's work is the sum over kinds of its 2xx/s over that
kind's capacity (1.0: the whole stack busy with answers that count). Shedding's priorities send the writes first,
and a create costs the stack several reads, so the requests' count alone falls with the mix that is admitted.
Then, for `--soak-policy`, a soak at SOAK_MULTIPLE of the capacity: per minute the
admitted requests' p50/p99, each service's memory growth, and the drain (bench/soak.py's checks).

A policy named POLICY-edge (`off-edge`: the api's shedding off) runs its stack as `weir up --edge` and sends its
load through the edge (weir/edge.py: HAProxy, a fixed number of requests at once, a short queue, the api's own 503
`overloaded` from HAProxy for the rest): what refusing before the api's Python event loop gives, beside the api's own
shedder in the same run (`--policies fixed-nosteps,off-edge`).

`--unloaded` instead measures what shedding costs an unloaded stack (issue 30: < 3 %): apis with shed_policy off
and each of `--policies` (variants too) beside each other against one auth, bench.api's mirrored rounds of wrk at
UNLOADED_CONNECTIONS on the guarded GET (below every policy's ceiling: nothing is shed), each api's 2xx/s, p99 and
CPU per request over `off`'s (the CPU is the cost itself, and moves less with this machine's speed than a rate);
then auth.check decisions/s with auth's shedding on and off (bench/auth.py's closed loops; auth sheds alike for every
policy), alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import auth as auth_bench
from bench.api import (
    at_least,
    cores,
    cpu_seconds,
    mirrored_round,
    place,
    provision,
    service_env,
    settle,
    start,
)
from bench.api import wrk as wrk_closed
from bench.bus import servers
from bench.soak import (
    CALIBRATE_CONNECTIONS,
    MAX_IN_FLIGHT,
    MEMORY_GROWTH_MAX,
    WRK_START_SECONDS,
    calibrate_mix,
    drained,
    hist_pct,
    rss_mb,
    run_wrk,
    start_stack,
    status,
)
from shared.authcheck import CHECK_SUBJECT
from shared.settings import CommonSettings
from weir.edge import EdgeSettings
from weir.up import prepare

POLICIES = ("off", "fixed", "gradient", "codel")  # `off` first: the capacity is calibrated on the first policy's stack
# POLICY + a variant's suffix in --policies: that policy with its priorities changed. -nosteps: the reserve of the
# highest priority kept, every other one under one ceiling (reads, writes and completions shed alike: the default
# since 2026-12-07); -steps: each priority its own ceiling, 0.1 of the limit lower than the one above (the default
# before); -flat: no reserve either
VARIANTS = {"-nosteps": {"WEIR_SHED_PRIORITY_STEP": "0"}, "-steps": {"WEIR_SHED_PRIORITY_STEP": "0.1"},
            "-flat": {"WEIR_SHED_RESERVE_SHARE": "0", "WEIR_SHED_PRIORITY_STEP": "0"}}
EDGE = "-edge"  # a policy's (or variant's) stack with HAProxy in front of its api (`weir up --edge`)
PUBLIC = ("read", "list", "create")  # goodput's kinds
# shares of the offered rate (bench/soak.lua's kinds): reads and writes, and a trickle with Weir's internal token
MIX = {"read": 0.74, "list": 0.15, "create": 0.10, "internal": 0.01}
EXPECTED: dict[str, tuple[int, ...]] = {"read": (200,), "list": (200,), "create": (201,), "internal": (200,)}
SHED = ":shed"  # bench/soak.lua's pseudo-kind of a kind's 503 `overloaded` answers (shed=1)
SHED_SENT = ":shed_sent"  # the same answers' latencies from their sending, not their scheduled time
MULTIPLES = (1.0, 2.0, 4.0)
STEP_SECONDS = 30
WARM_SECONDS = 5
LATE_SECONDS = 1.0  # a request its connection could not send within this of its time is `unsent` (an error)
GRACE_SECONDS = 4  # wrk runs this long past a step's schedule: an answer later than this is lost (no_response)
SAMPLE_SECONDS = 1.0  # how often the api's concurrency limit is read from its /metrics during a step
METRICS_TIMEOUT = 2.0
# the api's /metrics families read during a step (shared/metrics.py): what its shedder and auth shed, its limit
WATCHED = {"weir_shed": "api_shed", "weir_auth_overloaded": "auth_shed", "weir_shed_limit": "limit"}
HISTOGRAMS = {"weir_event_loop_lag_seconds": "loop_lag", "weir_shed_refusal_seconds": "refusal"}
REFUSALS = ("at_once", "queued")  # shed_refusal_seconds' `how` (shared/overload/edge.py)
# a probe beside the load: a few reads a second from a wrk of its own at a higher CPU priority, as a client on a
# machine of its own sees the api (the load's wrk, hundreds of threads on the stack's cores, waits for a CPU itself)
PROBE_RATE = 40.0
PROBE_CONNECTIONS = 4
PROBE_NICE = -10
CONNECTION_RATE = 10.0  # requests/s per wrk connection: each is free 100 ms after sending, several admitted p99s
MIN_CONNECTIONS = 8
SOAK_MULTIPLE = 1.5
SOAK_MINUTES = 10.0
SOAK_P50_MAX_MS = 100.0
SOAK_SERVICES = ("api", "auth")  # whose memory growth the soak checks (every service's is reported)
DRAIN_SECONDS = 120
# issue 30's targets, at the highest multiple against 1x
GOODPUT_RATIO_MIN = 0.9
P99_RATIO_MAX = 2.0
SHED_P99_MAX_MS = 5.0
INTERNAL_OK_MIN = 0.999
UNLOADED_COST_MAX = 0.03  # shedding may cost the unloaded path less than this
UNLOADED_ROUNDS = 3
# --unloaded's closed loop: requests in flight well under the lowest ceiling of the default limit (reads' 0.6 of 32),
# so the shedder only counts, as on an api below its capacity
UNLOADED_CONNECTIONS = 8
AUTH_REQUESTS = 150_000  # auth.check closed loops of ~5 s: runs of 20,000 (under 1 s) moved 20 % from one to the next
AUTH_CONCURRENCY = 64
AUTH_KEYS = 20
LIMITS_OFF = {f"WEIR_LIMIT_{rule}_PER_MINUTE": str(10**9)
              for rule in ("ADDRESS", "AUTH_FAILURE", "KEY", "OWNER", "UPLOAD_TOKEN")}


def connections(rate: float) -> int:
    """wrk's connections (one per thread, bench/soak.lua) for `rate`/s: one each CONNECTION_RATE/s, at most
    MAX_IN_FLIGHT (past it, what the client cannot send within LATE_SECONDS counts as unsent)."""
    return max(MIN_CONNECTIONS, min(MAX_IN_FLIGHT, math.ceil(rate / CONNECTION_RATE)))


def work(goodput_by_kind: dict[str, float], capacities: dict[str, float]) -> float | None:
    """The stack's share busy with answers that count: each kind's 2xx/s over what the stack answers of that kind
    alone (None while the kinds' capacities are unknown)."""
    if not capacities:
        return None
    return round(sum(n / capacities[kind] for kind, n in goodput_by_kind.items() if capacities.get(kind)), 3)


def probe_figures(periods: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe's reads over all its periods (a step has one, a soak one a minute): the admitted reads' p99, the shed
    answers' count and their p99 from sending."""
    def summed(kind: str, field: str) -> dict[str, int]:
        total: Counter[str] = Counter()
        for row in periods:
            total.update(row.get(kind, {}).get(field, {}))
        return dict(total)
    return {"admitted_p99_ms": hist_pct(summed("read", "hist"), 0.99),
            "shed": sum(summed("read" + SHED, "status").values()),
            "shed_sent_p99_ms": hist_pct(summed("read" + SHED_SENT, "hist"), 0.99)}


def scraped(text: str) -> dict[str, Any]:
    """From the api's /metrics: WATCHED's sums (what its shedder and auth shed, its limit now) and HISTOGRAMS'
    cumulative buckets {upper bound: count}, keyed by name and, for the refusals, how ("refusal:queued")."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        if family.name in WATCHED:
            out[WATCHED[family.name]] = sum(x.value for x in family.samples if not x.name.endswith("_created"))
        elif family.name in HISTOGRAMS:
            for x in family.samples:
                if x.name.endswith("_bucket"):
                    key = ":".join((HISTOGRAMS[family.name], *(x.labels[k] for k in ("how",) if k in x.labels)))
                    out.setdefault(key, {})[float(x.labels["le"])] = x.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile (ms, its bucket's upper bound) of what a Prometheus histogram counted between two scrapes;
    None when it counted nothing, or when the quantile is past the last finite bound."""
    bounds = sorted(after)
    counted = [after[le] - before.get(le, 0.0) for le in bounds]  # cumulative, the last +Inf's
    if not counted or counted[-1] <= 0:
        return None
    rank = q * counted[-1]
    le = next(le for le, n in zip(bounds, counted, strict=True) if n >= rank)
    return None if math.isinf(le) else round(le * 1000, 2)


def inside_api(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the api itself saw between two scrapes: its event loop's lag p50 and p99 (the wait any request met
    there before the shedder ran), and its refusals' p99 from the shedder's first look to the 503 written, with how
    many waited in its queue first."""
    def counted(key: str) -> float:
        return float(after.get(key, {}).get(math.inf, 0.0) - before.get(key, {}).get(math.inf, 0.0))

    def merged(scrape: dict[str, Any]) -> dict[float, float]:
        total: Counter[float] = Counter()
        for how in REFUSALS:
            total.update(scrape.get(f"refusal:{how}", {}))
        return dict(total)

    lag = (before.get("loop_lag", {}), after.get("loop_lag", {}))
    return {"api_loop_lag_p50_ms": bucket_quantile(*lag, 0.5), "api_loop_lag_p99_ms": bucket_quantile(*lag, 0.99),
            "refusal_p99_ms": bucket_quantile(merged(before), merged(after), 0.99),
            "refused_after_queueing": round(counted("refusal:queued"))}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def tally(row: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One counting period of bench/soak.lua (shed=1): goodput, admitted and shed latencies, the internal
    requests' 2xx share, errors."""
    admitted: Counter[str] = Counter()
    shed_hist: Counter[str] = Counter()
    shed_sent_hist: Counter[str] = Counter()
    errors: dict[str, int] = {}
    ok = shed = unsent = 0
    by_kind: dict[str, int] = {}
    for kind in PUBLIC:
        cell = row.get(kind, {})
        admitted.update(cell.get("hist", {}))
        shed_cell = row.get(kind + SHED, {})
        shed_hist.update(shed_cell.get("hist", {}))
        shed_sent_hist.update(row.get(kind + SHED_SENT, {}).get("hist", {}))
        kind_shed = sum(shed_cell.get("status", {}).values())
        shed += kind_shed
        for code, n in cell.get("status", {}).items():
            if int(code) in EXPECTED[kind]:
                ok += n
                by_kind[kind] = by_kind.get(kind, 0) + n
                continue
            if code == "503":
                n -= kind_shed  # a 503 `overloaded` is a shed answer, any other an error
            if n:
                errors[f"{kind} {code}"] = n
        for what in ("no_response", "unsent"):
            if cell.get(what):
                errors[f"{kind} {what}"] = cell[what]
        unsent += cell.get("unsent", 0)
    internal = row.get("internal", {})
    internal_statuses = internal.get("status", {})
    internal_sent = sum(internal_statuses.values()) + internal.get("no_response", 0) + internal.get("unsent", 0)
    internal_ok = sum(n for code, n in internal_statuses.items() if int(code) in EXPECTED["internal"])
    return {"goodput_per_s": round(ok / seconds, 1),
            "goodput_by_kind": {kind: round(n / seconds, 1) for kind, n in by_kind.items()},
            "answered_per_s": round(sum(
                sum(row.get(k, {}).get("status", {}).values()) for k in MIX) / seconds, 1),
            "admitted_p50_ms": hist_pct(dict(admitted), 0.5), "admitted_p99_ms": hist_pct(dict(admitted), 0.99),
            "shed": shed, "shed_p99_ms": hist_pct(dict(shed_hist), 0.99),
            "shed_sent_p99_ms": hist_pct(dict(shed_sent_hist), 0.99), "unsent": unsent,
            "internal_requests": internal_sent, "internal_ok": round(internal_ok / internal_sent, 5)
            if internal_sent else None, "internal_statuses": internal_statuses,
            "errors": errors, "n_errors": sum(errors.values())}


async def new_video(api: str, key: str) -> str:
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        r = await http.post("/v1/videos", json={"name": "overload target"}, headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        video: str = r.json()["id"]
        return video


class Stack:
    """One policy's `weir up`: its api, demo key, internal token, a video to read, and a place for wrk's files."""

    def __init__(self, info: dict[str, Any], data_dir: Path, video: str) -> None:
        self.info, self.data_dir, self.video = info, data_dir, video
        self.key, self.token = info["demo"]["secret_key"], info["internal_token"]
        self.metrics_url = info["services"]["api"]  # the api's own /metrics, not through an edge
        self.api = info["api_url"]  # where the load goes: the api, or the edge in front of it (`weir up --edge`)

    async def counters(self, http: httpx.AsyncClient) -> dict[str, Any]:
        """The api's /metrics now (`scraped`; empty where a scrape did not answer in time)."""
        try:
            r = await http.get(f"{self.metrics_url}/metrics", timeout=METRICS_TIMEOUT)
        except httpx.HTTPError:
            return {}
        return scraped(r.text) if r.status_code == 200 else {}

    async def watched(self, rate: float, seconds: float, warm: float, period: float, name: str
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`offer`, and what the api's /metrics said meanwhile: refusals by the api's shedder and by auth (from the
        counted part's start to the end), the concurrency limit's range; and the cores the api, auth and wrk used."""
        pids = self.pids()
        usage, t_wrk = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        wrk_before = usage.ru_utime + usage.ru_stime
        async with httpx.AsyncClient() as http:
            task = asyncio.create_task(self.offer(rate, seconds, warm, period, name))
            probe = asyncio.create_task(self.probe(seconds, warm, period, name))
            await asyncio.sleep(WRK_START_SECONDS + warm)
            before = await self.counters(http)
            cpu_before, t0 = {n: cpu_seconds(pids[n]) for n in SOAK_SERVICES}, time.monotonic()
            cpu_after: dict[str, float] | None = None
            t1 = t0
            limits: list[float] = []
            at_end: dict[str, Any] = {}
            counted_end = t0 + seconds
            while not task.done():
                if "limit" in (now := await self.counters(http)):
                    limits.append(now["limit"])
                if cpu_after is None and time.monotonic() >= counted_end:
                    cpu_after, t1 = {n: cpu_seconds(pids[n]) for n in SOAK_SERVICES}, time.monotonic()
                    at_end = now
                left = SAMPLE_SECONDS if cpu_after is not None else counted_end - time.monotonic()
                await asyncio.wait({task}, timeout=min(SAMPLE_SECONDS, max(0.01, left)))
            after = await self.counters(http)
            probed = await probe
        if cpu_after is None:
            cpu_after, t1 = {n: cpu_seconds(pids[n]) for n in SOAK_SERVICES}, time.monotonic()
        # the services' CPU over the counted part, in cores; wrk's over all of its run (a child reaped by now)
        cores_used = {n: round((cpu_after[n] - cpu_before[n]) / (t1 - t0), 2) for n in SOAK_SERVICES}
        wrk_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        cores_used["wrk"] = round((wrk_cpu.ru_utime + wrk_cpu.ru_stime - wrk_before) / (time.monotonic() - t_wrk), 2)
        shed = {k: round(after[k] - before[k]) if k in after and k in before else None
                for k in ("api_shed", "auth_shed")}
        return task.result(), {**shed, "limit_min": min(limits, default=None), "limit_max": max(limits, default=None),
                               "cores": cores_used, "probe": probed, **inside_api(before, at_end or after)}

    def pids(self) -> dict[str, int]:
        stack = json.loads((self.data_dir / "stack.json").read_text())
        return {name: int(pid) for name, pid in stack["pids"].items() if name != "weir"}

    async def offer(self, rate: float, seconds: float, warm: float, period: float, name: str) -> dict[str, Any]:
        """bench/soak.lua's open loop of MIX at `rate`/s: `warm` seconds uncounted, then `seconds` counted in
        periods of `period`."""
        start = time.monotonic() + WRK_START_SECONDS
        return await run_wrk(self.api, self.key, self.video, rate, start, (warm + seconds) / 60,
                             self.data_dir.parent / f"{name}.json", threads=connections(rate),
                             duration=math.ceil(WRK_START_SECONDS + warm + seconds + GRACE_SECONDS), mix=MIX,
                             expected=EXPECTED, options=(f"internal={self.token}", f"warm={warm:g}",
                                                        f"period={period:g}", f"late={LATE_SECONDS:g}", "shed=1"))

    async def probe(self, seconds: float, warm: float, period: float, name: str) -> dict[str, Any]:
        """PROBE_RATE reads/s beside `offer`, from a wrk at PROBE_NICE (0 when not root): the shed answers' p99 from
        their sending, and the admitted reads' p99, as a client with a CPU of its own sees them."""
        start = time.monotonic() + WRK_START_SECONDS
        nice = PROBE_NICE if os.geteuid() == 0 else 0
        doc = await run_wrk(self.api, self.key, self.video, PROBE_RATE, start, (warm + seconds) / 60,
                            self.data_dir.parent / f"{name}-probe.json", threads=PROBE_CONNECTIONS,
                            duration=math.ceil(WRK_START_SECONDS + warm + seconds + GRACE_SECONDS),
                            mix={"read": 1.0}, expected={"read": EXPECTED["read"]},
                            options=(f"warm={warm:g}", f"period={period:g}", f"late={LATE_SECONDS:g}", "shed=1"),
                            nice=nice)
        return {"nice": nice, **probe_figures(doc["minutes"])}

    async def calibrate(self, seconds: int) -> float:
        """What the stack answers of MIX per second, closed loop (bench.soak.calibrate_mix)."""
        return await calibrate_mix(self.api, self.key, self.video, seconds, self.data_dir.parent / "calibration.json",
                                   mix=MIX, expected=EXPECTED, options=(f"internal={self.token}",))

    async def calibrate_kinds(self, seconds: int) -> dict[str, float]:
        """What the stack answers of each public kind alone per second (the same closed loop), each after the
        work the last one left behind (a create's events, webhooks) is done."""
        out: dict[str, float] = {}
        for kind in PUBLIC:
            out[kind] = round(await calibrate_mix(
                self.api, self.key, self.video, seconds, self.data_dir.parent / f"calibration-{kind}.json",
                mix={kind: 1.0}, expected={kind: EXPECTED[kind]}), 1)
            await asyncio.to_thread(self.settle, every=True)
        return out

    def settle(self, every: bool = False) -> None:
        """Until the api and auth (`every`: every service) are idle (an overloaded api may still be answering what
        wrk gave up on; a create's events keep the consumers busy after its answer)."""
        pids = self.pids()
        settle([pid for n, pid in pids.items() if every or n in SOAK_SERVICES], limit=DRAIN_SECONDS / 4)


async def steps(stack: Stack, capacity: float, kinds: dict[str, float], args: argparse.Namespace
                ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for multiple in args.multiples:
        rate = capacity * multiple
        print(f"  {multiple:g}x: {rate:.0f}/s offered for {args.warm_seconds:g} + {args.seconds} s "
              f"({connections(rate)} wrk connections)", file=sys.stderr, flush=True)
        doc, seen = await stack.watched(rate, args.seconds, args.warm_seconds, args.seconds, f"step-{multiple:g}x")
        row = {"multiple": multiple, "offered_per_s": round(rate, 1), "connections": doc["threads"],
               **tally(doc["minutes"][0], args.seconds), **seen,
               "wrk_socket_errors": {k: v for k, v in doc["wrk_errors"].items() if v and k != "status"},
               **({"wrk_stderr": doc["stderr"]} if doc["stderr"].strip() else {})}
        row["work"] = work(row["goodput_by_kind"], kinds)
        # per core of the api: what the place of refusing costs the api itself, apart from what the load generator
        # and an edge, sharing its cores here, take from it
        row["goodput_per_api_core"] = ratio(row["goodput_per_s"], row["cores"].get("api"))
        base = out[0] if out else row
        row["goodput_ratio"] = ratio(row["goodput_per_s"], base["goodput_per_s"])
        row["work_ratio"] = ratio(row["work"], base["work"])
        row["p99_ratio"] = ratio(row["admitted_p99_ms"], base["admitted_p99_ms"])
        row["per_core_ratio"] = ratio(row["goodput_per_api_core"], base["goodput_per_api_core"])
        out.append(row)
        await asyncio.to_thread(stack.settle)
    return out


async def soak(stack: Stack, capacity: float, minutes: float) -> dict[str, Any]:
    """SOAK_MULTIPLE of the capacity for `minutes`: per minute, memory, the drain (bench/soak.py's checks)."""
    rate = capacity * SOAK_MULTIPLE
    print(f"  soak: {rate:.0f}/s for {minutes:g} min ({connections(rate)} wrk connections)", file=sys.stderr,
          flush=True)
    pids = stack.pids()
    memory_start = {name: rss_mb(pid) for name, pid in pids.items()}
    doc, seen = await stack.watched(rate, minutes * 60, 0, 60, "soak")
    pids_end = stack.pids()
    memory_end = {name: rss_mb(pid) for name, pid in pids_end.items()}
    deadline = time.monotonic() + DRAIN_SECONDS
    while True:
        left = drained(status(stack.data_dir))
        if not any(left.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    per_minute = []
    for i, row in enumerate(doc["minutes"]):
        seconds = min(60.0, minutes * 60 - 60 * i)
        per_minute.append({"minute": i + 1, **tally(row, seconds)})
    growth = {name: round(end / begin - 1, 3) for name, begin in memory_start.items()
              if begin and (end := memory_end.get(name))}
    slow = [m["minute"] for m in per_minute if (m["admitted_p50_ms"] or 0) > SOAK_P50_MAX_MS]
    return {"policy": None, "offered_per_s": round(rate, 1), "minutes": minutes, "connections": doc["threads"],
            **seen, "per_minute": per_minute, "memory_start_mb": memory_start, "memory_end_mb": memory_end,
            "memory_growth": growth,
            "memory_ok": all(growth.get(n, 0) <= MEMORY_GROWTH_MAX for n in SOAK_SERVICES),
            "minutes_p50_over": slow, "restarted": sorted(n for n in pids if pids_end.get(n) != pids[n]),
            "after_drain": left, "drained": not any(left.values()),
            "errors": sum(m["n_errors"] for m in per_minute)}


async def policy_run(policy: str, capacity: float | None, kinds: dict[str, float], args: argparse.Namespace,
                     tmp: Path) -> tuple[float, dict[str, float], dict[str, Any]]:
    """One policy's stack: the capacity and each kind's (calibrated here when not yet known), the steps, and its
    soak if asked."""
    data_dir = tmp / policy / "weir"
    data_dir.parent.mkdir(parents=True)
    print(f"{policy}: starting weir up", file=sys.stderr, flush=True)
    split = cores(args.own_core)
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the stack's servers and wrk, started from here, inherit the others
    env = {**LIMITS_OFF, **policy_env(policy)}
    front = edged(policy)[1]
    if front:  # the deployment's own edge (weir/edge.py), with these numbers
        env.update({"WEIR_EDGE_MAXCONN": str(args.edge_maxconn), "WEIR_EDGE_QUEUE_MS": str(args.edge_queue_ms)})
    proc, info = await asyncio.to_thread(start_stack, data_dir, env, ("--edge",) if front else ())
    try:
        stack = Stack(info, data_dir, await new_video(info["api_url"], info["demo"]["secret_key"]))
        if split is not None:
            place(stack.pids()["api"], split[0])
        out: dict[str, Any] = {"policy": policy}
        if capacity is None:
            await stack.calibrate(min(args.calibrate_seconds, WARM_SECONDS))  # warm-up
            capacity = await stack.calibrate(args.calibrate_seconds)
            out["calibrated_per_s"] = round(capacity, 1)
            print(f"  capacity: {capacity:.0f}/s of the mix (closed loop, {CALIBRATE_CONNECTIONS} connections)",
                  file=sys.stderr, flush=True)
            if policy == "off":  # a shedder would refuse the closed loop's excess: its own limit, not the stack's
                await asyncio.to_thread(stack.settle, every=True)
                kinds = await stack.calibrate_kinds(args.calibrate_seconds)
                out["kind_capacities"] = kinds
                print(f"  each kind alone: {kinds} /s", file=sys.stderr, flush=True)
        out["steps"] = await steps(stack, capacity, kinds, args)
        if args.soak_minutes > 0 and policy == args.soak_policy:
            out["soak"] = {**await soak(stack, capacity, args.soak_minutes), "policy": policy}
        return capacity, kinds, out
    finally:
        if front:
            print(f"  edge: haproxy used {cpu_seconds(info['edge']['pid']):.1f} s of CPU", file=sys.stderr,
                  flush=True)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 120)


def checks(policies: list[dict[str, Any]]) -> dict[str, dict[str, bool | None]]:
    """Issue 30's targets per policy, at the highest multiple against 1x (None: not measured)."""
    out: dict[str, dict[str, bool | None]] = {}
    for p in policies:
        top = p["steps"][-1]
        got: dict[str, bool | None] = {
            "goodput_ratio": None if top["goodput_ratio"] is None else top["goodput_ratio"] >= GOODPUT_RATIO_MIN,
            "p99_ratio": None if top["p99_ratio"] is None else top["p99_ratio"] <= P99_RATIO_MAX,
            "shed_p99": None if top["shed_p99_ms"] is None else top["shed_p99_ms"] <= SHED_P99_MAX_MS,
            # from the request's sending: without wrk's own lateness (its threads wait for a CPU beside the stack)
            "shed_p99_sent": None if top["shed_sent_p99_ms"] is None else top["shed_sent_p99_ms"] <= SHED_P99_MAX_MS,
            "internal_ok": None if top["internal_ok"] is None else top["internal_ok"] >= INTERNAL_OK_MIN}
        if "soak" in p:
            s = p["soak"]
            got.update(soak_memory=s["memory_ok"], soak_p50=not s["minutes_p50_over"], soak_drained=s["drained"])
        out[p["policy"]] = got
    return out


def who(row: dict[str, Any]) -> str:
    """Who shed, from the api's /metrics: its shedder / auth (`?` where a scrape did not answer)."""
    return "/".join("?" if row[k] is None else str(row[k]) for k in ("api_shed", "auth_shed"))


def limits(row: dict[str, Any]) -> str:
    """The api's concurrency limit's range over a step."""
    if row["limit_min"] is None:
        return "-"
    return f"{row['limit_min']:.0f}-{row['limit_max']:.0f}"


def busy(row: dict[str, Any]) -> str:
    """The cores the api, auth and wrk used over a step (the machine has os.cpu_count() of them)."""
    return "/".join(f"{row['cores'][n]:.2f}" for n in (*SOAK_SERVICES, "wrk"))


def probed(probe: dict[str, Any]) -> str:
    """The probe's admitted reads' p99 / its shed answers' p99 from sending, ms."""
    return f"{probe['admitted_p99_ms'] or '-'}/{probe['shed_sent_p99_ms'] or '-'}"


def inside(row: dict[str, Any]) -> str:
    return f"{row.get('api_loop_lag_p50_ms') or '-'}/{row.get('api_loop_lag_p99_ms') or '-'}"


def refusals(row: dict[str, Any]) -> str:
    return f"{row.get('refusal_p99_ms') or '-'} ({row.get('refused_after_queueing', '-')})"


def report(result: dict[str, Any]) -> None:
    print(f"capacity {result['capacity_per_s']}/s of the mix ({result['calibrated_on']}'s stack, closed loop); "
          f"each kind alone {result['kind_capacities']}/s; steps of {result['seconds']} s after "
          f"{result['warm_seconds']:g} s of warm-up")
    head = (f"{'policy':>8} {'x':>3} {'offered':>8} {'goodput':>8} {'gp/1x':>6} {'/core/1x':>8} {'p50 ms':>8} "
            f"{'p99 ms':>8} "
            f"{'p99/1x':>7} {'work':>6} {'w/1x':>6} {'shed':>7} {'shed p99':>9} {'(sent)':>7} "
            f"{'api/auth':>11} {'limit':>9} {'internal':>9} "
            f"{'errors':>7} {'cores api/auth/wrk':>18} {'probe p99 2xx/shed':>18} {'api lag p50/p99':>15} "
            f"{'refusal p99 (queued)':>20}")
    print(head)
    for p in result["policies"]:
        for s in p["steps"]:
            internal = "-" if s["internal_ok"] is None else f"{s['internal_ok']:.2%}"
            print(f"{p['policy']:>8} {s['multiple']:>3g} {s['offered_per_s']:>8.0f} {s['goodput_per_s']:>8.0f} "
                  f"{s['goodput_ratio'] or '-':>6} {s.get('per_core_ratio') or '-':>8} "
                  f"{s['admitted_p50_ms'] or '-':>8} {s['admitted_p99_ms'] or '-':>8} "
                  f"{s['p99_ratio'] or '-':>7} {s['work'] or '-':>6} {s['work_ratio'] or '-':>6} {s['shed']:>7} "
                  f"{s['shed_p99_ms'] or '-':>9} "
                  f"{s['shed_sent_p99_ms'] or '-':>7} {who(s):>11} "
                  f"{limits(s):>9} {internal:>9} {s['n_errors']:>7} {busy(s):>18} {probed(s['probe']):>18} "
                  f"{inside(s):>15} {refusals(s):>20}")
    print("/core/1x: goodput per core the api used, over 1x's (what refusing costs the api itself); "
          "work: the sum over kinds of 2xx/s over that kind's capacity alone (w/1x: over 1x's); "
          "shed: 503 `overloaded` answers wrk saw (p99 from their scheduled time; (sent): from their sending); "
          "api/auth: of those, the api's "
          "shedder's and auth's (the api's /metrics); limit: the api's concurrency limit over the step; cores: "
          f"CPU used (of {os.cpu_count()}); probe: {PROBE_RATE:g} reads/s from a wrk at nice {PROBE_NICE} beside "
          "the load, p99 ms of its 2xx (from schedule) / of its shed answers (from sending); api lag: its event "
          "loop's lag, ms (the wait before the shedder runs); refusal: the api's own p99 from the shedder's first "
          "look to the 503 written, ms (in brackets: how many waited in its queue first); both the upper bounds of "
          "their histogram buckets")
    print(f"targets at the top multiple: goodput/1x >= {GOODPUT_RATIO_MIN}, p99/1x <= {P99_RATIO_MAX}, shed p99 <= "
          f"{SHED_P99_MAX_MS} ms, internal 2xx >= {INTERNAL_OK_MIN:.1%}; errors: other statuses, lost answers, "
          f"requests not sent within {LATE_SECONDS:g} s of their time (unsent)")
    for p in result["policies"]:
        errors = {k: v for k, v in p["steps"][-1]["errors"].items()}
        print(f"{p['policy']:>8}: {result['checks'][p['policy']]}; top step's errors {errors or 0}")
    for p in result["policies"]:
        if "soak" not in p:
            continue
        s = p["soak"]
        print(f"soak ({s['policy']}): {s['offered_per_s']:.0f}/s for {s['minutes']:g} min "
              f"({s['connections']} connections); shed by api/auth {who(s)}, api's limit {limits(s)}, cores "
              f"api/auth/wrk {busy(s)}")
        print(f"{'min':>4} {'goodput':>8} {'p50 ms':>8} {'p99 ms':>8} {'shed':>7} {'internal':>9} {'errors':>7}")
        for m in s["per_minute"]:
            internal = "-" if m["internal_ok"] is None else f"{m['internal_ok']:.2%}"
            print(f"{m['minute']:>4} {m['goodput_per_s']:>8.0f} {m['admitted_p50_ms'] or '-':>8} "
                  f"{m['admitted_p99_ms'] or '-':>8} {m['shed']:>7} {internal:>9} {m['n_errors']:>7}")
        print("memory MB (start -> end, growth): " + ", ".join(
            f"{n} {s['memory_start_mb'][n]} -> {s['memory_end_mb'].get(n)} ({s['memory_growth'].get(n, 0):+.1%})"
            for n in s["memory_start_mb"]))
        print(f"minutes with admitted p50 over {SOAK_P50_MAX_MS:g} ms: {s['minutes_p50_over'] or 'none'}; "
              f"restarted: {s['restarted'] or 'none'}; after draining: {s['after_drain']} "
              f"({'drained' if s['drained'] else 'NOT drained'})")


async def overloaded(args: argparse.Namespace) -> dict[str, Any]:
    capacity: float | None = args.capacity or None
    calibrated_on = "--capacity" if capacity else args.policies[0]
    runs = []
    kinds: dict[str, float] = args.kind_capacities
    with tempfile.TemporaryDirectory(prefix="weir-overload-") as tmp:
        for policy in args.policies:
            capacity, kinds, run = await policy_run(policy, capacity, kinds, args, Path(tmp))
            runs.append(run)
    return {"capacity_per_s": round(capacity or 0, 1), "calibrated_on": calibrated_on, "kind_capacities": kinds,
            "seconds": args.seconds,
            "warm_seconds": args.warm_seconds, "late_seconds": LATE_SECONDS, "mix": MIX, "policies": runs,
            "checks": checks(runs)}


def unloaded_policies(policies: list[str]) -> list[str]:
    """--unloaded's apis: `off` first (the base of the ratios), then the others asked for."""
    return ["off", *(p for p in policies if p != "off")]


def unloaded(args: argparse.Namespace) -> dict[str, Any]:
    """Shedding's cost when nothing is shed: the guarded GET on apis with each policy (one auth, shedding on as
    deployed), mirrored rounds; then auth.check's decisions/s with auth's shedding on and off."""
    split = cores(True)
    api_cpus = None
    if split is not None:
        api_cpus, others = split
        os.sched_setaffinity(0, others)  # inherited by the servers, auth and wrk started from here
    with servers() as settings:
        asyncio.run(prepare(settings))
        env = service_env(settings)
        procs = []
        try:
            auth, _ = start("services.auth", env)
            procs.append(auth)
            paths = []
            for policy in unloaded_policies(args.policies):
                api, url = start("services.api", {**env, **policy_env(policy)}, api_cpus)
                procs.append(api)
                paths.append((policy, url, {"edge": api.pid, "auth": auth.pid}))
            _, app = asyncio.run(provision(settings))
            headers = {"Authorization": f"Bearer {app.secret_key}"}
            video = asyncio.run(new_video(paths[0][1], app.secret_key))
            route = f"/v1/videos/{video}"
            for _ in range(2):  # warm each, then measure each in turn
                for _, url, _ in paths:
                    wrk_closed(f"{url}{route}", headers, WARM_SECONDS, UNLOADED_CONNECTIONS)
            rounds: list[dict[str, dict[str, Any]]] = []
            for i in range(args.rounds):
                rounds.append(mirrored_round(paths, i, route, headers, args.seconds, UNLOADED_CONNECTIONS))
                print(f"round {i + 1}: " + "; ".join(f"{p} {r['per_s']:.0f}/s p99 {r['p99_ms']:.1f} ms"
                                                     for p, r in rounds[-1].items()), file=sys.stderr, flush=True)
        finally:
            auth_bench.stop(procs)
        api_rows = {}
        measured = 2 * max(1, round(args.seconds / 2))  # mirrored_round's two runs of a path, one mirror
        for policy in unloaded_policies(args.policies)[1:]:
            # 2xx/s: a policy that sheds the closed loop's 32 connections answers its refusals fast
            per_s = [(r[policy]["per_s"] - r[policy]["non_2xx"] / measured) / r["off"]["per_s"] for r in rounds]
            p99 = [r[policy]["p99_ms"] / r["off"]["p99_ms"] for r in rounds]
            cpu = [r[policy]["cpu_us_edge"] / r["off"]["cpu_us_edge"] for r in rounds]
            api_rows[policy] = {"throughput_ratio": round(statistics.median(per_s), 3),
                                "non_2xx": sum(r[policy]["non_2xx"] for r in rounds),
                                "p99_ratio": round(statistics.median(p99), 3),
                                "cpu_ratio": round(statistics.median(cpu), 3),
                                "rounds": [(round(a, 3), round(b, 3), round(c, 3))
                                           for a, b, c in zip(per_s, p99, cpu, strict=True)]}
        with tempfile.TemporaryDirectory(prefix="weir-overload-auth-") as workdir:
            auth_runs = auth_rounds(settings, env, args.rounds, Path(workdir))
    on = [r["on"]["per_s"] / r["off"]["per_s"] for r in auth_runs]
    return {"rounds": args.rounds, "seconds": args.seconds, "api_rounds": rounds, "api": api_rows,
            "auth_rounds": auth_runs, "auth": {"throughput_ratio": round(statistics.median(on), 3),
                                               "rounds": [round(x, 3) for x in on]}}


def auth_rounds(settings: CommonSettings, env: dict[str, str], rounds: int, workdir: Path) -> list[dict[str, Any]]:
    """auth.check closed loops (bench/auth.py's), one auth at a time with shedding on (gradient) and off,
    alternating which goes first."""
    keys: list[str] = []
    out: list[dict[str, Any]] = []
    for i in range(rounds):
        row: dict[str, Any] = {}
        for name, policy in (("off", "off"), ("on", "gradient"))[:: 1 if i % 2 == 0 else -1]:
            procs = auth_bench.start_auth(settings, 1, {**env, "WEIR_SHED_POLICY": policy})
            try:
                if not keys:
                    keys = asyncio.run(auth_bench.provision(settings, AUTH_KEYS))
                chosen = [keys[j % len(keys)] for j in range(auth_bench.PAYLOADS)]
                peers = [f"10.0.{j // 250}.{j % 250 + 1}" for j in range(auth_bench.PAYLOADS)]
                check = auth_bench.Load(settings, CHECK_SUBJECT, auth_bench.check_payloads(chosen, peers), workdir)
                check.closed(auth_bench.PAYLOADS, AUTH_CONCURRENCY)  # warm-up: every distinct request once
                row[name] = check.closed(AUTH_REQUESTS, AUTH_CONCURRENCY)
            finally:
                auth_bench.stop(procs)
        print(f"auth round {i + 1}: off {row['off']['per_s']:.0f}/s, on {row['on']['per_s']:.0f}/s", file=sys.stderr,
              flush=True)
        out.append(row)
    return out


def report_unloaded(r: dict[str, Any]) -> None:
    print(f"unloaded: guarded GET, wrk {UNLOADED_CONNECTIONS} connections, {r['rounds']} mirrored rounds of "
          f"{r['seconds']} s; medians of the rounds' ratios over shed_policy=off (cost allowed < "
          f"{UNLOADED_COST_MAX:.0%})")
    for policy, row in r["api"].items():
        print(f"  api {policy:>8} / off: 2xx/s {row['throughput_ratio']:.3f}, p99 {row['p99_ratio']:.3f}, api CPU per "
              f"request {row['cpu_ratio']:.3f} (rounds' 2xx/s, p99, CPU: {row['rounds']}); non-2xx (shed) "
              f"{row['non_2xx']}, off's "
              f"{sum(x['off']['non_2xx'] for x in r['api_rounds'])}")
    print(f"  auth.check decisions/s, shedding on / off: {r['auth']['throughput_ratio']:.3f} "
          f"(rounds {r['auth']['rounds']})")


def policy_env(name: str) -> dict[str, str]:
    """The services' settings for --policies' NAME (a policy, or a policy and a variant)."""
    base, variant = split_policy(name)
    return {"WEIR_SHED_POLICY": base, **VARIANTS.get(variant, {})}


def edged(name: str) -> tuple[str, bool]:
    """--policies' NAME without its EDGE suffix, and whether it had one."""
    return (name.removesuffix(EDGE), True) if name.endswith(EDGE) else (name, False)


def split_policy(name: str) -> tuple[str, str]:
    """--policies' NAME as (policy, variant suffix or ""), an EDGE suffix left out."""
    name = edged(name)[0]
    for suffix in VARIANTS:
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return name, ""


def kind_capacities(value: str) -> dict[str, float]:
    """--kind-capacities' KIND=PER_S,... (every public kind)."""
    out = {kind: float(n) for kind, _, n in (pair.partition("=") for pair in value.split(",") if pair)}
    if set(out) != set(PUBLIC):
        raise argparse.ArgumentTypeError(f"give each of {', '.join(PUBLIC)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=at_least(1), default=STEP_SECONDS,
                        help="each step's counted seconds (with --unloaded: each path's seconds per round)")
    parser.add_argument("--warm-seconds", type=float, default=WARM_SECONDS,
                        help="each step's warm-up at its rate, not counted")
    parser.add_argument("--multiples", type=lambda v: [float(x) for x in v.split(",") if x], default=list(MULTIPLES),
                        help="offered load as multiples of the capacity (the first is the base of the ratios)")
    parser.add_argument("--policies", type=lambda v: [p for p in v.split(",") if p], default=list(POLICIES),
                        help="shed policies, each on a stack of its own; the first one's stack is calibrated; "
                             "POLICY-nosteps, POLICY-steps, POLICY-flat: that policy with its priorities changed "
                             "(VARIANTS); any of them "
                             "-edge: with HAProxy in front of the api (needs `haproxy`: apt-get install haproxy)")
    parser.add_argument("--capacity", type=float, default=0.0, help="the mix's capacity (default: calibrate)")
    parser.add_argument("--kind-capacities", type=kind_capacities, default={},
                        help="each public kind's capacity alone, e.g. read=1970,list=720,create=284 (default: "
                             "calibrated with the capacity, on an `off` stack)")
    parser.add_argument("--calibrate-seconds", type=at_least(1), default=8)
    parser.add_argument("--soak-minutes", type=float, default=SOAK_MINUTES,
                        help=f"the soak at {SOAK_MULTIPLE}x the capacity (0: none)")
    parser.add_argument("--soak-policy", default="gradient",
                        help="the policy (or variant, as in --policies) of the stack that soaks")
    parser.add_argument("--unloaded", action="store_true",
                        help="instead: what shedding costs the unloaded path (apis and auth, policies vs off)")
    parser.add_argument("--rounds", type=at_least(1), default=UNLOADED_ROUNDS, help="--unloaded's rounds")
    parser.add_argument("--own-core", action="store_true",
                        help="the api on a core of its own, the rest of the stack and wrk on the others (as deployed "
                             "on a machine of its own: the load generator and auth do not take the api's CPU)")
    parser.add_argument("--edge-maxconn", type=at_least(2), default=EdgeSettings().edge_maxconn,
                        help="POLICY-edge: requests at once to the api")
    parser.add_argument("--edge-queue-ms", type=at_least(1), default=EdgeSettings().edge_queue_ms,
                        help="POLICY-edge: how long a request waits for a slot before HAProxy answers 503")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench.overload needs wrk (apt-get install wrk)")
    if any(edged(p)[1] for p in args.policies) and shutil.which("haproxy") is None:
        sys.exit("bench.overload's POLICY-edge needs haproxy (apt-get install haproxy)")
    if unknown := {split_policy(p)[0] for p in (*args.policies, args.soak_policy)} - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}: choose from {', '.join(POLICIES)}")
    if args.unloaded and any(edged(p)[1] for p in args.policies):
        parser.error("--unloaded measures the api's own shedding: no POLICY-edge")
    began = time.monotonic()
    if args.unloaded:
        result = unloaded(args)
        report_unloaded(result)
    else:
        result = asyncio.run(overloaded(args))
        report(result)
    result["run_seconds"] = round(time.monotonic() - began)
    kind = "overload-unloaded" if args.unloaded else "overload"
    out = args.out or Path(__file__).with_name("out") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"ran {result['run_seconds']} s; written to {out}")


if __name__ == "__main__":
    main()
