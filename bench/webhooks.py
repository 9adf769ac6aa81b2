"""Webhook deliveries (issue 31): one `python -m services.webhooks` instance against plain httpx and aiohttp loops, on
real servers (embedded NATS, PostgreSQL, S3) and a real HTTP receiver (tests/webhookreceiver.py, a process of its
own).

Events are `video.created` envelopes published into JetStream the way the outbox relay publishes them
(shared/publishers.EventPublishers, each PubAck awaited): "committed" is the envelope's `time`, set when it is
published, and "received" the receiver's arrival time (time.time(), the same clock). Each event goes to every
endpoint of its app (E endpoints: E deliveries), each endpoint its own path on the receiver.

Figures, in one run, each comparison alternating round by round (medians of the rounds):
 1. deliveries/s of the service with a bounded backlog (at most --window deliveries outstanding per endpoint)
    against E concurrent httpx loops (one AsyncClient each, as the service has one client per endpoint) POSTing
    the same bodies signed the same way, against one sequential loop, and against E concurrent aiohttp loops (a
    ClientSession each: the service's own HTTP client since it moved from httpx);
 2. committed -> received p50/p99 at half of the service's measured rate, offered open loop;
 3. the same with one more endpoint hanging (never answers): the other endpoints' p99 against 2's.
    python -m bench.webhooks [--seconds N] [--rounds R] [--endpoints E] [--window W] [--profile FILE]
        [--beside DIR]   (DIR: another commit's files, e.g. `git archive <commit> | tar -x -C DIR`: its service
                          measured in turn with this checkout's, at the same offered rates)
    (embedded servers; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL, WEIR_DATABASE_URL, WEIR_S3_ENDPOINT)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
import asyncpg
import httpx
import nats
import uvloop

from bench.api import service_env
from bench.bus import servers
from services.webhooks.signing import signed_headers
from shared.devstack.ports import free_port
from shared.events import VideoCreated, new_event
from shared.messaging import make_broker
from shared.outbox import bus_subject
from shared.publishers import EventPublishers, Outgoing
from shared.settings import CommonSettings
from shared.webhookcalls import CreateEndpoint, DeleteEndpoint, EndpointCreated, EndpointDeleted, call
from weir.up import prepare

Row = dict[str, Any]
HANG_PATH = "/hang"
SPAWN = mp.get_context("spawn")


def pct(values: Sequence[float], p: float) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else None


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


# ------------------------------------------------------------------------------------------- the receiver


def _receiver_main(conn: Connection, record: bool, hang_path: str | None) -> None:
    from tests.webhookreceiver import WebhookReceiver, hang, ok

    with WebhookReceiver(default=ok(), record=record) as r:
        if hang_path:
            r.route(hang_path, hang())
        conn.send(r.port)
        while True:
            command, arg = conn.recv()
            if command == "count":
                conn.send(r.count(arg))
            elif command == "arrivals":  # (path, arrival, the envelope's time) of each request
                conn.send([(q.path, q.time, datetime.fromisoformat(json.loads(q.body)["time"]).timestamp())
                           for q in r.requests() if q.path != hang_path])
            else:
                break
    conn.send("stopped")


class Receiver:
    """tests/webhookreceiver.WebhookReceiver in a process of its own (its CPU is not the sender's)."""

    def __init__(self, *, record: bool, hang_path: str | None = None) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_receiver_main, args=(child, record, hang_path), daemon=True)
        self.proc.start()
        self.port = self.conn.recv()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ask(self, command: str, arg: Any = None) -> Any:
        self.conn.send((command, arg))
        return self.conn.recv()

    def count(self, path: str | None = None) -> int:
        return int(self.ask("count", path))

    def stop(self) -> None:
        self.ask("stop")
        self.proc.join(10)


# -------------------------------------------------------------------------------- events and endpoints


