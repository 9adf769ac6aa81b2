"""`weir rollout` of each service in turn under steady load, on a `weir up` stack with its limits raised.

    python -m bench.rollout [--services api,auth,encode,media,sweep] [--steady-seconds 20] [--out FILE]
                            [--migrate-compare ROUNDS] [--edge]   (needs wrk; root for --migrate-compare)

It calibrates bench.api's way (wrk, closed loop, guarded GET /v1/videos/{id}), then offers half of that figure in an
open loop (bench/soak.lua, read only, counted per second) plus uploads that encode (Python, open loop), for a steady
stretch and then one `weir rollout SERVICE` after another. Per service, over the seconds its rollout took: the GETs'
non-2xx and lost answers (socket errors), the uploads' failed steps, lost or doubled events among the uploads
completed meanwhile (upload.completed in VIDEOS, encode's inbox, every such video ready: tests/faults/stackhelpers.py
`delivery`), and the GETs' p99 beside the steady stretch's (the goal: <= 3x).

`--migrate-compare N`: afterwards, N rounds of an api rollout under clients that open a connection per request,
with net.ipv4.tcp_migrate_req 0 and then 1: the connections reset when the old instance's listener closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.api import WARM_SECONDS, tiny_mp4, wrk
from bench.soak import hist_pct, run_wrk, wrk_threads
from bench.soak import start_stack as soak_stack
from tests.faults.stackhelpers import Delivery, WeirUp, settled_delivery

SERVICES = ("api", "auth", "encode", "media", "sweep")
P99_RATIO_GOAL = 3.0
CALIBRATE_CONNECTIONS = 32  # as bench.api's default
LOAD_SHARE = 0.5  # of the calibrated figure
PERIOD_SECONDS = 1  # bench/soak.lua's counting period: a rollout's window is whole seconds of the schedule
MIGRATE_PATH = Path("/proc/sys/net/ipv4/tcp_migrate_req")
CHURN_CONNECTIONS = 128  # --migrate-compare: clients each opening a connection per request
CHURN_LEAD_SECONDS = 2  # the churn is under way this long before the rollout starts
SETTLE_SECONDS = 180
OVERLOADED_P99_FACTOR = 10.0  # a steady open-loop p99 this far over the closed loop's: the machine was overloaded


@dataclass
class Window:
    service: str
    start: float
    end: float
    code: int
    output: str


@dataclass
class Uploads:
    """Uploads sent on a fixed schedule: each step's answer with its time, and the videos whose upload completed."""

    api: str
    key: str
    clip: bytes
    answers: list[tuple[float, str]] = field(default_factory=list)  # (time, status or the error's class)
    completed: dict[str, float] = field(default_factory=dict)  # video id -> when complete answered 200

    async def one(self, http: httpx.AsyncClient) -> None:
        auth = {"Authorization": f"Bearer {self.key}"}

        async def step(method: str, url: str, ok: int, **kw: Any) -> httpx.Response | None:
            try:
                r = await http.request(method, url, **kw)
            except httpx.HTTPError as exc:
                self.answers.append((time.monotonic(), type(exc).__name__))
                return None
            self.answers.append((time.monotonic(), str(r.status_code)))
            return r if r.status_code == ok else None

        created = await step("POST", "/v1/videos", 201, json={"name": "rollout bench"}, headers=auth)
        if created is None:
            return
        video = created.json()["id"]
        path = f"/v1/videos/{video}/upload"
        if await step("POST", path, 200, json={"content_type": "video/mp4"}, headers=auth) is None:
            return
        parts = await step("POST", f"{path}/parts", 200, json={"part_numbers": [1]}, headers=auth)
        if parts is None:
            return
        put = await step("PUT", parts.json()["parts"][0]["url"], 200, content=self.clip)
        if put is None:
            return
        done = await step("POST", f"{path}/complete", 200, headers=auth,
                          json={"parts": [{"part_number": 1, "etag": put.headers["etag"]}]})
        if done is not None:
            self.completed[video] = time.monotonic()

    async def run(self, rate: float, start: float, seconds: float) -> None:
        async with httpx.AsyncClient(base_url=self.api, timeout=30) as http:
            tasks: list[asyncio.Task[None]] = []
            k = 0
            while (due := start + k / rate) < start + seconds:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(self.one(http)))
                k += 1
            await asyncio.gather(*tasks)


