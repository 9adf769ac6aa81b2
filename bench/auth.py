"""auth.check decisions per second and latency, 1 and 3 instances, beside a bare NATS echo in the same run.

Each auth instance is its own process (`python -m services.auth`), as deployed. The load is accepted secret keys:
three rules per decision (the key and the owner counters incremented, the address's auth_failure counter read).
  closed loop: C requests in flight for N requests: throughput, p50, p99;
  half load:   an open loop at half the one-instance throughput: p50 and p99 when not saturated;
  baseline:    a bare request/reply echo service on the same NATS server, same client, same loops.

python -m bench.auth [--requests N] [--concurrency C] [--keys K] [--rates 500,1000,2000]
(embedded servers; or WEIR_BENCH_EXTERNAL=1 with the WEIR_* addresses)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import nats
import uvloop
from nats.aio.client import Client as NATS

from bench.bus import servers
from shared.authcheck import CHECK_SUBJECT, AccountCreated, AppCreated, CheckRequest, CreateAccount, CreateApp
from shared.authclient import manage
from shared.settings import CommonSettings
from weir.up import prepare

ECHO_SUBJECT = "bench.echo"
PAYLOADS = 4096  # distinct (key, address) pairs the load cycles through
ECHO_SERVICE = """
import asyncio, sys, nats, uvloop
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await msg.respond(msg.data)
    await nc.subscribe(sys.argv[2], queue="echo", cb=echo)
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""
Row = dict[str, Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_auth(settings: CommonSettings, n: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    procs = []
    for _ in range(n):
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.auth"],
            env={**os.environ, **env, "WEIR_HTTP_PORT": str(port)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("auth did not become ready")
            time.sleep(0.1)
        procs.append(proc)
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(30)


def stats(name: str, latencies: list[float], seconds: float, extra: Row | None = None) -> Row:
    lat = sorted(latencies)
    return {
        "path": name,
        "requests": len(lat),
        "per_s": round(len(lat) / seconds, 1),
        "p50_ms": round(statistics.median(lat) * 1000, 3),
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
        **(extra or {}),
    }


async def closed_loop(
    call: Callable[[int], Awaitable[bool]], n: int, concurrency: int
) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    allowed = 0
    next_i = 0

    async def worker() -> None:
        nonlocal next_i, allowed
        while next_i < n:
            i = next_i
            next_i += 1
            t0 = time.perf_counter()
            ok = await call(i)  # not `allowed += await ...`: that reads `allowed` before the await
            allowed += ok
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0, allowed


async def open_loop(call: Callable[[int], Awaitable[bool]], n: int, rate: float) -> tuple[list[float], float]:
    """Requests sent on a schedule (`rate` per second), whatever the answers do: latency when not saturated.

    The generator itself must not add latency: every 1 ms tick it sends what is due, keeps no finished task, and
    the client's garbage collector is paused for the run (it is the measuring instrument, not the system measured).
    """
    latencies: list[float] = []
    done = asyncio.Event()
    outstanding = 0
    running: set[asyncio.Future[None]] = set()

    async def one(i: int) -> None:
        nonlocal outstanding
        s = time.perf_counter()
        try:
            await call(i)
        finally:
            latencies.append(time.perf_counter() - s)
            outstanding -= 1
            if outstanding == 0 and sent == n:
                done.set()

    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            due = min(n, int((time.perf_counter() - t0) * rate) + 1)
            while sent < due:
                outstanding += 1
                sent += 1
                task = asyncio.ensure_future(one(sent - 1))
                running.add(task)  # held while it runs (the loop keeps only weak references), then dropped
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.001)
        if outstanding:
            await done.wait()
        return latencies, time.perf_counter() - t0
    finally:
        gc.enable()


def checker(nc: NATS, keys: list[str], peers: list[str]) -> Callable[[int], Awaitable[bool]]:
    payloads = [
        CheckRequest(authorization=f"Bearer {k}", peer=p, route_class="secret", route="GET /v1/videos/{id}")
        .model_dump_json().encode()
        for k, p in zip(keys, peers, strict=True)
    ]
    refused: list[str] = []

    async def call(i: int) -> bool:
        msg = await nc.request(CHECK_SUBJECT, payloads[i % len(payloads)], timeout=10)
        allowed = b'"allowed":true' in msg.data
        if not allowed and not refused:
            refused.append(msg.data.decode())
            print("refused:", refused[0][:400], file=sys.stderr)
        return allowed

    return call


def echoer(nc: NATS, size: int) -> Callable[[int], Awaitable[bool]]:
    payload = b"x" * size

    async def call(i: int) -> bool:
        await nc.request(ECHO_SUBJECT, payload, timeout=10)
        return True

    return call


async def provision(settings: CommonSettings, keys: int) -> list[str]:
    nc = await nats.connect(settings.nats_url)
    try:
        out = []
        account = await manage(nc, "account.create", CreateAccount(name="bench"), AccountCreated)
        for i in range(keys):
            app = await manage(nc, "app.create", CreateApp(user_id=account.user_id, account_id=account.account_id,
                                                            name=f"bench-{i}"), AppCreated)
            out.append(app.secret_key)
        return out
    finally:
        await nc.close()


async def measure(settings: CommonSettings, call_of: Callable[[NATS], Callable[[int], Awaitable[bool]]],
                  n: int, concurrency: int, half_rate: float | None) -> tuple[Row, Row | None, int]:
    nc = await nats.connect(settings.nats_url)
    try:
        call = call_of(nc)
        # warm-up: every distinct request once (the load cycles through PAYLOADS of them), so that what follows is
        # the steady state; the warm-up's own figures are the cold path (each credential and address seen first)
        wl, ws, _ = await closed_loop(call, min(PAYLOADS, n), concurrency)
        lat, secs, allowed = await closed_loop(call, n, concurrency)
        closed = stats("", lat, secs, {"cold": stats("", wl, ws)})
        half = None
        if half_rate:
            hl, hs = await open_loop(call, max(1000, int(half_rate * 3)), half_rate)
            half = stats("", hl, hs, {"offered_per_s": round(half_rate, 1)})
        return closed, half, allowed
    finally:
        await nc.close()


async def run(settings: CommonSettings, args: argparse.Namespace, env: dict[str, str]) -> list[Row]:
    rows: list[Row] = []
    echo = subprocess.Popen(  # noqa: ASYNC220 - started once, before any measurement
        [sys.executable, "-c", ECHO_SERVICE, settings.nats_url, ECHO_SUBJECT], stdout=subprocess.PIPE
    )
    assert echo.stdout is not None
    echo.stdout.readline()
    sample = CheckRequest(authorization="Bearer wsk_" + "x" * 32, peer="10.0.0.1", route_class="secret",
                          route="GET /v1/videos/{id}").model_dump_json()
    try:
        base, _, _ = await measure(settings, lambda nc: echoer(nc, len(sample)), args.requests,
                                           args.concurrency, None)
        rows.append({**base, "path": "baseline: NATS request/reply echo (1 process)"})
        single, _, _ = await measure(settings, lambda nc: echoer(nc, len(sample)), 2000, 1, None)
        rows.append({**single, "path": "baseline: echo, one request at a time"})
        keys: list[str] = []
        variants = [(1, "", {}), (1, ", leases off", {"WEIR_COUNTER_LEASE_MAX": "1"}), (3, "", {})]
        for instances, label, extra in variants:
            print(f"auth.check: {instances} instance(s){label}", file=sys.stderr, flush=True)
            procs = start_auth(settings, instances, {**env, **extra})
            try:
                if not keys:
                    keys = await provision(settings, args.keys)
                rnd = random.Random(7)
                chosen = [rnd.choice(keys) for _ in range(PAYLOADS)]
                peers = [f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(1, 255)}" for _ in chosen]
                call = functools.partial(checker, keys=chosen, peers=peers)
                closed, _, allowed = await measure(settings, call, args.requests, args.concurrency, None)
                assert allowed == args.requests, f"only {allowed} of {args.requests} allowed: limits interfered"
                cold = closed.pop("cold")
                rows.append({**closed,
                             "path": f"auth.check, {instances} instance(s){label}, {args.keys} keys, 3 rules"})
                if instances == 1 and not label:
                    rows.append({**cold, "path": f"auth.check, 1 instance, cold: {PAYLOADS} first sights"})
                if instances == 1 and not label:
                    one, _, _ = await measure(settings, call, 2000, 1, None)
                    rows.append({**one, "path": "auth.check, 1 instance, one request at a time"})
                    # latency when not saturated: an open loop at half the throughput, and the echo at that rate
                    rate = closed["per_s"] / 2
                    _, half, _ = await measure(settings, call, 2000, 1, rate)
                    _, echo_half, _ = await measure(settings, lambda nc: echoer(nc, len(sample)), 2000, 1, rate)
                    assert half is not None and echo_half is not None
                    rows.append({**echo_half, "path": "baseline: echo at the same offered rate (open loop)"})
                    rows.append({**half, "path": "auth.check, 1 instance, at half load (open loop)"})
                    # the same at fixed offered rates, echo and auth alike: where the machine's own floor lies
                    for fixed in args.rates:
                        for name, of in (("echo", lambda nc: echoer(nc, len(sample))), ("auth.check", call)):
                            _, at, _ = await measure(settings, of, 2000, 1, float(fixed))
                            assert at is not None
                            rows.append({**at, "path": f"{name} at {fixed}/s (open loop)"})
            finally:
                stop(procs)
    finally:
        echo.terminate()
        echo.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--rates", type=lambda v: [int(r) for r in v.split(",") if r], default=[],
                        help="also measure latency at these offered rates, e.g. 500,1000,2000")
    args = parser.parse_args()
    with servers() as settings:
        env = {
            "WEIR_NATS_URL": settings.nats_url, "WEIR_DATABASE_URL": settings.database_url,
            "WEIR_S3_ENDPOINT": settings.s3_endpoint, "WEIR_S3_ACCESS_KEY": settings.s3_access_key,
            "WEIR_S3_SECRET_KEY": settings.s3_secret_key.get_secret_value(),
            "WEIR_KEY_HASH_SECRET": secrets.token_urlsafe(32), "WEIR_UPLOAD_TOKEN_SECRET": secrets.token_urlsafe(32),
            "WEIR_INTERNAL_TOKEN": secrets.token_urlsafe(32),
            "WEIR_LIMIT_KEY_PER_MINUTE": str(10**9), "WEIR_LIMIT_OWNER_PER_MINUTE": str(10**9),
            "WEIR_LOG_LEVEL": "WARNING",
        }
        asyncio.run(prepare(settings))
        rows = uvloop.run(run(settings, args, env))  # the client on the services' loop: less of its own latency
    print(f"{'path':62} {'req':>7} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['path']:62} {r['requests']:>7} {r['per_s']:>9} {r['p50_ms']:>8} {r['p99_ms']:>8}")
    base = rows[0]["per_s"]
    for r in rows[1:]:
        if "auth.check" in r["path"] and "(open loop)" not in r["path"] and "one request" not in r["path"]:
            print(f"{r['path']}: {r['per_s'] / base:.2f} of the echo baseline's throughput")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
