"""GET /v1/videos/{id} with auth and limits on, beside the same route with a fixed identity; full uploads per second.

Each server is its own process; wrk loads them in turn in mirrored rounds (`round_order`) and each path reports
requests/s, latency and CPU per request; then full uploads (create, initiate, part URL, PUT, complete) a few at a
time. The figure to read is the median of the rounds' ratios. Each api under test has a core of its own (`cores`).
    python -m bench.api [--seconds S] [--connections C] [--uploads N] [--rounds R] [--mirrors M]
                        [--tracing] [--pool] [--no-seam] [--shared-cores]      (needs wrk: apt-get install wrk)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import imageio_ffmpeg
import nats

from bench.bus import servers
from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.devstack.ports import free_port
from shared.settings import CommonSettings
from weir.up import prepare

Row = dict[str, Any]
T = TypeVar("T")
UPLOADS_PATH = "full uploads (create, initiate, part URL, PUT, complete)"
UPLOAD_CONCURRENCY = 4  # uploads in flight at once (fewer when fewer are asked for)
WARM_SECONDS = 2


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `low`, refused with a usage error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def cores(own_core: bool) -> tuple[set[int], set[int]] | None:
    """(the api's core, everyone else's cores) when an api under test gets a core of its own, as when it is deployed
    on its own machine and auth, NATS and wrk do not take its CPU; None to share them all (asked for with
    --shared-cores, which measures how much of the api's core they take, or fewer than 2 cores to split)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not own_core or len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def place(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` on `cpus` (threads it starts later inherit the placement of the one starting them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def start(module: str, env: dict[str, str], cpus: set[int] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A service process, ready; placed on `cpus` when given (otherwise where this process may run)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env, "WEIR_HTTP_PORT": str(port)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                if cpus is not None:
                    place(proc.pid, cpus)
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{module} did not become ready")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_times() -> dict[str, tuple[int, int, int]]:
    """Each core's (busy, stolen, total) clock ticks so far, from /proc/stat: stolen is the time the host ran
    something else when this core had work (busy counts it too: idle and iowait are the only ticks not busy)."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(f) for f in fields[:8]]
            times[name[3:]] = (sum(ticks) - ticks[3] - ticks[4], ticks[7], sum(ticks))
    return times


def wrk(url: str, headers: dict[str, str], seconds: int, connections: int,
        watch: dict[str, int] | None = None) -> Row:
    """One wrk run; with `watch` ({name: pid}), each process's CPU per request (us) as `cpu_us_<name>`, and how
    busy each core was (`busy_<core>`, a fraction)."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", url]
    for k, v in headers.items():
        args[1:1] = ["-H", f"{k}: {v}"]
    before = {name: cpu_seconds(pid) for name, pid in (watch or {}).items()}
    cores_before = core_times()
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    used = {name: cpu_seconds(pid) - before[name] for name, pid in (watch or {}).items()}
    busy: dict[str, float] = {}
    for core, (b, st, t) in (core_times().items() if watch else ()):
        if core in cores_before:
            b0, st0, t0 = cores_before[core]
            busy[f"busy_{core}"], busy[f"stolen_{core}"] = (b - b0) / max(1, t - t0), (st - st0) / max(1, t - t0)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]

    requests = max(1.0, rps * seconds)
    return {"per_s": round(rps, 1), "p50_ms": round(pct("50"), 3), "p99_ms": round(pct("99"), 3),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            **{f"cpu_us_{name}": round(cpu * 1e6 / requests, 1) for name, cpu in used.items()},
            **{name: round(fraction, 3) for name, fraction in busy.items()}}


@dataclass(frozen=True)
class Variant:
    """One more api beside the guarded one, compared with it in the same rounds."""

    name: str
    module: str
    label: str  # its row in the table
    summary: str  # its line under the table: this over the guarded api
    settings: tuple[tuple[str, str], ...] = ()
    traced: bool = False  # spans written to the run's trace files

    def env(self, traces_dir: str) -> dict[str, str]:
        return {**dict(self.settings), **({"WEIR_TRACES_DIR": traces_dir} if self.traced else {})}