def start_stack(data_dir: Path, media: int, edge: bool = False) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """`weir up` in `data_dir` with its request limits out of the way (one key and one address send everything);
    `edge`: with HAProxy in front of the api (`weir up --edge`), through which the load goes."""
    env = {f"WEIR_LIMIT_{rule}_PER_MINUTE": str(10**9) for rule in ("ADDRESS", "KEY", "OWNER", "UPLOAD_TOKEN")}
    return soak_stack(data_dir, env, ("--media", str(media), *(("--edge",) if edge else ())))


async def reads(api: str, key: str, video: str, rate: float, start: float, seconds: float, out: Path
                ) -> dict[str, Any]:
    """bench/soak.lua, reads only, counted per PERIOD_SECONDS: its JSON document."""
    return await run_wrk(api, key, video, rate, start, seconds / 60, out, mix={"read": 1.0},
                         expected={"read": (200,)}, options=(f"period={PERIOD_SECONDS}",))


async def weir_rollout(data_dir: Path, service: str, env: dict[str, str] | None = None, nice: int = 0
                       ) -> tuple[int, str]:
    """The command as an operator runs it; `nice`: as `nice -n N weir rollout`, so that the command's own start-up
    (about a second of a core: the CLI's imports) yields to the stack it shares the 2 cores with."""
    proc = await asyncio.create_subprocess_exec(
        "nice", "-n", str(nice), sys.executable, "-m", "weir.cli", "rollout", service, "--data-dir", str(data_dir),
        env={**os.environ, **(env or {})}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


def window_reads(doc: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """The GETs scheduled in [start, end): their count, non-2xx, lost answers and p99 (ms)."""
    return merged_reads(doc, [(start, end)])


def merged_reads(doc: dict[str, Any], spans: list[tuple[float, float]]) -> dict[str, Any]:
    """window_reads over several spans together (each whole second of the schedule they touch, once)."""
    seconds: set[int] = set()
    for start, end in spans:
        first = max(0, math.floor((start - doc["start"]) / PERIOD_SECONDS))
        last = min(len(doc["minutes"]), math.ceil((end - doc["start"]) / PERIOD_SECONDS))
        seconds.update(range(first, last))
    hist: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    lost = 0
    for period in (doc["minutes"][i] for i in sorted(seconds)):
        row = period.get("read", {})
        hist.update(row.get("hist", {}))
        statuses.update(row.get("status", {}))
        lost += int(row.get("no_response", 0))
    return {"requests": sum(statuses.values()) + lost, "non_2xx": sum(n for s, n in statuses.items() if s != "200"),
            "lost": lost, "p99_ms": hist_pct(dict(hist), 0.99),
            "statuses": {s: n for s, n in sorted(statuses.items()) if s != "200"}}


async def shedding_counters(api: str) -> dict[str, float]:
    """The api's `weir_shed_total` (its own shedder, by priority) and `weir_auth_overloaded_total` (auth's shed
    checks) from its /metrics."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{api}/metrics")).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("weir_shed_total", "weir_auth_overloaded_total")):
            name, _, value = line.rpartition(" ")
            if float(value):
                found[name] = float(value)
    return found


def window_events(found: Delivery, completed: dict[str, float], start: float, end: float) -> dict[str, int]:
    """Among the uploads completed in [start, end): lost (no upload.completed, no inbox row, or not ready) and
    doubled (an event twice, or handled twice)."""
    videos = {v for v, t in completed.items() if start <= t < end}
    events = found.event_videos
    handled: Counter[str] = Counter()
    for _, envelope in found.events:
        handled[str(envelope.data["video_id"])] += found.inbox.get(envelope.id, 0)
    lost = sum(1 for v in videos if events[v] == 0 or handled[v] == 0 or v in found.not_ready
               or v not in found.recorded)
    doubled = sum(1 for v in videos if events[v] > 1 or handled[v] > 1)
    return {"uploads": len(videos), "lost_events": lost, "doubled_events": doubled}


def socket_errors(wrk_out: str) -> dict[str, int]:
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", wrk_out)
    return dict(zip(("connect", "read", "write", "timeout"), map(int, m.groups()), strict=True)) if m else {}


def migrate_requests(value: str | None = None) -> str:
    """net.ipv4.tcp_migrate_req: set it to `value` when given; what it is."""
    if value is not None:
        MIGRATE_PATH.write_text(value + "\n")
    return MIGRATE_PATH.read_text().strip()


async def migrate_compare(data_dir: Path, api: str, key: str, video: str, rounds: int, seconds: int
                          ) -> list[dict[str, Any]]:
    """An api rollout under CHURN_CONNECTIONS clients opening a connection per request, with tcp_migrate_req 0 and
    1 in turn: the socket errors each saw (connections in the old listener's queue when it closed are reset)."""
    before = migrate_requests()
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(rounds):
            for value in ("0", "1"):
                migrate_requests(value)
                load = await asyncio.create_subprocess_exec(
                    "wrk", "-t2", f"-c{CHURN_CONNECTIONS}", f"-d{seconds}s", "-H", "Connection: close", "-H",
                    f"Authorization: Bearer {key}", f"{api}/v1/videos/{video}",
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                await asyncio.sleep(CHURN_LEAD_SECONDS)
                code, _ = await weir_rollout(data_dir, "api", {"WEIR_ROLLOUT_MIGRATE_REQUESTS": "false"})
                out, _ = await load.communicate()
                text = out.decode()
                non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
                total = re.search(r"(\d+) requests in", text)
                rows.append({"tcp_migrate_req": int(value), "rollout_code": code,
                             "requests": int(total.group(1)) if total else 0, "socket_errors": socket_errors(text),
                             "non_2xx": int(non2xx.group(1)) if non2xx else 0})
                print(f"  tcp_migrate_req={value}: {rows[-1]}", flush=True)
    finally:
        migrate_requests(before)
    return rows


async def run(args: argparse.Namespace, info: dict[str, Any], up: WeirUp) -> dict[str, Any]:
    api, key = info["api_url"], info["demo"]["secret_key"]
    clip = tiny_mp4()
    async with httpx.AsyncClient(base_url=api, timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
        r = await http.post("/v1/videos", json={"name": "rollout bench read"})
        r.raise_for_status()
        video = r.json()["id"]
    url, headers = f"{api}/v1/videos/{video}", {"Authorization": f"Bearer {key}"}
    services = [s for s in args.services.split(",") if s]
    # (label, service, the command's extra environment): with --beside each service twice, the baseline first
    # for every other service, so neither variant always comes second
    plan: list[tuple[str, str, dict[str, str]]] = []
    for i, service in enumerate(services):
        pair: list[tuple[str, str, dict[str, str]]] = [(service, service, {})]
        if args.beside:
            name, _, value = args.beside.partition("=")
            base = (f"{service}*", service, {name: value})
            pair = [base, *pair] if i % 2 == 0 else [*pair, base]
        plan += pair
    seconds = args.steady_seconds + len(plan) * args.seconds_per_service
    # the uploads (and their encodes) from now on: the capacity is measured beside them
    uploads = Uploads(api, key, clip)
    calibrate_s = WARM_SECONDS + args.calibrate_seconds + 2
    upload_task = asyncio.create_task(uploads.run(args.upload_rate, time.monotonic(), calibrate_s + seconds))
    await asyncio.to_thread(wrk, url, headers, WARM_SECONDS, CALIBRATE_CONNECTIONS)
    calibration = await asyncio.to_thread(wrk, url, headers, args.calibrate_seconds, CALIBRATE_CONNECTIONS)
    rate = calibration["per_s"] * LOAD_SHARE
    print(f"calibration (uploads going on): {calibration['per_s']:.0f} guarded GETs/s (p99 "
          f"{calibration['p99_ms']} ms); offering {rate:.0f}/s and {args.upload_rate:g} uploads/s for up to "
          f"{seconds} s ({wrk_threads(rate)} wrk connections)", flush=True)
    start = time.monotonic() + 1.0
    wrk_task = asyncio.create_task(reads(api, key, video, rate, start, seconds, up.data_dir.parent / "wrk.json"))
    await asyncio.sleep(max(0.0, start + args.steady_seconds - time.monotonic()))
    windows: list[Window] = []
    for label, service, env in plan:
        t0 = time.monotonic()
        code, output = await weir_rollout(up.data_dir, service, env, nice=args.cli_nice)
        windows.append(Window(label, t0, time.monotonic(), code, output))
        print(f"{label}: rollout exited {code} after {windows[-1].end - t0:.1f} s", flush=True)
        if code != 0:
            print(output, flush=True)
        await asyncio.sleep(args.gap_seconds)
    if time.monotonic() > start + seconds:
        print("warning: the rollouts outlasted the load's schedule (raise --seconds-per-service)", flush=True)
    doc, _ = await asyncio.gather(wrk_task, upload_task)
    found, settle_s = await settled_delivery(up, SETTLE_SECONDS)
    print(f"settled in {settle_s:.1f} s: {found.summary()}", flush=True)
    try:
        found.check()
        overall = "nothing lost or doubled"
    except AssertionError as exc:
        overall = f"FAILED: {exc}"

    # the steady stretch: after the load's own start (wrk's connections, the first answers) has settled
    steady = window_reads(doc, start + args.settle_seconds, start + args.steady_seconds)
    outside = [(a, b) for a, b in zip([start + args.settle_seconds] + [w.end for w in windows],
                                      [w.start for w in windows] + [start + seconds], strict=True)]
    quiet = merged_reads(doc, outside)
    rows = []
    for w in windows:
        got = window_reads(doc, w.start, w.end)
        failed_uploads = Counter(o for t, o in uploads.answers if w.start <= t < w.end and not o.startswith("2"))
        ratio = (got["p99_ms"] / steady["p99_ms"]) if got["p99_ms"] and steady["p99_ms"] else None
        ratio_outside = (got["p99_ms"] / quiet["p99_ms"]) if got["p99_ms"] and quiet["p99_ms"] else None
        rows.append({"service": w.service, "rollout_code": w.code, "seconds": round(w.end - w.start, 1), **got,
                     "upload_failures": dict(failed_uploads), **window_events(found, uploads.completed, w.start, w.end),
                     "p99_ratio": round(ratio, 2) if ratio else None,
                     "p99_ratio_outside": round(ratio_outside, 2) if ratio_outside else None})
    result: dict[str, Any] = {
        "cli_nice": args.cli_nice, "calibration": calibration, "rate": round(rate, 1),
        "upload_rate": args.upload_rate, "steady": steady, "outside_rollouts": quiet,
        "rollouts": rows, "wrk_errors": doc["wrk_errors"], "wrk_requests": doc["wrk_requests"],
        "uploads_completed": len(uploads.completed), "delivery": found.summary(), "delivery_check": overall,
        # per second of the schedule: (GETs, p99 ms), and each rollout's seconds in it, to see where a p99 comes from
        "timeline": [(sum(p.get("read", {}).get("status", {}).values()), hist_pct(p.get("read", {}).get("hist", {}),
                                                                                   0.99)) for p in doc["minutes"]],
        "windows": {w.service: (round(w.start - doc["start"], 1), round(w.end - doc["start"], 1)) for w in windows},
    }
    print(f"\nsteady ({args.steady_seconds - args.settle_seconds} s before the first rollout): {steady['requests']} "
          f"GETs, p99 {steady['p99_ms']} ms; every second outside the rollouts: {quiet['requests']} GETs, p99 "
          f"{quiet['p99_ms']} ms")
    print(f"{'service':<12} {'s':>5} {'GETs':>6} {'non-2xx':>7} {'lost':>5} {'upload fails':>12} {'uploads':>7} "
          f"{'lost ev':>7} {'doubled':>7} {'p99 ms':>7} {'x steady':>8} {'x outside':>9}")
    for row in rows:
        print(f"{row['service']:<12} {row['seconds']:>5} {row['requests']:>6} {row['non_2xx']:>7} {row['lost']:>5} "
              f"{sum(row['upload_failures'].values()):>12} {row['uploads']:>7} {row['lost_events']:>7} "
              f"{row['doubled_events']:>7} {row['p99_ms']!s:>7} {row['p99_ratio']!s:>8} "
              f"{row['p99_ratio_outside']!s:>9}")
    print(f"wrk socket errors over the whole run: {doc['wrk_errors']}; {overall}")
    for row in rows:
        if row["statuses"]:
            print(f"  {row['service']}: non-2xx by status {row['statuses']}")
    # who refused (the api's instance now, rolled out first: what its shedder and auth's refused since it started)
    result["api_shedding"] = await shedding_counters(api)
    print(f"the api's shedding counters at the end: {result['api_shedding']}")
    if steady["p99_ms"] and steady["p99_ms"] > OVERLOADED_P99_FACTOR * calibration["p99_ms"]:
        print(f"warning: the steady p99 is over {OVERLOADED_P99_FACTOR:g}x the calibration's (closed loop): the load "
              "was more than the machine took (something else ran?); the p99 ratios say little", flush=True)
    worst = max((r["p99_ratio"] or 0 for r in rows), default=0)
    print(f"worst p99 ratio {worst} (goal <= {P99_RATIO_GOAL:g})")
    if args.migrate_compare:
        print(f"\ntcp_migrate_req compared: {args.migrate_compare} round(s) of an api rollout under "
              f"{CHURN_CONNECTIONS} connection-per-request clients", flush=True)
        result["migrate_compare"] = await migrate_compare(up.data_dir, api, key, video, args.migrate_compare,
                                                          args.seconds_per_service)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", default=",".join(SERVICES))
    parser.add_argument("--media", type=int, default=2, help="media workers (each rolled out in turn)")
    parser.add_argument("--calibrate-seconds", type=int, default=8)
    parser.add_argument("--steady-seconds", type=int, default=30, help="load before the first rollout")
    parser.add_argument("--settle-seconds", type=int, default=10, help="the first of them, not counted as steady")
    parser.add_argument("--seconds-per-service", type=int, default=40, help="the load's schedule per rollout")
    parser.add_argument("--gap-seconds", type=float, default=3.0, help="between two rollouts")
    parser.add_argument("--upload-rate", type=float, default=0.5, help="uploads that encode, per second")
    parser.add_argument("--migrate-compare", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--beside", default="", metavar="NAME=VALUE",
                        help="also roll each service out with this setting in the command's environment, in the same "
                             "run (its rows marked *), e.g. WEIR_ROLLOUT_START_CPU_SHARE=0")
    parser.add_argument("--edge", action="store_true", help="the stack as `weir up --edge`: the load goes through "
                        "its HAProxy, which follows the api's instances by their /readyz")
    parser.add_argument("--cli-nice", type=int, default=10, help="`nice -n N weir rollout` (0: as is)")
    parser.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weir-bench-rollout-") as tmp:
        data_dir = Path(tmp) / "weir"
        proc, info = start_stack(data_dir, args.media, args.edge)
        up = WeirUp(data_dir, proc, Path(tmp) / "weir-up.log", info)
        try:
            result = asyncio.run(run(args, info, up))
        finally:
            proc.terminate()
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