@dataclass
class Bench:
    settings: CommonSettings
    nc: Any
    publishers: EventPublishers
    broker: Any
    pending: set[asyncio.Task[Any]] = field(default_factory=set)

    async def endpoints(self, app_id: str, account_id: str, urls: list[str]) -> list[EndpointCreated]:
        return [await call(self.nc, "endpoint.create", CreateEndpoint(app_id=app_id, account_id=account_id, url=u,
                                                                      events=["*"]), EndpointCreated)
                for u in urls]

    async def delete(self, app_id: str, account_id: str, made: list[EndpointCreated]) -> None:
        for e in made:
            await call(self.nc, "endpoint.delete", DeleteEndpoint(app_id=app_id, account_id=account_id,
                                                                  endpoint_id=e.endpoint.id), EndpointDeleted)

    async def publish(self, app_id: str, account_id: str, times: Sequence[datetime | None]) -> None:
        rows = []
        for t in times:
            video = uuid.uuid4().hex
            ev = new_event(VideoCreated(video_id=video, app_id=app_id, account_id=account_id), source="bench",
                           subject=video, time=t)
            rows.append(Outgoing(bus_subject(ev) or ev.type, ev.to_bytes(), ev.id))
        for result in await self.publishers.publish_in_order(rows):
            if isinstance(result, BaseException):
                raise result


def _ids() -> tuple[str, str]:
    return f"app{uuid.uuid4().hex[:12]}", f"acct{uuid.uuid4().hex[:12]}"


async def wait_count(rx: Receiver, paths: list[str], want: int, limit: float) -> int:
    deadline = time.monotonic() + limit
    while True:
        got = sum(rx.count(p) for p in paths)
        if got >= want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------ 1: deliveries/s


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def service_rate(b: Bench, e: int, seconds: float, warm: float, window: int, pid: int) -> Row:
    """The service's deliveries/s with at most `window` deliveries outstanding per endpoint (published, not yet
    received): saturated, with a backlog it keeps up with."""
    rx = Receiver(record=False)
    app, acct = _ids()
    paths = [f"/e{i}" for i in range(e)]
    made = await b.endpoints(app, acct, [rx.url(p) for p in paths])
    published = 0
    t0 = time.perf_counter()
    start: tuple[float, int] | None = None
    while True:
        got = rx.count()
        now = time.perf_counter()
        if start is None and now - t0 >= warm:
            start = (now, got)
            cpu0 = cpu_seconds(pid)
        if start is not None and now - start[0] >= seconds:
            end = (now, got)
            cpu = cpu_seconds(pid) - cpu0
            break
        room = (window * e - (published * e - got)) // e
        if room > 0:
            await b.publish(app, acct, [None] * room)
            published += room
        else:
            await asyncio.sleep(0.003)
    drained = await wait_count(rx, paths, published * e, 60)
    await b.delete(app, acct, made)
    rx.stop()
    return {"path": f"service, {e} endpoints", "per_s": (end[1] - start[1]) / (end[0] - start[0]),
            "drained": drained == published * e, "cpu_ms": cpu * 1000 / max(1, end[1] - start[1]),
            "cores": cpu / (end[0] - start[0])}


def _loops_main(queue: Any, url: str, paths: list[str], secret: str, seconds: float, warm: float,
                kind: str = "httpx") -> None:
    uvloop.run(_loops(queue, url, paths, secret, seconds, warm, kind))