VARIANTS = (
    Variant("traced", "services.api", "the same, tracing on (default sampling, spans to files)",
            "tracing on (default sampling) / off", traced=True),
    Variant("traced_all", "services.api", "the same, tracing on, every read recorded",
            "tracing on (every read recorded) / off", (("WEIR_TRACE_READ_RATIO", "1"),), traced=True),
    Variant("pool_reset", "bench.api_pool", "the same, asyncpg's reset query on every release",
            "asyncpg's pool reset / none (shared.db)", (("WEIR_BENCH_POOL", "reset"),)),
    Variant("pool_queue", "bench.api_pool", "the same, asyncpg's own queue of connections",
            "asyncpg's queue / FairPool (shared.db)", (("WEIR_BENCH_POOL", "queue"),)),
)


def beside(checkout: str) -> Variant:
    """The guarded api of another checkout (its code on PYTHONPATH), e.g. the previous commit's."""
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or checkout
    return Variant("beside", "services.api", f"the guarded api at {commit}", f"the guarded api at {commit} / this one",
                   (("PYTHONPATH", str(Path(checkout).resolve())),))


def settle(pids: list[int], *, window: float = 0.3, idle: float = 0.05, limit: float = 5.0) -> None:
    """Wait until the processes together use less than `idle` of a core over `window` seconds (at most `limit`): a
    traced api still writing spans, or auth's background work, would otherwise slow the next path."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(window)
        if sum(cpu_seconds(p) for p in pids) - before < idle * window:
            return


def combined(halves: list[Row]) -> Row:
    """One path's figures in a round from its runs of equal length: requests over time (the mean of the rates),
    the mean p50, the larger p99, non-2xx summed, CPU per request weighted by requests."""
    total = sum(h["per_s"] for h in halves)
    out: Row = {"per_s": round(total / len(halves), 1),
                "p50_ms": round(statistics.fmean(h["p50_ms"] for h in halves), 3),
                "p99_ms": max(h["p99_ms"] for h in halves),
                "non_2xx": sum(h["non_2xx"] for h in halves)}
    for key in (k for k in halves[0] if k.startswith("cpu_us_")):
        out[key] = round(sum(h[key] * h["per_s"] for h in halves) / max(total, 1e-9), 1)
    for key in (k for k in halves[0] if k.startswith(("busy_", "stolen_"))):
        out[key] = round(statistics.fmean(h[key] for h in halves), 3)
    return out


def described(row: Row) -> str:
    """A path's figures in one round, on one line: rate, p50, CPU per request, each core's busy share."""
    cpu = ", ".join(f"{k[len('cpu_us_'):]} {v:.0f}" for k, v in row.items() if k.startswith("cpu_us_"))
    busy = ", ".join(f"{k[len('busy_'):]} {v:.0%} ({row.get('stolen_' + k[len('busy_'):], 0):.0%} stolen)"
                     for k, v in row.items() if k.startswith("busy_"))
    return f"{row['per_s']:.0f}/s, p50 {row['p50_ms']:.1f} ms, CPU us/request: {cpu}; cores busy: {busy}"


def round_order(paths: list[T], i: int, mirrors: int) -> list[T]:
    """The runs of round `i`: P1 .. Pn Pn .. P1, `mirrors` times over (from Pn in odd rounds). On shared cores the
    machine's speed drifts more than the differences measured; mirrored runs sit symmetrically around the round's
    middle, so a drift weighs on every path alike (more, shorter mirrors narrow the rounds' spread)."""
    order = paths if i % 2 == 0 else paths[::-1]
    return [*order, *order[::-1]] * mirrors


def mirrored_round(paths: list[tuple[str, str, dict[str, int]]], i: int, route: str, headers: dict[str, str],
                   seconds: int, connections: int, mirrors: int = 1) -> dict[str, Row]:
    """Round `i` (`round_order`): each path runs 2 x `mirrors` times, `seconds` in all (each run at least 1 s)."""
    part = max(1, round(seconds / (2 * mirrors)))
    pids = sorted({pid for _, _, watch in paths for pid in watch.values()})
    parts: dict[str, list[Row]] = {}
    for name, url, watch in round_order(paths, i, mirrors):
        settle(pids)
        parts.setdefault(name, []).append(wrk(f"{url}{route}", headers, part, connections, watch))
    return {name: combined(rows) for name, rows in parts.items()}


def service_env(settings: CommonSettings) -> dict[str, str]:
    """The environment of services started beside `servers()`: their addresses, fresh secrets, quiet logs, and the
    per-key and per-account limits out of the way (one key sends everything)."""
    return {
        "WEIR_NATS_URL": settings.nats_url, "WEIR_DATABASE_URL": settings.database_url,
        "WEIR_S3_ENDPOINT": settings.s3_endpoint, "WEIR_S3_ACCESS_KEY": settings.s3_access_key,
        "WEIR_S3_SECRET_KEY": settings.s3_secret_key.get_secret_value(),
        "WEIR_KEY_HASH_SECRET": secrets.token_urlsafe(32), "WEIR_UPLOAD_TOKEN_SECRET": secrets.token_urlsafe(32),
        "WEIR_INTERNAL_TOKEN": secrets.token_urlsafe(32), "WEIR_LOG_LEVEL": "WARNING",
        "WEIR_LIMIT_KEY_PER_MINUTE": str(10**9), "WEIR_LIMIT_OWNER_PER_MINUTE": str(10**9),
    }


async def provision(settings: CommonSettings) -> tuple[AccountCreated, AppCreated]:
    nc = await nats.connect(settings.nats_url)
    try:
        return await create_account_with_app(nc, "bench")
    finally:
        await nc.close()


async def uploads(api: str, key: str, data: bytes, n: int, concurrency: int) -> Row:
    if n < 1 or concurrency < 1:
        raise ValueError("uploads needs at least one upload and one in flight (main skips --uploads 0)")
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    todo = list(range(n))

    async def one(http: httpx.AsyncClient) -> None:
        while todo:
            todo.pop()
            t0 = time.perf_counter()
            video = (await http.post("/v1/videos", json={"name": "b"}, headers=headers)).json()
            path = f"/v1/videos/{video['id']}/upload"
            await http.post(path, json={"content_type": "video/mp4"}, headers=headers)
            part = (await http.post(f"{path}/parts", json={"part_numbers": [1]}, headers=headers)).json()["parts"][0]
            etag = (await http.put(part["url"], content=data)).headers["etag"]
            done = await http.post(f"{path}/complete", json={"parts": [{"part_number": 1, "etag": etag}]},
                                   headers=headers)
            assert done.status_code == 200, done.text
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=api, timeout=60) as http:
        await asyncio.gather(*(one(http) for _ in range(concurrency)))
    secs = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"per_s": round(n / secs, 2), "p50_ms": round(lat[len(lat) // 2] * 1000, 1),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 1), "non_2xx": 0}


def tiny_mp4() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.mp4"
        subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "lavfi", "-i",
                        "testsrc=size=320x240:rate=10:duration=1", "-c:v", "libx264", "-preset", "ultrafast",
                        "-movflags", "+faststart", str(out)], check=True)
        return out.read_bytes()


