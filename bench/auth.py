"""auth.check decisions per second and latency, 1 and 3 instances, beside a bare NATS echo in the same run.

Each instance is its own process; the load (bench/natsload.c, one C client) is accepted secret keys, three rules per
decision: closed loops (throughput, p50, p99, paired echo/check ratios) and open loops at half load (p50, p99).
One instance is also measured on its FastStream subscriber (bench/auth_unbatched.py), to show what the seam buys.
    python -m bench.auth [--requests N] [--concurrency C] [--keys K] [--rounds R] [--latency-rounds R]
                         [--rates 500,1000,2000] [--deployed-only] [--beside CHECKOUT]   (or WEIR_BENCH_EXTERNAL=1)
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
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import nats

from bench.api import service_env
from bench.bus import servers
from shared.authcheck import CHECK_SUBJECT, AccountCreated, AppCreated, CheckRequest, CreateAccount, CreateApp
from shared.authclient import manage
from shared.devstack.ports import free_port
from shared.settings import CommonSettings
from weir.up import prepare

ECHO_SUBJECT = "bench.echo"
NO_SEAM = ", FastStream subscriber (no batched seam)"  # bench/auth_unbatched.py
PAYLOADS = 4096  # distinct (key, address) pairs the load cycles through
GOAL_PER_S = 5000  # issue 3's goal for one instance; its latency goal is at half this load
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




def start_auth(settings: CommonSettings, n: int, env: dict[str, str], module: str = "services.auth"
               ) -> list[subprocess.Popen[bytes]]:
    procs = []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
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


NATSLOAD_SOURCE = Path(__file__).with_name("natsload.c")


def natsload() -> Path:
    """bench/natsload.c compiled (gcc -O2) into bench/out/, again whenever the source is newer than the binary."""
    binary = Path(__file__).with_name("out") / "natsload"
    if not binary.exists() or binary.stat().st_mtime < NATSLOAD_SOURCE.stat().st_mtime:
        binary.parent.mkdir(exist_ok=True)
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(binary), str(NATSLOAD_SOURCE)], check=True)
    return binary


class Load:
    """One kind of request (a subject and the payloads it cycles through), driven by natsload: the same C client
    for the echo and for auth.check, so neither figure carries a Python client's event-loop or GC jitter."""

    def __init__(self, settings: CommonSettings, subject: str, payloads: list[bytes], workdir: Path) -> None:
        url = urlsplit(settings.nats_url)
        self.address = [url.hostname or "127.0.0.1", str(url.port or 4222)]
        self.subject = subject
        self.file = workdir / f"{subject}-{len(payloads)}-{id(self)}.txt"
        self.file.write_bytes(b"\n".join(payloads) + b"\n")

    def run(self, mode: str, n: int, param: float) -> Row:
        out = subprocess.run([str(natsload()), *self.address, self.subject, str(self.file), mode, str(n),
                              str(param)], capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise RuntimeError(f"natsload failed: {out.stderr.strip()}")
        row: Row = json.loads(out.stdout)
        return row

    def closed(self, n: int, concurrency: int) -> Row:
        return self.run("closed", n, concurrency)

    def open(self, n: int, rate: float) -> Row:
        return {**self.run("open", n, rate), "offered_per_s": round(rate, 1)}


def check_payloads(keys: list[str], peers: list[str]) -> list[bytes]:
    return [
        CheckRequest(authorization=f"Bearer {k}", peer=p, route_class="secret", route="GET /v1/videos/{id}")
        .model_dump_json().encode()
        for k, p in zip(keys, peers, strict=True)
    ]


def alternate(echo: Load, check: Load, rate: float, rounds: int, names: tuple[str, str]) -> list[Row]:
    """The echo and auth.check at one offered rate, alternating `rounds` times (p99 on this VM moves by several ms
    from one 3-second run to the next, with the machine's own wake-up latency): each figure's median over rounds."""
    runs: tuple[list[Row], list[Row]] = ([], [])
    for i in range(rounds):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            load = (echo, check)[which]
            # half a second at the rate first, unmeasured: the steady state, not the first requests after the other
            # side's run (auth gives back counts unused for WEIR_COUNTER_LEASE_IDLE_MS, so those would wait a grant)
            load.open(max(1, int(rate / 2)), rate)
            runs[which].append(load.open(open_n(rate), rate))
    out = [{**median(r), "rounds": rounds, "p99_each_ms": [x["p99_ms"] for x in r], "path": name}
           for r, name in zip(runs, names, strict=True)]
    # the goal's figure: auth.check's p99 over the echo's, in the same rounds (medians, and each round's own ratio)
    out[1]["p99_over_echo"] = out[1]["p99_ms"] / out[0]["p99_ms"]
    out[1]["p99_over_echo_rounds"] = [c["p99_ms"] / e["p99_ms"] for e, c in zip(*runs, strict=True)]
    return out


def median(runs: list[Row]) -> Row:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def open_n(rate: float) -> int:
    """Requests in an open-loop run: three seconds' worth, at least 2,000 (so p99 rests on 20 or more)."""
    return max(2000, int(rate * 3))


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


def run(settings: CommonSettings, args: argparse.Namespace, env: dict[str, str], workdir: Path) -> list[Row]:
    rows: list[Row] = []
    echo_proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVICE, settings.nats_url, ECHO_SUBJECT], stdout=subprocess.PIPE
    )
    assert echo_proc.stdout is not None
    echo_proc.stdout.readline()
    sample = CheckRequest(authorization="Bearer wsk_" + "x" * 32, peer="10.0.0.1", route_class="secret",
                          route="GET /v1/videos/{id}").model_dump_json()
    echo = Load(settings, ECHO_SUBJECT, [b"x" * len(sample)], workdir)
    try:
        echo.closed(min(PAYLOADS, args.requests), args.concurrency)  # warm-up
        rows.append({**echo.closed(args.requests, args.concurrency),
                     "path": "baseline: NATS request/reply echo (1 process)"})
        rows.append({**echo.closed(2000, 1), "path": "baseline: echo, one request at a time"})
        keys: list[str] = []
        # (instances, label, settings, module, measured in full: rounds beside the echo and latency at each rate)
        variants: list[tuple[int, str, dict[str, str], str, bool]] = [
            (1, "", {}, "services.auth", True),
            (1, NO_SEAM, {}, "bench.auth_unbatched", True),
            (1, ", leases off", {"WEIR_COUNTER_LEASE_MAX": "1"}, "services.auth", False),
            (3, "", {}, "services.auth", False),
        ]
        if args.deployed_only:
            variants = variants[:1]
        if args.beside:
            # another checkout's auth (e.g. the previous commit's) in the same run: its rounds beside the same echo
            variants.insert(0 if args.beside_first else 1,
                            (1, f", {args.beside_label}", {"PYTHONPATH": str(Path(args.beside).resolve())},
                             "services.auth", True))
        for instances, label, extra, module, full in variants:
            print(f"auth.check: {instances} instance(s){label}", file=sys.stderr, flush=True)
            procs = start_auth(settings, instances, {**env, **extra}, module)
            try:
                if not keys:
                    keys = asyncio.run(provision(settings, args.keys))
                rnd = random.Random(7)
                chosen = [rnd.choice(keys) for _ in range(PAYLOADS)]
                peers = [f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(1, 255)}" for _ in chosen]
                check = Load(settings, CHECK_SUBJECT, check_payloads(chosen, peers), workdir)
                # warm-up: every distinct request once (the load cycles through PAYLOADS of them), so that what
                # follows is the steady state; the warm-up's own figures are the cold path (each seen first)
                cold = check.closed(PAYLOADS, args.concurrency)
                closed = check.closed(args.requests, args.concurrency)
                for r in (cold, closed):
                    assert r["allowed"] == r["requests"], f"only {r['allowed']} of {r['requests']} allowed"
                rows.append({**closed,
                             "path": f"auth.check, {instances} instance(s){label}, {args.keys} keys, 3 rules"})
                if full:
                    # throughput beside the echo, alternating: one pair of closed loops runs back to back under the
                    # same machine conditions, so the median of the pairs' ratios is the ratio to quote
                    pairs = []
                    for i in range(args.rounds):
                        first, second = (echo, check) if i % 2 == 0 else (check, echo)
                        a, b = first.closed(args.requests, args.concurrency), second.closed(args.requests,
                                                                                          args.concurrency)
                        e, c = (a, b) if first is echo else (b, a)
                        pairs.append((e["per_s"], c["per_s"]))
                    paired = statistics.median(c / e for e, c in pairs)
                    rows.append({**closed, "per_s": statistics.median(c for _, c in pairs),
                                 "path": f"auth.check, 1 instance{label}, median of {args.rounds} rounds beside echo",
                                 "echo_per_s": statistics.median(e for e, _ in pairs), "paired_ratio": paired,
                                 "rounds_per_s": pairs})
                    rows.append({**cold, "path": f"auth.check, 1 instance{label}, cold: {PAYLOADS} first sights"})
                    rows.append({**check.closed(2000, 1),
                                 "path": f"auth.check, 1 instance{label}, one request at a time"})
                    # latency when not saturated: an open loop at half of this run's throughput and at half of the
                    # goal's 5,000/s, and the echo at the same rates; then any --rates (where the machine's floor is)
                    half = closed["per_s"] / 2
                    for rate, name in ((half, "half this run's throughput"), (GOAL_PER_S / 2, "half the goal")):
                        rows += alternate(echo, check, rate, args.latency_rounds,
                                          (f"baseline: echo at {name}{label} (open loop)",
                                           f"auth.check, 1 instance{label}, at {name} (open loop)"))
                    for fixed in args.rates:
                        rows += alternate(echo, check, float(fixed), args.latency_rounds,
                                          (f"echo at {fixed}/s{label} (open loop)",
                                           f"auth.check{label} at {fixed}/s (open loop)"))
            finally:
                stop(procs)
    finally:
        echo_proc.terminate()
        echo_proc.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternate the echo's and one instance's closed loops this many times; paired ratios")
    parser.add_argument("--latency-rounds", type=int, default=3,
                        help="alternate echo and auth.check this many times at each open-loop rate; medians")
    parser.add_argument("--deployed-only", action="store_true",
                        help="only one instance as deployed (its throughput beside the echo and its latency), not the "
                             "FastStream-subscriber, leases-off and 3-instance variants")
    parser.add_argument("--rates", type=lambda v: [int(r) for r in v.split(",") if r], default=[],
                        help="also measure latency at these offered rates, e.g. 500,1000,2000")
    parser.add_argument("--beside", metavar="CHECKOUT", default="",
                        help="also measure one instance of the auth in this checkout (e.g. a worktree of the previous "
                             "commit) in full, in the same run")
    parser.add_argument("--beside-first", action="store_true",
                        help="measure the --beside checkout before this one (run both orders: the machine drifts)")
    args = parser.parse_args()
    args.beside_label = ""
    if args.beside:
        commit = subprocess.run(["git", "-C", args.beside, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        args.beside_label = f"beside: {commit or args.beside}"
    with servers() as settings:
        env = service_env(settings)
        asyncio.run(prepare(settings))
        with tempfile.TemporaryDirectory() as workdir:
            rows = run(settings, args, env, Path(workdir))
    print(f"{'path':90} {'req':>7} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8} {'late p99':>9}")
    for r in rows:
        late = r.get("client_late_p99_ms", "")
        print(f"{r['path']:90} {r['requests']:>7} {r['per_s']:>9} {r['p50_ms']:>8} {r['p99_ms']:>8} {late:>9}")
    print("late p99: in open loops, the C client's own lateness in writing a request (due to written): the kernel's "
          "and hypervisor's wake-up delay, under every other figure")
    base = rows[0]["per_s"]
    for r in rows[1:]:
        if "paired_ratio" in r:
            print(f"{r['path']}: echo / auth.check per round "
                  + ", ".join(f"{e:.0f} / {c:.0f} ({c / e:.2f})" for e, c in r["rounds_per_s"])
                  + f"; median of the rounds' ratios {r['paired_ratio']:.2f}")
        elif "p99_over_echo" in r:
            print(f"{r['path']}: p99 {r['p99_over_echo']:.2f}x the echo's (medians); rounds "
                  + ", ".join(f"{x:.2f}" for x in r["p99_over_echo_rounds"]))
        elif "auth.check" in r["path"] and "(open loop)" not in r["path"] and "one request" not in r["path"]:
            print(f"{r['path']}: {r['per_s'] / base:.2f} of the echo baseline's throughput")
    paired = {r["path"]: r for r in rows if "paired_ratio" in r}
    here = next((r for p, r in paired.items() if p.startswith("auth.check, 1 instance, median")), None)
    there = next((r for p, r in paired.items() if args.beside_label and args.beside_label in p), None)
    if here is not None and there is not None:
        print(f"this checkout / {args.beside_label}: decisions/s {here['per_s'] / there['per_s']:.2f}x, "
              f"ratio to the echo {here['paired_ratio'] / there['paired_ratio']:.2f}x")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