async def _loops(queue: Any, url: str, paths: list[str], secret: str, seconds: float, warm: float,
                 kind: str) -> None:
    """One sequential loop per path, each its own AsyncClient (`kind` "httpx") or ClientSession ("aiohttp"),
    POSTing signed video.created envelopes."""
    app, acct = _ids()
    bodies = []
    for _ in range(2000):
        video = uuid.uuid4().hex
        ev = new_event(VideoCreated(video_id=video, app_id=app, account_id=acct), source="bench", subject=video)
        bodies.append((ev.id, ev.to_bytes()))
    done: list[float] = []
    t0 = time.perf_counter()
    stop_at = t0 + warm + seconds

    async def aiohttp_loop(path: str, offset: int) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                                         auto_decompress=False, timeout=aiohttp.ClientTimeout(total=10)) as session:
            i = offset
            while time.perf_counter() < stop_at:
                event_id, body = bodies[i % len(bodies)]
                i += 1
                headers = signed_headers(event_id, datetime.now(UTC), body, (secret,))
                async with session.post(f"{url}{path}", data=body, allow_redirects=False,
                                        headers={**headers, "Content-Type": "application/json"}) as r:
                    await r.read()
                    if 200 <= r.status < 300:
                        done.append(time.perf_counter())

    async def loop(path: str, offset: int) -> None:
        if kind == "aiohttp":
            return await aiohttp_loop(path, offset)
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=10,
                                     limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
            i = offset
            while time.perf_counter() < stop_at:
                event_id, body = bodies[i % len(bodies)]
                i += 1
                headers = signed_headers(event_id, datetime.now(UTC), body, (secret,))
                r = await client.post(f"{url}{path}", content=body,
                                      headers={**headers, "Content-Type": "application/json"})
                if r.is_success:
                    done.append(time.perf_counter())

    await asyncio.gather(*(loop(p, i * 97) for i, p in enumerate(paths)))
    counted = [t for t in done if t0 + warm <= t < stop_at]
    queue.put((len(counted) / seconds, time.process_time() * 1000 / max(1, len(done))))


def baseline_rate(e: int, seconds: float, warm: float, secret: str, kind: str = "httpx") -> Row:
    rx = Receiver(record=False)
    queue = SPAWN.Queue()
    proc = SPAWN.Process(target=_loops_main, args=(queue, rx.url(""), [f"/e{i}" for i in range(e)], secret,
                                                   seconds, warm, kind))
    proc.start()
    per_s, cpu_ms = queue.get(timeout=seconds + warm + 120)
    proc.join()
    rx.stop()
    what = f"1 sequential {kind} loop" if e == 1 else f"{e} concurrent {kind} loops"
    return {"path": what, "per_s": per_s, "cpu_ms": cpu_ms}


# ------------------------------------------------------------------------- 2 and 3: committed -> received


async def latency_run(b: Bench, e: int, rate: float, seconds: float, warm: float, hanging: bool) -> Row:
    """`rate` deliveries/s to the E endpoints (rate/E events/s) open loop, each event's time its scheduled time;
    with `hanging`, one more endpoint that never answers takes every event too. Latencies of the E only, after
    `warm` s."""
    rx = Receiver(record=True, hang_path=HANG_PATH if hanging else None)
    app, acct = _ids()
    paths = [f"/e{i}" for i in range(e)]
    made = await b.endpoints(app, acct, [rx.url(p) for p in paths + ([HANG_PATH] if hanging else [])])
    every = e / rate
    n = int((seconds + warm) / every)
    t0 = time.time() + 0.1
    i = 0
    while i < n:
        now = time.time()
        due = min(n, int((now - t0) / every) + 1)
        if due > i:
            times = [datetime.fromtimestamp(t0 + k * every, UTC) for k in range(i, due)]
            task = asyncio.create_task(b.publish(app, acct, times))  # open loop: the PubAcks are not waited on
            b.pending.add(task)
            task.add_done_callback(b.pending.discard)
            i = due
        await asyncio.sleep(max(0.0, t0 + i * every - time.time()))
    await asyncio.gather(*b.pending)
    got = await wait_count(rx, paths, n * e, 60)
    arrivals = rx.ask("arrivals")
    await b.delete(app, acct, made)
    rx.stop()
    lat = [arrived - sent for _, arrived, sent in arrivals if sent >= t0 + warm]
    return {"path": f"{'with' if hanging else 'without'} a hanging endpoint", "offered_per_s": rate,
            "deliveries": len(lat), "complete": got == n * e, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99)}


# ------------------------------------------------------------------------------------------------ the run