def traces_written(traces_dir: Path) -> dict[str, int]:
    """Spans written to the trace files, by name: what each traced api recorded."""
    names: dict[str, int] = {}
    for f in traces_dir.glob("*.jsonl"):
        for line in f.open():
            for group in json.loads(line).get("resourceSpans", []):
                for scope in group["scopeSpans"]:
                    for span in scope["spans"]:
                        names[span["name"]] = names.get(span["name"], 0) + 1
    return names


def median(runs: list[Row]) -> Row:
    """Each figure's median over the runs (one run: that run), rounded as the runs' own figures are; non-2xx
    answers are summed, so one bad round is not hidden by the others."""
    out: Row = {}
    for k in runs[0]:
        if k == "non_2xx":
            out[k] = sum(r[k] for r in runs)
        else:  # the median of an even number of runs is a mean of two: round off its float noise
            out[k] = round(statistics.median(r[k] for r in runs), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=at_least(1), default=10, help="each wrk run's duration (at least 1)")
    parser.add_argument("--connections", type=at_least(1), default=32, help="wrk's connections (at least 1)")
    parser.add_argument("--uploads", type=at_least(0), default=60, help="full uploads to time (0: skip them)")
    parser.add_argument("--rounds", type=at_least(1), default=1,
                        help="alternate baseline and auth this many times (at least 1); medians")
    parser.add_argument("--mirrors", type=at_least(1), default=2,
                        help="each round is P1..Pn Pn..P1 this many times over, in runs of --seconds / (2 x this): "
                             "shorter runs, closer in time, so a change of the machine's speed weighs on every "
                             "path alike (at least 1)")
    parser.add_argument("--tracing", action="store_true",
                        help="also two apis with tracing on (spans exported to files, WEIR_TRACES_DIR): the default "
                             "sampling and every read recorded, in the same rounds: throughput over the untraced "
                             "api's (issue 15 wants at least 0.9)")
    parser.add_argument("--pool", action="store_true",
                        help="also the guarded api with asyncpg's reset query on every release, and with asyncpg's "
                             "own queue of connections (bench/api_pool.py), in the same rounds: what "
                             "shared.db.create_pool changes")
    parser.add_argument("--shared-cores", action="store_true",
                        help="let every process run on any core (by default each api under test has a core of its "
                             "own and the servers, auth and wrk the others)")
    parser.add_argument("--no-seam", action="store_true",
                        help="auth.check on auth's FastStream subscriber (bench/auth_unbatched.py) instead of its "
                             "batched subscription: what the seam buys")
    parser.add_argument("--beside", metavar="CHECKOUT", default="",
                        help="also the guarded api of this checkout (e.g. a worktree of the previous commit), against "
                             "the same auth, in the same rounds")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench.api needs wrk (apt-get install wrk)")
    rows: list[Row] = []
    split = cores(not args.shared_cores)
    api_cpus = None
    if split is not None:
        api_cpus, others = split
        os.sched_setaffinity(0, others)  # inherited by the servers, auth and wrk started from here
        print(f"cores: each api under test on {sorted(api_cpus)}; servers, auth, wrk on {sorted(others)}")
    else:
        print("cores: shared by every process")
    with servers() as settings:
        asyncio.run(prepare(settings))
        env = service_env(settings)
        procs = []
        try:
            auth, _ = start("bench.auth_unbatched" if args.no_seam else "services.auth", env)
            procs.append(auth)
            api, api_url = start("services.api", env, api_cpus)
            procs.append(api)
            account, app = asyncio.run(provision(settings))
            headers = {"Authorization": f"Bearer {app.secret_key}"}
            video = httpx.post(f"{api_url}/v1/videos", json={"name": "bench"}, headers=headers).json()
            identity = {"app_id": app.id, "account_id": account.account_id, "key_id": app.secret_key_id}
            baseline, base_url = start("bench.api_baseline", {**env, "WEIR_BENCH_IDENTITY": json.dumps(identity)},
                                       api_cpus)
            procs.append(baseline)
            route = f"/v1/videos/{video['id']}"
            warm = min(WARM_SECONDS, args.seconds)  # a short measurement gets a warm-up no longer than itself
            # each round runs every path twice, mirrored (mirrored_round)
            paths = [("baseline", base_url, {"edge": baseline.pid}),
                     ("auth", api_url, {"edge": api.pid, "auth": auth.pid})]
            traces = tempfile.TemporaryDirectory(prefix="weir-bench-traces-")
            wanted = {*(("traced", "traced_all") if args.tracing else ()),
                      *(("pool_reset", "pool_queue") if args.pool else ())}
            variants = [v for v in VARIANTS if v.name in wanted]
            if args.beside:
                variants.append(beside(args.beside))
            for variant in variants:  # each one more api beside the guarded one, compared with it round by round
                other, other_url = start(variant.module, {**env, **variant.env(traces.name)}, api_cpus)
                procs.append(other)
                paths.append((variant.name, other_url, {"edge": other.pid, "auth": auth.pid}))
            for _ in range(2):  # warm each, then measure each in turn
                for _, url, _ in paths:
                    wrk(f"{url}{route}", headers, warm, args.connections)
            runs: dict[str, list[Row]] = {name: [] for name, _, _ in paths}
            for i in range(args.rounds):
                for name, row in mirrored_round(paths, i, route, headers, args.seconds, args.connections,
                                                args.mirrors).items():
                    runs[name].append(row)
                    print(f"round {i + 1}, {name}: {described(row)}", flush=True)
            bases, reals = runs["baseline"], runs["auth"]
            pairs = [(r["per_s"] / b["per_s"], r["p50_ms"] / b["p50_ms"]) for b, r in zip(bases, reals, strict=True)]
            if args.rounds > 1:
                print("rounds (throughput with auth / baseline, p50 with auth / baseline): "
                      + ", ".join(f"{t:.2f} {p:.2f}" for t, p in pairs))
            paired = {"throughput": statistics.median(t for t, _ in pairs),
                      "p50": statistics.median(p for _, p in pairs)}
            rows.append({"path": "baseline: GET /v1/videos/{id}, fixed identity", **median(bases)})
            rows.append({"path": "GET /v1/videos/{id}, auth.check and limits on", **median(reals)})
            for variant in variants:
                other_runs = runs[variant.name]
                vpairs = [(o["per_s"] / r["per_s"], o["p50_ms"] / r["p50_ms"])
                          for r, o in zip(reals, other_runs, strict=True)]
                print(f"rounds (throughput {variant.name} / the guarded api, p50 {variant.name} / the guarded api): "
                      + ", ".join(f"{a:.2f} {b:.2f}" for a, b in vpairs))
                paired[f"{variant.name}_throughput"] = statistics.median(a for a, _ in vpairs)
                paired[f"{variant.name}_p50"] = statistics.median(b for _, b in vpairs)
                rows.append({"path": variant.label, **median(other_runs)})
            if args.tracing:
                print(f"spans written: {traces_written(Path(traces.name))}")
            if args.uploads:
                rows.append({"path": UPLOADS_PATH, **asyncio.run(
                    uploads(api_url, app.secret_key, tiny_mp4(), args.uploads, min(UPLOAD_CONCURRENCY, args.uploads))
                )})
            else:
                rows.append({"path": UPLOADS_PATH, "skipped": "--uploads 0"})
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(30)
    print(f"{'path':58} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['path']:58} skipped ({r['skipped']})")
        else:
            print(f"{r['path']:58} {r['per_s']:>9} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['non_2xx']:>8}")
    for r in rows:
        cpu = ", ".join(f"{k[len('cpu_us_'):]} {v}" for k, v in r.items() if k.startswith("cpu_us_"))
        if cpu:
            print(f"{r['path']:58} CPU per request, us (median): {cpu}")
    print(f"median of the rounds' ratios (each round mirrored, P1..Pn Pn..P1): throughput with auth / baseline "
          f"{paired['throughput']:.2f}; p50 with auth / baseline {paired['p50']:.2f}")
    print(f"ratio of the medians above: throughput {rows[1]['per_s'] / rows[0]['per_s']:.2f}; "
          f"p50 {rows[1]['p50_ms'] / rows[0]['p50_ms']:.2f}")
    for variant in VARIANTS:
        if f"{variant.name}_throughput" in paired:
            print(f"{variant.summary}, median of the rounds' ratios: throughput "
                  f"{paired[f'{variant.name}_throughput']:.2f}; p50 {paired[f'{variant.name}_p50']:.2f}")
    print(json.dumps({"rows": rows, "paired_ratios": paired}))


if __name__ == "__main__":
    main()
