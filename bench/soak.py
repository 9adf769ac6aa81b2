"""A soak: mixed traffic against a whole `weir up` stack for minutes, at half of what the stack takes.

    python -m bench.soak [--minutes 10] [--rate R] [--calibrate-seconds 8] [--out FILE]

1. `weir up` in a temp data dir (every service a supervised process, as a person runs it), its limits high enough
   that only overload or faults refuse, and 127.0.0.1 trusted as a proxy so that bad credentials come "from" a few
   addresses of their own (their 401s and the address blocks they earn are expected answers).
2. Calibration: the guarded `GET /v1/videos/{id}` in a closed loop for a few seconds; the soak offers half of that
   throughput (`--rate` overrides), as bench.api's figure would say.
3. The soak, in an open loop (requests sent on schedule, whether or not earlier ones returned): reads of one video,
   lists, creates, small uploads that encode (create, initiate, part URL, PUT, complete), and bad credentials. Per
   minute: p50 and p99 of each kind and the errors by kind. An error is *unexpected* unless it is a bad
   credential's 401/429; unexpected errors must be 0.
4. Each service's memory (RSS from /proc) at the start (after calibration) and at the end: growth at most 10 %.
5. After the traffic stops: drained (outbox backlog, consumers' pending and DLQ counts from `weir status --json`,
   all 0 within a bound).
Prints a table and one JSON object (also written to --out, default bench/out/soak-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.api import at_least, tiny_mp4
from weir.up import free_port

KINDS = ("read", "list", "create", "upload", "bad_credential")
# shares of the offered rate; uploads are few (each one is also an encode on 2 cores)
MIX = {"read": 0.6, "list": 0.15, "create": 0.1, "upload": 0.01, "bad_credential": 0.14}
BAD_ADDRESSES = [f"198.51.100.{i}" for i in range(1, 5)]
MAX_IN_FLIGHT = 512  # past this the stack is overloaded: a request not sent on time counts as an error
MEMORY_GROWTH_MAX = 0.10
DRAIN_SECONDS = 120


@dataclass
class Minute:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    expected: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 2)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def start_stack(data_dir: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WEIR_TRUSTED_PROXIES": "127.0.0.1/32",
           "WEIR_LIMIT_KEY_PER_MINUTE": str(10**9), "WEIR_LIMIT_OWNER_PER_MINUTE": str(10**9),
           "WEIR_LIMIT_UPLOAD_TOKEN_PER_MINUTE": str(10**9), "WEIR_LOG_LEVEL": "WARNING"}
    log = (data_dir.parent / "weir-up.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "weir.cli", "up", "--data-dir", str(data_dir),
                             "--api-port", str(free_port())], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stack_json = data_dir / "stack.json"
    deadline = time.monotonic() + 180
    while not stack_json.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"weir up did not start: see {log.name}")
        time.sleep(0.2)
    return proc, json.loads(stack_json.read_text())


class Traffic:
    def __init__(self, api: str, key: str, video_id: str, clip: bytes) -> None:
        self.api, self.key, self.video_id, self.clip = api, key, video_id, clip
        self.auth = {"Authorization": f"Bearer {key}"}
        self.http = httpx.AsyncClient(base_url=api, timeout=30, limits=httpx.Limits(max_connections=256))
        self.in_flight = 0

    async def close(self) -> None:
        await self.http.aclose()

    async def one(self, kind: str, minute: Minute) -> None:
        t0 = time.perf_counter()
        try:
            status = await getattr(self, kind)()
        except httpx.HTTPError as exc:
            minute.errors[kind][type(exc).__name__] += 1
            return
        finally:
            self.in_flight -= 1
        if kind == "bad_credential" and status in (401, 429):
            minute.expected[kind] += 1
        elif not 200 <= status < 300:
            minute.errors[kind][str(status)] += 1
            return
        minute.latencies[kind].append(time.perf_counter() - t0)

    async def read(self) -> int:
        return (await self.http.get(f"/v1/videos/{self.video_id}", headers=self.auth)).status_code

    async def list(self) -> int:
        return (await self.http.get("/v1/videos?limit=20", headers=self.auth)).status_code

    async def create(self) -> int:
        return (await self.http.post("/v1/videos", json={"name": "soak"}, headers=self.auth)).status_code

    async def upload(self) -> int:
        r = await self.http.post("/v1/videos", json={"name": "soak upload"}, headers=self.auth)
        if r.status_code != 201:
            return r.status_code
        path = f"/v1/videos/{r.json()['id']}/upload"
        r = await self.http.post(path, json={"content_type": "video/mp4"}, headers=self.auth)
        if r.status_code != 200:
            return r.status_code
        r = await self.http.post(f"{path}/parts", json={"part_numbers": [1]}, headers=self.auth)
        if r.status_code != 200:
            return r.status_code
        put = await self.http.put(r.json()["parts"][0]["url"], content=self.clip)
        if put.status_code != 200:
            return 600 + put.status_code // 100  # storage's answer, told apart from the api's
        done = await self.http.post(f"{path}/complete", headers=self.auth,
                                    json={"parts": [{"part_number": 1, "etag": put.headers["etag"]}]})
        return done.status_code

    async def bad_credential(self) -> int:
        headers = {"Authorization": "Bearer wsk_" + "0" * 32, "X-Forwarded-For": random.choice(BAD_ADDRESSES)}
        return (await self.http.get("/v1/videos", headers=headers)).status_code


async def calibrate(traffic: Traffic, seconds: float, concurrency: int = 32) -> float:
    done = 0
    deadline = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            if await traffic.read() == 200:
                done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


async def soak(traffic: Traffic, rate: float, minutes: float) -> list[Minute]:
    kinds, weights = list(MIX), list(MIX.values())
    rnd = random.Random(11)
    out: list[Minute] = []
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    end = start + minutes * 60
    n = 0
    while True:
        due = start + n / rate
        now = time.monotonic()
        if due >= end:
            break
        if due > now:
            await asyncio.sleep(due - now)
        index = int((due - start) // 60)
        while len(out) <= index:
            out.append(Minute())
        minute = out[index]
        kind = rnd.choices(kinds, weights)[0]
        n += 1
        if traffic.in_flight >= MAX_IN_FLIGHT:
            minute.errors[kind]["not_sent_overloaded"] += 1
            continue
        traffic.in_flight += 1
        task = asyncio.create_task(traffic.one(kind, minute))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=60)
    return out


def status(data_dir: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--json", "--stack", str(data_dir / "stack.json")],
                       capture_output=True, text=True, timeout=60)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def drained(doc: dict[str, Any]) -> dict[str, Any]:
    outbox = {k: v for k, v in (doc.get("outbox") or {}).items() if v}
    pending = {f"{c['stream']}/{c['name']}": c["pending"] for c in doc.get("consumers") or [] if c.get("pending")}
    dlq = {k: v for k, v in (doc.get("dlq") or {}).items() if v}
    return {"outbox_unsent": outbox, "consumers_pending": pending, "dlq": dlq}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s offered (default: half the calibration)")
    parser.add_argument("--calibrate-seconds", type=at_least(1), default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weir-soak-") as tmp:
        data_dir = Path(tmp) / "weir"
        proc, info = start_stack(data_dir)
        try:
            result = asyncio.run(run(args, info, data_dir))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    report(result)
    out = args.out or Path(__file__).with_name("out") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(f"written to {out}")


async def run(args: argparse.Namespace, info: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    api, key = info["api_url"], info["demo"]["secret_key"]
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        video = (await http.post("/v1/videos", json={"name": "soak target"},
                                 headers={"Authorization": f"Bearer {key}"})).json()
    traffic = Traffic(api, key, video["id"], tiny_mp4())
    try:
        capacity = await calibrate(traffic, args.calibrate_seconds)
        rate = args.rate or capacity / 2
        pids = {name: int(pid) for name, pid in info["pids"].items() if name != "weir"}
        memory_start = {name: rss_mb(pid) for name, pid in pids.items()}
        print(f"calibration: {capacity:.0f} reads/s; offering {rate:.0f} requests/s for {args.minutes:g} min",
              file=sys.stderr, flush=True)
        minutes = await soak(traffic, rate, args.minutes)
    finally:
        await traffic.close()
    pids_end = {name: int(pid) for name, pid in json.loads((data_dir / "stack.json").read_text())["pids"].items()
                if name != "weir"}
    memory_end = {name: rss_mb(pid) for name, pid in pids_end.items()}
    deadline = time.monotonic() + DRAIN_SECONDS
    while True:
        left = drained(status(data_dir))
        if not any(left.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    per_minute: list[dict[str, Any]] = []
    for i, m in enumerate(minutes):
        per_minute.append({"minute": i + 1, **{k: {"n": len(m.latencies[k]), "p50_ms": pct(m.latencies[k], 0.5),
                                                   "p99_ms": pct(m.latencies[k], 0.99)} for k in KINDS},
                           "errors": {k: dict(v) for k, v in m.errors.items() if v},
                           "expected_refusals": dict(m.expected)})
    unexpected = sum(n for m in minutes for by in m.errors.values() for n in by.values())
    growth = {name: round(end / start - 1, 3) for name, start in memory_start.items()
              if start and (end := memory_end.get(name))}
    restarted = sorted(name for name in pids if pids_end.get(name) != pids[name])
    return {"rate_per_s": round(rate, 1), "calibration_reads_per_s": round(capacity, 1), "minutes": args.minutes,
            "per_minute": per_minute, "unexpected_errors": unexpected, "memory_start_mb": memory_start,
            "memory_end_mb": memory_end, "memory_growth": growth,
            "memory_growth_ok": all(g <= MEMORY_GROWTH_MAX for g in growth.values()),
            "services_restarted": restarted, "after_drain": left, "drained": not any(left.values()),
            "p99_ms_median_over_minutes": {k: statistics.median([p for m in per_minute
                                                                  if (p := m[k]["p99_ms"]) is not None] or [0])
                                           for k in KINDS}}


def report(r: dict[str, Any]) -> None:
    print(f"offered {r['rate_per_s']}/s (calibration {r['calibration_reads_per_s']} reads/s) for {r['minutes']} min")
    print(f"{'min':>4} " + " ".join(f"{k + ' p50/p99 ms':>26}" for k in KINDS) + "  errors")
    for m in r["per_minute"]:
        cells = " ".join(f"{str(m[k]['p50_ms']) + ' / ' + str(m[k]['p99_ms']):>26}" for k in KINDS)
        print(f"{m['minute']:>4} {cells}  {m['errors'] or 0}")
    print(f"unexpected errors: {r['unexpected_errors']}; services restarted: {r['services_restarted'] or 'none'}")
    print("memory MB (start -> end, growth): " + ", ".join(
        f"{n} {r['memory_start_mb'][n]} -> {r['memory_end_mb'].get(n)} ({r['memory_growth'].get(n, 0):+.1%})"
        for n in r["memory_start_mb"]))
    print(f"after draining: {r['after_drain']} ({'drained' if r['drained'] else 'NOT drained'})")


if __name__ == "__main__":
    main()
