"""A soak: mixed traffic against a whole `weir up` stack for minutes, at half of what the stack takes.

    python -m bench.soak [--minutes 10] [--rate R] [--calibrate-seconds 8] [--out FILE]   (needs wrk)

It calibrates by bench.api's method, then offers half of the mix's figure in an open loop: reads, lists, creates and
bad credentials from one wrk (bench/soak.lua), uploads that encode from Python. Per minute: each kind's p50, p99,
rate achieved and errors (unexpected ones must be 0); each service's memory growth (<= 10 %); then the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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

from bench.api import WARM_SECONDS, at_least, tiny_mp4, wrk
from shared.contracts import CONSUMERS
from shared.devstack.ports import free_port

KINDS = ("read", "list", "create", "upload", "bad_credential")
# bench/soak.lua sends these from wrk's C event loop: a Python (httpx) client is client-bound and could offer only a
# fraction of the stack's figure; uploads are a few a minute and stay in Python, which also checks each step
WRK_KINDS = ("read", "list", "create", "bad_credential")
# shares of the offered rate (bench/soak.lua's kinds); uploads come at their own fixed rate (UPLOADS_PER_S)
MIX = {"read": 0.6, "list": 0.15, "create": 0.1, "bad_credential": 0.15}
# an upload is five API requests, a PUT to storage and an encode into two renditions (ffmpeg, ~0.3 s of a core
# here): at a share of half the read figure (1 %: ~6/s) the encodes alone took the 2 cores, and the soak measured the
# farm's backlog instead of the API. One every two seconds is 300 encodes in 10 minutes.
UPLOADS_PER_S = 0.5
# anything else, no answer, or a wrk socket error (an answer later than WRK_GRACE_SECONDS) is an unexpected error
EXPECTED = {"read": (200,), "list": (200,), "create": (201,), "bad_credential": (401, 429)}
BAD_ADDRESSES = [f"198.51.100.{i}" for i in range(1, 5)]
MAX_IN_FLIGHT = 512  # past this the stack is overloaded: a request not sent on time counts as an error
MEMORY_GROWTH_MAX = 0.10
DRAIN_SECONDS = 120
CALIBRATE_CONNECTIONS = 32  # as bench.api's default
LUA = Path(__file__).with_name("soak.lua")
WRK_START_SECONDS = 1.0  # the schedule starts this long after wrk is launched, so that its threads are up
WRK_GRACE_SECONDS = 10  # wrk runs this long past the schedule's end; an answer later than this is an error
CLOSED_LOOP_RATE = 1e9  # a schedule always behind: bench/soak.lua then sends each request when the last is answered


@dataclass
class Minute:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    expected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    answered: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 2)


def hist_pct(hist: dict[str, int], q: float) -> float | None:
    """The q-quantile (ms) of bench/soak.lua's histogram {"<bucket's midpoint, us>": count}, ranked as `pct`."""
    buckets = sorted((float(us), n) for us, n in hist.items())
    total = sum(n for _, n in buckets)
    if not total:
        return None
    rank = min(total - 1, int(total * q))
    seen = 0
    for us, n in buckets:
        seen += n
        if seen > rank:
            return round(us / 1000, 2)
    raise AssertionError("unreachable")


def wrk_threads(rate: float) -> int:
    """wrk's threads for `rate` requests/s, one connection each (so a thread knows which request an answer is for):
    one request per >= 200 ms per connection, several times the kinds' p50 at half load, so a connection is free
    when its next request is due (a slow answer delays those behind it on its connection: the client's queue, not
    the stack's); 8 to 160, as mostly idle wrk threads cost little."""
    return max(8, min(160, math.ceil(rate / 5)))


def merge_wrk(doc: dict[str, Any], minutes: list[Minute]) -> dict[str, dict[str, int]]:
    """Adds bench/soak.lua's minutes to `minutes` (errors, expected refusals, answers; grown as needed) and returns
    each minute's histograms by kind (the latencies of the expected answers)."""
    hists: dict[str, dict[str, int]] = {}
    for i, row in enumerate(doc.get("minutes") or []):
        while len(minutes) <= i:
            minutes.append(Minute())
        m = minutes[i]
        for kind, cell in row.items():
            hists[f"{i}/{kind}"] = cell["hist"]
            for code, n in cell["status"].items():
                m.answered[kind] += n
                if int(code) not in EXPECTED[kind]:
                    m.errors[kind][code] += n
                elif not 200 <= int(code) < 300:
                    m.expected[kind] += n
            if cell["no_response"]:
                m.errors[kind]["no_response"] += cell["no_response"]
    return hists


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