def start_service(settings: CommonSettings, profile: str | None, checkout: str | None = None
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m services.webhooks` of this checkout (or of `checkout`: another commit's files), ready."""
    port = free_port()
    env = {**os.environ, **service_env(settings), "WEIR_HTTP_PORT": str(port), "WEIR_WEBHOOK_ALLOW_PRIVATE": "true"}
    if checkout:
        env["PYTHONPATH"] = checkout
    head = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
    out = open(os.environ["WEIR_BENCH_SERVICE_LOG"], "ab") if os.environ.get("WEIR_BENCH_SERVICE_LOG") else None
    proc = subprocess.Popen([*head, "-m", "services.webhooks"], env=env, stdout=out or subprocess.DEVNULL,
                            stderr=out or subprocess.DEVNULL, cwd=checkout)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("services.webhooks did not become ready")
        time.sleep(0.1)


def stop_service(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Services:
    """One webhooks instance at a time: this checkout's, or the one beside (each started for its turn)."""

    def __init__(self, settings: CommonSettings, args: argparse.Namespace) -> None:
        self.settings, self.args = settings, args
        self.running: tuple[str, subprocess.Popen[bytes]] | None = None

    def use(self, variant: str) -> None:
        if self.running is not None and self.running[0] == variant:
            return
        self.stop()
        checkout = self.args.beside if variant == "beside" else None
        profile = self.args.profile if variant == "this" else None
        self.running = (variant, start_service(self.settings, profile, checkout)[0])

    @property
    def pid(self) -> int:
        assert self.running is not None
        return self.running[1].pid

    def stop(self) -> None:
        if self.running is not None:
            stop_service(self.running[1])
            self.running = None


async def settle(settings: CommonSettings) -> None:
    """A checkpoint before each latency run: the writes of the run before are not flushed during this one."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def run(settings: CommonSettings, args: argparse.Namespace) -> dict[str, Any]:
    await prepare(settings)
    services = Services(settings, args)
    services.use("this")
    nc = await nats.connect(settings.nats_url)
    broker = make_broker(settings, name="bench-webhooks")
    await broker.connect()
    publishers = EventPublishers(broker, ["video.created"], timeout=settings.bus_publish_timeout_seconds)
    await broker.start()
    b = Bench(settings, nc, publishers, broker)
    e, secs, warm = args.endpoints, args.seconds, args.warm
    variants = ["this", "beside"] if args.beside else ["this"]
    loop = asyncio.get_running_loop()
    try:
        secret = (await b.endpoints(*_ids(), ["http://127.0.0.1:9/unused"]))[0].secret  # a real whsec_ secret
        rates: dict[str, list[float]] = {}
        cpus: dict[str, list[float]] = {}
        for r in range(args.rounds if args.rate is None else 0):
            order = [*variants, "concurrent", "sequential", "aiohttp"]
            order = order[r % len(order):] + order[:r % len(order)]
            for what in order:
                if what in variants:
                    services.use(what)
                    row = await service_rate(b, e, secs, warm, args.window, services.pid)
                else:
                    row = await loop.run_in_executor(None, baseline_rate, 1 if what == "sequential" else e, secs,
                                                     warm, secret, "aiohttp" if what == "aiohttp" else "httpx")
                rates.setdefault(what, []).append(row["per_s"])
                cpus.setdefault(what, []).append(row["cpu_ms"])
                whose = f"the service's, {row['cores']:.2f} cores" if "cores" in row else "the loops'"
                print(f"round {r + 1}: {what}: {row['path']}: {row['per_s']:.0f}/s, {row['cpu_ms']:.2f} ms of CPU"
                      f" each ({whose})", flush=True)
        half = statistics.median(rates["this"]) / 2 if args.rate is None else args.rate
        runs: dict[str, list[Row]] = {}
        for r in range(args.rounds):
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                services.use(variant)
                for hanging in ((False, True) if r % 2 == 0 else (True, False)):
                    await settle(settings)
                    row = await latency_run(b, e, half, secs, warm, hanging)
                    runs.setdefault(f"{variant} {'hang' if hanging else 'plain'}", []).append(row)
                    print(f"round {r + 1}: {variant}: {row['path']}: {half:.0f}/s offered, p50 {ms(row['p50'])} ms,"
                          f" p99 {ms(row['p99'])} ms, complete {row['complete']}", flush=True)
    finally:
        await broker.stop()
        await nc.close()
        services.stop()
    return {"rates": rates, "cpus": cpus, "half": half, "runs": runs, "endpoints": e, "variants": variants}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rates, runs, e, variants = result["rates"], result["runs"], result["endpoints"], result["variants"]
    if not rates:
        rates = {k: [float("nan")] for k in [*variants, "concurrent", "sequential", "aiohttp"]}
    med = {k: statistics.median(v) for k, v in rates.items()}
    names = {"this": "webhooks service (this checkout)", "beside": f"webhooks service ({args.beside})"}
    print(f"\n1. deliveries/s, {e} endpoints, medians of {args.rounds} rounds of {args.seconds:g} s (each round's):")
    for k, label in [*((v, names[v]) for v in variants),
                     ("concurrent", f"{e} concurrent httpx loops (a client each)"),
                     ("sequential", "1 sequential httpx loop"),
                     ("aiohttp", f"{e} concurrent aiohttp loops (a session each)")]:
        cpu = statistics.median(result["cpus"][k]) if result.get("cpus") else float("nan")
        print(f"   {label:46} {med[k]:8.0f}/s   {' '.join(f'{x:.0f}' for x in rates[k]):18} CPU {cpu:.2f} ms each")
    for v in variants:
        print(f"   {v}: service / {e} concurrent loops: {med[v] / med['concurrent']:.2f} (target >= 0.7); "
              f"/ 1 sequential loop: {med[v] / med['sequential']:.2f}; / {e} concurrent aiohttp loops: "
              f"{med[v] / med['aiohttp']:.2f}")

    def m(key: str, field: str) -> float:
        return float(statistics.median(r[field] for r in runs[key] if r[field] is not None))

    print(f"\n2./3. committed -> received at {result['half']:.0f} deliveries/s offered (half this checkout's rate), "
          f"open loop, medians of {args.rounds} rounds:")
    for v in variants:
        for hanging in (False, True):
            key = f"{v} {'hang' if hanging else 'plain'}"
            label = f"{v}, " + ("without a hanging endpoint" if not hanging else f"with a {e + 1}th endpoint hanging")
            print(f"   {label:42} p50 {ms(m(key, 'p50')):>7} ms   p99 {ms(m(key, 'p99')):>7} ms   rounds p99: "
                  f"{' '.join(ms(r['p99']) for r in runs[key])}")
        print(f"   {v}: p99 without hang {ms(m(f'{v} plain', 'p99'))} ms (target <= 100); with / without the hanging"
              f" endpoint {m(f'{v} hang', 'p99') / m(f'{v} plain', 'p99'):.2f} (target <= 1.2)")
    print(json.dumps({"rates": rates, "cpus": result.get("cpus"), "half": result["half"], "runs": runs,
                      "load_average": os.getloadavg()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10, help="measured seconds of each run")
    parser.add_argument("--warm", type=float, default=2, help="seconds of each run before measuring")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--window", type=int, default=16, help="deliveries outstanding per endpoint in 1.")
    parser.add_argument("--profile", help="run this checkout's service under cProfile, its output to this file")
    parser.add_argument("--rate", type=float, help="skip 1. and offer this many deliveries/s in 2. and 3.")
    parser.add_argument("--beside", help="a checkout of another commit (git archive), its service run in turn")
    args = parser.parse_args()
    with servers() as settings:
        result = asyncio.run(run(settings, args))
    report(result, args)


if __name__ == "__main__":
    main()