SOAK_ENV = {"WEIR_TRUSTED_PROXIES": "127.0.0.1/32", "WEIR_LIMIT_KEY_PER_MINUTE": str(10**9),
            "WEIR_LIMIT_OWNER_PER_MINUTE": str(10**9), "WEIR_LIMIT_UPLOAD_TOKEN_PER_MINUTE": str(10**9)}


def start_stack(data_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
                ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """`weir up` in `data_dir` with `env` (by default SOAK_ENV: limits high enough that only overload or faults
    refuse, and 127.0.0.1 a trusted proxy so that bad credentials come from addresses of their own, their 401s and
    429s expected answers) and more of its `args`; its log is weir-up.log beside `data_dir`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WEIR_LOG_LEVEL": "WARNING", **(SOAK_ENV if env is None else env)}
    log = (data_dir.parent / "weir-up.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "weir.cli", "up", "--data-dir", str(data_dir),
                             "--api-port", str(free_port()), *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stack_json = data_dir / "stack.json"
    deadline = time.monotonic() + 180
    while not stack_json.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"weir up did not start: see {log.name}")
        time.sleep(0.2)
    return proc, json.loads(stack_json.read_text())


class Traffic:
    """The Python client's share of the soak: full uploads."""

    def __init__(self, api: str, key: str, clip: bytes) -> None:
        self.api, self.key, self.clip = api, key, clip
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
        minute.answered[kind] += 1
        if not 200 <= status < 300:
            minute.errors[kind][str(status)] += 1
            return
        minute.latencies[kind].append(time.perf_counter() - t0)

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


async def calibrate(api: str, key: str, video_id: str, seconds: int) -> dict[str, Any]:
    """bench.api's guarded figure on this stack: wrk, closed loop, on GET /v1/videos/{id} (after a warm-up)."""
    url, headers = f"{api}/v1/videos/{video_id}", {"Authorization": f"Bearer {key}"}
    await asyncio.to_thread(wrk, url, headers, min(WARM_SECONDS, seconds), CALIBRATE_CONNECTIONS)
    return await asyncio.to_thread(wrk, url, headers, seconds, CALIBRATE_CONNECTIONS)


async def calibrate_mix(api: str, key: str, video_id: str, seconds: int, out: Path, **options: Any) -> float:
    """What the stack takes of the soak's own mix (MIX, or `run_wrk`'s `options`), by bench.api's method:
    bench/soak.lua in a closed loop (a rate it cannot reach: every request goes as soon as the last one is answered),
    CALIBRATE_CONNECTIONS connections, `seconds`. Requests answered per second (every status: a refusal is work done
    too)."""
    started = time.monotonic()
    doc = await run_wrk(api, key, video_id, CLOSED_LOOP_RATE, started, seconds / 60, out,
                        threads=CALIBRATE_CONNECTIONS, duration=seconds, **options)
    answered: int = sum(n for row in doc.get("minutes") or [] for cell in row.values() for n in cell["status"].values())
    return answered / max(1e-9, time.monotonic() - started)


async def soak(traffic: Traffic, rate: float, start: float, minutes: float, shares: dict[str, float]) -> list[Minute]:
    """The Python client's open loop: `rate` requests/s from `start` (time.monotonic()) of the kinds in `shares`.
    A request's latency runs from when it was due, so a stall counts fully (no coordinated omission)."""
    kinds, weights = list(shares), list(shares.values())
    rnd = random.Random(11)
    out: list[Minute] = []
    tasks: set[asyncio.Task[None]] = set()
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


async def run_wrk(api: str, key: str, video_id: str, rate: float, start: float, minutes: float,
                  out: Path, *, threads: int | None = None, duration: int | None = None,
                  mix: dict[str, float] | None = None, expected: dict[str, tuple[int, ...]] | None = None,
                  options: tuple[str, ...] = (), nice: int = 0) -> dict[str, Any]:
    """bench/soak.lua's share of the soak (`mix`'s kinds, by default WRK_KINDS in MIX, at `rate` requests/s from
    `start`; `expected`: their expected statuses, by default EXPECTED): its JSON document. `threads` (connections) and
    `duration` (wrk's -d) default to the schedule's; `options`: more of bench/soak.lua's (e.g. "period=1"); `nice`:
    wrk's niceness (below 0: a client the machine's load does not slow, as on a machine of its own; needs root)."""
    threads = threads or wrk_threads(rate)
    seconds = minutes * 60
    duration = duration or math.ceil(start - time.monotonic() + seconds + WRK_GRACE_SECONDS)
    mix, expected = mix or MIX, expected or EXPECTED
    args = [f"out={out}", f"start={start:.6f}", f"seconds={seconds:g}", f"rate={rate:.6f}", f"threads={threads}",
            "seed=11", f"key={key}", f"video={video_id}", "mix=" + ",".join(f"{k}:{v}" for k, v in mix.items()),
            "expect=" + ",".join(f"{k}:{'/'.join(map(str, expected[k]))}" for k in mix),
            "bad=" + ",".join(BAD_ADDRESSES), *options]
    proc = await asyncio.create_subprocess_exec(
        "wrk", f"-t{threads}", f"-c{threads}", f"-d{duration}s", "--timeout", f"{WRK_GRACE_SECONDS}s",
        "-s", str(LUA), f"{api}/", "--", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=(lambda: os.nice(nice)) if nice else None)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), duration + 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return wrk_result(out, proc.returncode, stdout.decode(), stderr.decode())


def wrk_result(out: Path, returncode: int | None, stdout: str, stderr: str) -> dict[str, Any]:
    if returncode != 0 or not out.exists():
        raise RuntimeError(f"wrk failed ({returncode}): {stderr[-2000:]} {stdout[-2000:]}")
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["stderr"] = stderr[-2000:]  # a Lua error shows here
    return doc


def status(data_dir: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--json", "--stack", str(data_dir / "stack.json")],
                       capture_output=True, text=True, timeout=60)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def drained(doc: dict[str, Any]) -> dict[str, Any]:
    """What is left of the stack's own work: outbox rows unsent, events its services' durables have not handled
    (shared/contracts.py's CONSUMERS; a durable the operator made for an outside reader, e.g. `publisher_videos`,
    waits for that reader, not for Weir), dead letters."""
    own = {c.name for c in CONSUMERS}
    outbox = {k: v for k, v in (doc.get("outbox") or {}).items() if v}
    pending = {f"{c['stream']}/{c['name']}": c["pending"] for c in doc.get("consumers") or []
               if c.get("pending") and c["name"] in own}
    dlq = {k: v for k, v in (doc.get("dlq") or {}).items() if v}
    return {"outbox_unsent": outbox, "consumers_pending": pending, "dlq": dlq}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="reads, lists, creates and bad credentials offered per second (default: half the "
                             "calibration)")
    parser.add_argument("--upload-rate", type=float, default=UPLOADS_PER_S,
                        help=f"full uploads (each encoded) started per second (default {UPLOADS_PER_S})")
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
    calibration = await calibrate(api, key, video["id"], args.calibrate_seconds)
    capacity = calibration["per_s"]
    mix_capacity = await calibrate_mix(api, key, video["id"], args.calibrate_seconds,
                                       data_dir.parent / "wrk-calibration.json")
    # half of the mix's own figure, not of the reads': creates, lists and refusals cost more than a read, and at half
    # the reads' figure the stack falls behind
    rate = args.rate or mix_capacity / 2
    offered = {**{k: rate * share for k, share in MIX.items()}, "upload": args.upload_rate}
    pids = {name: int(pid) for name, pid in info["pids"].items() if name != "weir"}
    memory_start = {name: rss_mb(pid) for name, pid in pids.items()}
    print(f"calibration: {capacity:.0f} reads/s (bench.api's figure: wrk, closed loop, p99 {calibration['p99_ms']} "
          f"ms), {mix_capacity:.0f} requests/s of the soak's mix (the same way); offering "
          f"{rate:.0f} requests/s and {args.upload_rate:g} uploads/s for {args.minutes:g} min ({wrk_threads(rate)} wrk "
          f"connections)",
          file=sys.stderr, flush=True)
    traffic = Traffic(api, key, tiny_mp4())
    try:
        start = time.monotonic() + WRK_START_SECONDS
        wrk_doc, minutes = await asyncio.gather(
            run_wrk(api, key, video["id"], rate, start, args.minutes, data_dir.parent / "wrk.json"),
            soak(traffic, offered["upload"], start, args.minutes, {"upload": 1.0}))
    finally:
        await traffic.close()
    hists = merge_wrk(wrk_doc, minutes)
    pids_end = {name: int(pid) for name, pid in json.loads((data_dir / "stack.json").read_text())["pids"].items()
                if name != "weir"}
    memory_end = {name: rss_mb(pid) for name, pid in pids_end.items()}
    deadline = time.monotonic() + DRAIN_SECONDS
    while True:
        left = drained(status(data_dir))
        if not any(left.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)

    def cell(i: int, m: Minute, kind: str) -> dict[str, Any]:
        if kind in WRK_KINDS:
            hist = hists.get(f"{i}/{kind}", {})
            return {"n": sum(hist.values()), "p50_ms": hist_pct(hist, 0.5), "p99_ms": hist_pct(hist, 0.99)}
        return {"n": len(m.latencies[kind]), "p50_ms": pct(m.latencies[kind], 0.5),
                "p99_ms": pct(m.latencies[kind], 0.99)}

    per_minute: list[dict[str, Any]] = []
    for i, m in enumerate(minutes):
        per_minute.append({"minute": i + 1, **{k: cell(i, m, k) for k in KINDS},
                           "errors": {k: dict(v) for k, v in m.errors.items() if v},
                           "expected_refusals": dict(m.expected)})
    socket_errors = {k: wrk_doc["wrk_errors"].get(k, 0) for k in ("connect", "read", "write", "timeout")}
    unexpected = sum(n for m in minutes for by in m.errors.values() for n in by.values()) + sum(socket_errors.values())
    seconds = args.minutes * 60
    achieved = {k: sum(m.answered[k] for m in minutes) / seconds for k in KINDS}
    rates = {k: {"offered_per_s": round(offered[k], 1), "achieved_per_s": round(achieved[k], 1)} for k in KINDS}
    rates["total"] = {"offered_per_s": round(rate, 1), "achieved_per_s": round(sum(achieved.values()), 1)}
    growth = {name: round(end / start - 1, 3) for name, start in memory_start.items()
              if start and (end := memory_end.get(name))}
    restarted = sorted(name for name in pids if pids_end.get(name) != pids[name])
    return {"rate_per_s": round(rate, 1), "calibration_reads_per_s": round(capacity, 1),
            "calibration_mix_per_s": round(mix_capacity, 1),
            "calibration": calibration, "minutes": args.minutes, "rates": rates, "wrk_threads": wrk_doc["threads"],
            "per_minute": per_minute, "wrk_socket_errors": socket_errors, "unexpected_errors": unexpected,
            "memory_start_mb": memory_start, "memory_end_mb": memory_end, "memory_growth": growth,
            "memory_growth_ok": all(g <= MEMORY_GROWTH_MAX for g in growth.values()),
            **({"wrk_stderr": wrk_doc["stderr"]} if wrk_doc["stderr"].strip() else {}),
            "services_restarted": restarted, "after_drain": left, "drained": not any(left.values()),
            "p99_ms_median_over_minutes": {k: statistics.median([p for m in per_minute
                                                                  if (p := m[k]["p99_ms"]) is not None] or [0])
                                           for k in KINDS}}


def report(r: dict[str, Any]) -> None:
    print(f"offered {r['rate_per_s']}/s (calibration {r['calibration_mix_per_s']}/s of the mix, "
          f"{r['calibration_reads_per_s']} reads/s) for {r['minutes']} min "
          f"({r['wrk_threads']} wrk connections)")
    print("per s, offered / achieved: " + ", ".join(
        f"{k} {v['offered_per_s']} / {v['achieved_per_s']}" for k, v in r["rates"].items()))
    print(f"{'min':>4} " + " ".join(f"{k + ' p50/p99 ms':>26}" for k in KINDS) + "  errors")
    for m in r["per_minute"]:
        cells = " ".join(f"{str(m[k]['p50_ms']) + ' / ' + str(m[k]['p99_ms']):>26}" for k in KINDS)
        print(f"{m['minute']:>4} {cells}  {m['errors'] or 0}")
    print(f"unexpected errors: {r['unexpected_errors']} (wrk socket errors {r['wrk_socket_errors']}); "
          f"services restarted: {r['services_restarted'] or 'none'}")
    print("memory MB (start -> end, growth): " + ", ".join(
        f"{n} {r['memory_start_mb'][n]} -> {r['memory_end_mb'].get(n)} ({r['memory_growth'].get(n, 0):+.1%})"
        for n in r["memory_start_mb"]))
    print(f"after draining: {r['after_drain']} ({'drained' if r['drained'] else 'NOT drained'})")


if __name__ == "__main__":
    main()
