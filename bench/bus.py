"""Events per second and latency through the outbox path (writers, relay, consumer, each its own process).

Latency runs from the commit of the writer's transaction to the commit of the consumer's effect (each stamped with
the host's clock by its own process), past a warm-up (`--warmup`, the first second's events: the processes' first
turns, 70-130 ms at worst), and beside it over every event and from the event's creation, before the writer's
transaction.
Figures: drain (a full outbox), live (writers at full speed), half (writers at half the live rate), lone (one writer
at a few events a second).
Baselines in the same run: plain JetStream publish and ack, and the writers alone without and with the outbox row.
Every measured part runs on uvloop, as the services do (shared/runtime.main); `--loop asyncio` runs them on the
default loop, as this bench did before 2026-12-07.
    python -m bench.bus [--events N] [--writers W] [--lone N] [--lone-rate R] [--warmup S] [--transport T]
    (embedded servers; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL, WEIR_DATABASE_URL, WEIR_S3_ENDPOINT)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import uvloop
from nats.js import api

from shared import db
from shared.bus import connect
from shared.consumer import ConsumerSpec, EventConsumer
from shared.devstack.runfiles import read_pid_file
from shared.devstack.stack import DevStack
from shared.events import Envelope, Event, VideoCreated, new_event
from shared.messaging import make_broker
from shared.outbox import OutboxRelay, Transport, change_with_events, use_transport
from shared.publishers import EventPublishers
from shared.settings import CommonSettings
from shared.streams import StreamSpec, apply_streams
from shared.walrelay import WalRelay, drop_slot, ensure_slot

BENCH_STREAM = StreamSpec("BENCH", ("bench.>",), "benchmark baseline", max_age_seconds=3600)
Row = dict[str, Any]
LOOPS = {"uvloop": uvloop.run, "asyncio": asyncio.run}
LOOP_ENV = "WEIR_BENCH_BUS_LOOP"  # --loop, for the spawned processes (each imports this module afresh)


@contextlib.contextmanager
def servers_and_stack() -> Iterator[tuple[CommonSettings, DevStack | None]]:
    """Embedded durable servers (and their DevStack), or with WEIR_BENCH_EXTERNAL=1 the WEIR_* ones (no stack)."""
    if os.environ.get("WEIR_BENCH_EXTERNAL") == "1":
        yield CommonSettings(), None
        return
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        stack = DevStack(Path(tmp) / "servers", durable=True)
        a = stack.start()
        try:
            yield CommonSettings(
                nats_url=a.nats_url, database_url=a.database_url, s3_endpoint=a.s3_endpoint,
                s3_access_key=a.s3_access_key, s3_secret_key=a.s3_secret_key,
            ), stack
        finally:
            stack.stop()


@contextlib.contextmanager
def servers() -> Iterator[CommonSettings]:
    with servers_and_stack() as (settings, _):
        yield settings


def _cpu_tree(pid: int) -> float:
    """CPU seconds of a process, its reaped children and its live descendants (a server and its workers)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # gone meanwhile
        return 0.0
    own = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return own + sum(_cpu_tree(int(child)) for child in children)


def server_cpu(stack: DevStack | None) -> dict[str, float]:
    """CPU seconds so far of the embedded NATS and PostgreSQL (none with external servers)."""
    if stack is None:
        return {}
    found = {name: read_pid_file(stack.data_dir / "run" / f"{name}.pid") for name in ("nats", "postgres")}
    return {name: _cpu_tree(pid_ports[0]) for name, pid_ports in found.items() if pid_ports is not None}


def cpu_per_event(n: int, roles: dict[str, float], before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Microseconds of CPU per event of each process role and server over a run."""
    spent = {**roles, **{name: after[name] - before[name] for name in after if name in before}}
    return {name: round(seconds / n * 1e6) for name, seconds in spent.items()}


def summary(name: str, n: int, seconds: float, latencies: list[float]) -> Row:
    lat = sorted(latencies)
    return {
        "path": name,
        "events": n,
        "seconds": round(seconds, 3),
        "events_per_s": round(n / seconds, 1),
        "p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
        "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 2) if lat else None,
    }


# ------------------------------------------------------------------------------------------ baseline


async def baseline(settings: CommonSettings, n: int) -> Row:
    nc = await connect(settings, name="bench-baseline")
    js = nc.jetstream()
    await apply_streams(js, settings, (BENCH_STREAM,))
    subject = f"bench.{uuid.uuid4().hex[:8]}"
    sub = await js.pull_subscribe(subject, durable=f"b{uuid.uuid4().hex[:8]}", stream="BENCH")
    latencies: list[float] = []

    async def consume() -> None:
        while len(latencies) < n:
            with contextlib.suppress(TimeoutError):
                for m in await sub.fetch(256, timeout=1):
                    latencies.append(time.time() - json.loads(m.data)["t"])
                    await m.ack()

    task = asyncio.create_task(consume())
    t0 = time.perf_counter()
    futures = []
    for i in range(n):
        payload = json.dumps({"i": i, "t": time.time()}).encode()
        futures.append(await js.publish_async(subject, payload, headers={"Nats-Msg-Id": f"{subject}-{i}"}))
        if len(futures) >= 1000:
            await asyncio.gather(*futures)
            futures.clear()
    await asyncio.gather(*futures)
    await task
    elapsed = time.perf_counter() - t0
    await js.delete_stream("BENCH")
    await nc.close()
    return summary("baseline: JetStream publish -> pull consumer", n, elapsed, latencies)


# ----------------------------------------------------------------------------------- the outbox path


def _event() -> Envelope:
    vid = str(uuid.uuid4())
    return new_event(VideoCreated(video_id=vid, app_id=vid, account_id=vid), source="bench", subject=vid)


async def _write(
    settings: CommonSettings, schema: str, n: int, writers: int, rate: float | None, outbox: bool = True,
    ready: Any = None, one_statement: bool = False, transport: Transport = "table",
) -> tuple[float, float, dict[str, float]]:
    """n transactions by `writers` connections, each a state row (and, with `outbox`, its event in the outbox);
    returns the wall-clock start and end, and when each event's transaction committed (by event id).
    `ready`: a barrier every writer process passes before it starts.
    `one_statement`: each write its own statement, without BEGIN and COMMIT around it (as the api creates a video:
    `change_with_events` needs no transaction), else in a transaction as most of a service's writes.
    `transport`: where the events go (CommonSettings.outbox_transport)."""
    use_transport(transport)
    pool = await db.create_pool(settings.database_url, schema=schema, max_size=writers)
    if ready is not None:
        ready.wait()  # the processes start together (spawning one takes a second or more)
    remaining = n
    committed: dict[str, float] = {}
    started = time.time()
    t0 = time.perf_counter()

    async def writer() -> None:
        nonlocal remaining
        while remaining > 0:
            i = n - remaining
            remaining -= 1
            if rate is not None:  # hold the offered load to `rate` events per second
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            ev = _event()
            async with pool.acquire() as c, (contextlib.nullcontext() if one_statement else c.transaction()):
                if outbox:
                    await change_with_events(c, "INSERT INTO state (id) VALUES ($1)", ev.subject, events=(ev,))
                else:
                    await c.execute("INSERT INTO state (id) VALUES ($1)", ev.subject)
            committed[str(ev.id)] = time.time()

    await asyncio.gather(*(writer() for _ in range(writers)))
    ended = time.time()
    await pool.close()
    return started, ended, committed


class _Stamps:
    """The relay's hooks, used as a clock: when it took each event and when JetStream acknowledged it (by id)."""

    def __init__(self) -> None:
        self.selected: dict[str, float] = {}
        self.acked: dict[str, float] = {}

    async def after_select(self, ids: list[str]) -> None:
        now = time.time()
        self.selected.update((i, now) for i in ids)

    async def after_publish(self, ids: list[str]) -> None:
        now = time.time()
        self.acked.update((i, now) for i in ids)


async def _relay(settings: CommonSettings, schema: str, stop_after: int, legacy_copies: bool,
                 ready: Any = None, transport: Transport = "table") -> _Stamps:
    """Relays until `stop_after` events went out; returns when it took and published each."""
    broker = make_broker(settings, name="bench-relay")
    await broker.connect()
    publishers = EventPublishers(broker, ["video.created"], timeout=settings.bus_publish_timeout_seconds)
    await broker.start()
    pool = await db.create_pool(settings.database_url, schema=schema, max_size=4)
    relay = OutboxRelay(pool=pool, publishers=publishers, dsn=settings.database_url, schema=schema,
                        batch_size=settings.outbox_batch_size, poll_seconds=0.05, legacy_copies=legacy_copies,
                        linger_seconds=settings.outbox_linger_ms / 1000,
                        recheck_seconds=settings.outbox_recheck_ms / 1000, hooks=(stamps := _Stamps()))
    wal = WalRelay(dsn=settings.database_url, schema=schema, table=relay, batch_size=settings.outbox_batch_size,
                   recheck_seconds=settings.outbox_recheck_ms / 1000, hooks=stamps) if transport == "wal" else None
    stop = asyncio.Event()
    task = asyncio.create_task((wal or relay).run(stop))
    if ready is not None:  # running: the writers may start
        await asyncio.to_thread(ready.wait)
    while True:
        if wal is not None:
            if wal.published >= stop_after:
                break
        else:
            async with pool.acquire() as c:
                if await c.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL") >= stop_after:
                    break
        await asyncio.sleep(0.2)
    stop.set()
    await task
    await pool.close()
    await broker.stop()
    return stamps


_handler_started: dict[str, float] = {}  # the consumer process's: when the handler took each event (by event id)


async def _effect(c: asyncpg.Connection, ev: Event[VideoCreated]) -> None:
    _handler_started.setdefault(str(ev.id), time.time())
    await c.execute("INSERT INTO effects (event_id) VALUES ($1)", ev.id)


async def _consume(settings: CommonSettings, schema: str, durable: str, n: int,
                   ready: Any = None) -> tuple[float, list[float], dict[str, float], dict[str, float]]:
    """Consumes n events: the seconds from the first to the last, each event's latency from its creation, and
    when each event's effect committed and its handler started (by event id)."""
    broker = make_broker(settings, name="bench-consumer")
    nc = await broker.connect()
    pool = await db.create_pool(settings.database_url, schema=schema, max_size=settings.consumer_concurrency + 2)
    latencies: list[float] = []
    handled: dict[str, float] = {}
    done = asyncio.Event()
    first: list[float] = []

    def committed(applied: list[Event[Any]]) -> None:
        now = time.time()
        if not first:
            first.append(time.perf_counter())
        latencies.extend(now - ev.time.timestamp() for ev in applied)
        handled.update((str(ev.id), now) for ev in applied)
        if len(latencies) >= n:
            done.set()

    consumer = EventConsumer(ConsumerSpec(name=durable, handler=_effect), pool=pool, settings=settings,
                             after_commit=committed)
    consumer.register(broker)
    await consumer.ensure(nc.jetstream())  # made by _setup, at the end of the stream
    await broker.start()
    consumer.start()
    if ready is not None:  # consuming: the writers may start
        await asyncio.to_thread(ready.wait)
    await done.wait()
    end = time.perf_counter()
    await asyncio.gather(*(sub.stop() for sub in broker.subscribers))
    await consumer.drain()
    await broker.stop()
    await pool.close()
    return end - first[0], latencies, handled, _handler_started


def _proc(fn: str, queue: Any, *args: Any) -> None:
    started = time.process_time()  # the process's imports before this are not the run's
    result = LOOPS[os.environ.get(LOOP_ENV, "uvloop")](globals()[fn](*args))
    queue.put((fn, result, time.process_time() - started))


def _gather(procs: list[Any], queue: Any) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Start the processes and wait for them: each function's results (one per process), and the CPU seconds of
    each function's processes together, by role."""
    for p in procs:
        p.start()
    results: dict[str, list[Any]] = {}
    cpu: dict[str, float] = {}
    for _ in procs:
        fn, result, seconds = queue.get(timeout=600)
        results.setdefault(fn, []).append(result)
        cpu[fn] = cpu.get(fn, 0.0) + seconds
    for p in procs:
        p.join()
    return results, {ROLES[fn]: seconds for fn, seconds in cpu.items()}


ROLES = {"_write": "writers", "_relay": "relay", "_consume": "consumer"}


def _spread(n: int, writers: int, writer_procs: int, rate: float | None) -> list[tuple[int, int, float | None]]:
    """Each writer process's share: (events, connections, rate)."""
    share = n // writer_procs
    return [(share if i else n - share * (writer_procs - 1), max(1, writers // writer_procs),
             rate / writer_procs if rate else None) for i in range(writer_procs)]


def writers_run(settings: CommonSettings, n: int, writers: int, outbox: bool, writer_procs: int = 2,
                relay_awake: bool = True, stack: DevStack | None = None, one_statement: bool = False,
                transport: Transport = "table") -> Row:
    """The live writers alone (no relay, no consumer): the same state rows, with or without their outbox rows.
    `relay_awake`: the outbox says a relay is awake, as under load (writers then skip NOTIFY, shared/outbox.py);
    without, every commit notifies, as when no relay runs or one sleeps."""
    schema, _ = asyncio.run(_setup(settings, transport))
    if relay_awake:
        asyncio.run(_say_relay_awake(settings, schema))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ready = ctx.Barrier(writer_procs)
    procs = [ctx.Process(target=_proc, args=("_write", queue, settings, schema, count, conns, None, outbox, ready,
                                             one_statement, transport))
             for count, conns, _ in _spread(n, writers, writer_procs, None)]
    before = server_cpu(stack)
    results, cpu = _gather(procs, queue)
    asyncio.run(_teardown(settings, schema, transport))
    spans: list[tuple[float, float, dict[str, float]]] = results["_write"]
    seconds = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    what = (("with the event as a WAL message, nothing relayed" if transport == "wal" else
             "with the outbox row, nothing relayed" + ("" if relay_awake else ", every commit notifying"))
            if outbox else "without the outbox: state rows only") + (", one statement each" if one_statement else "")
    row = summary(f"writers {what}, {writer_procs}x{writers // writer_procs}", n, seconds, [])
    row["cpu_us"] = cpu_per_event(n, cpu, before, server_cpu(stack))
    return row


async def _say_relay_awake(settings: CommonSettings, schema: str) -> None:
    """A relay's row saying it is awake for the run (a relay that works says so every few seconds)."""
    conn = await asyncpg.connect(settings.database_url)
    await conn.execute(f"INSERT INTO {schema}.outbox_relays (relay, sleeping, seen)"
                       " VALUES ('bench', false, now() + interval '1 hour')")
    await conn.close()


async def _teardown(settings: CommonSettings, schema: str, transport: Transport) -> None:
    """The run's slot dropped (a slot nobody reads keeps WAL)."""
    if transport == "wal":
        conn = await asyncpg.connect(settings.database_url)
        try:
            await drop_slot(conn, schema)
        finally:
            await conn.close()


async def _setup(settings: CommonSettings, transport: Transport = "table") -> tuple[str, str]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(settings.database_url)
    await db.migrate(conn, "bench", schema=schema)
    if transport == "wal":
        await ensure_slot(conn, schema)
    await conn.execute(f"CREATE TABLE {schema}.state (id uuid PRIMARY KEY)")
    await conn.execute(f"CREATE TABLE {schema}.effects (event_id uuid PRIMARY KEY)")
    await conn.close()
    nc = await connect(settings, name="bench-setup")
    js = nc.jetstream()
    await apply_streams(js, settings)
    durable = f"bench_{schema}"
    # the consumer starts at the end of the stream: what earlier runs left there is not part of this one
    consumer = EventConsumer(ConsumerSpec(name=durable, handler=_effect), pool=None, settings=settings)
    for source in consumer.sources():  # as the service makes them, but starting at the end of the stream
        config = consumer.consumer_config(durable=source.durable, subjects=source.subjects)
        config.deliver_policy = api.DeliverPolicy.NEW
        await js.add_consumer(source.stream, config)
    await nc.close()
    return schema, durable


def outbox_run(
    settings: CommonSettings, n: int, writers: int, mode: str, rate: float | None = None, writer_procs: int = 2,
    legacy_copies: bool | None = None, stack: DevStack | None = None, transport: Transport = "table",
    warmup: float = 1.0,
) -> Row:
    """One run of the outbox path, each part in its own process (spawned, as separate services are).

    The writers are `writer_procs` processes (instances of the producing service) sharing one outbox. Latency from
    commit counts the events committed after the first `warmup` seconds (the processes' first turns: their worst
    is not the pools' connections, bench/RESULTS.md 2026-12-07 14:08); the warm-up's own worst and the figure over
    every event are in the row beside.
    """
    if legacy_copies is None:  # as the services run: the setting's (off by default)
        legacy_copies = settings.events_legacy_subjects
    schema, durable = asyncio.run(_setup(settings, transport))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if mode == "drain":  # fill the outbox (or the slot) first
        asyncio.run(_write(settings, schema, n, writers, None, transport=transport))
        use_transport("table")
    # live: the writers start once the relay and the consumer run, so that no event's latency counts their start
    # (spawning a process takes a second or more: the first events of a run waited for it, 100+ ms)
    ready = ctx.Barrier(writer_procs + 2) if mode != "drain" else None
    procs = [
        ctx.Process(target=_proc, args=("_consume", queue, settings, schema, durable, n, ready)),
        ctx.Process(target=_proc, args=("_relay", queue, settings, schema, n, legacy_copies, ready, transport)),
    ]
    if mode != "drain":
        for count, conns, each_rate in _spread(n, writers, writer_procs, rate):
            procs.append(ctx.Process(target=_proc, args=(
                "_write", queue, settings, schema, count, conns, each_rate, True, ready, False, transport)))
    before = server_cpu(stack)
    results, cpu = _gather(procs, queue)
    asyncio.run(_teardown(settings, schema, transport))
    spent = cpu_per_event(n, cpu, before, server_cpu(stack))
    seconds, latencies, handled, started = results["_consume"][0]
    commits = {ev_id: at for _, _, each in results.get("_write", []) for ev_id, at in each.items()}
    if mode == "drain":
        label = "outbox drain: relay -> consumer+inbox (prefilled)" + (", legacy copies on" if legacy_copies else "")
    elif rate is None:
        label = f"outbox live: {writer_procs}x{writers // writer_procs} writers -> relay -> consumer+inbox"
    elif mode == "lone":
        label = f"outbox lone: 1 writer, {rate:g}/s -> relay -> consumer+inbox"
    else:
        label = f"outbox half: {rate:.0f}/s offered -> relay -> consumer+inbox"
    row = summary(label + (" [wal]" if transport == "wal" else ""), n, seconds, latencies)
    row["cpu_us"] = spent
    row["created_p50_ms"], row["created_p99_ms"] = row["p50_ms"], row["p99_ms"]
    every = {ev_id: at - commits[ev_id] for ev_id, at in handled.items() if ev_id in commits}
    steady_from = min(commits.values(), default=0.0) + warmup
    counted = {ev_id for ev_id in every if commits[ev_id] >= steady_from}
    from_commit = summary(label, n, seconds, [every[ev_id] for ev_id in counted])
    row["p50_ms"], row["p99_ms"] = from_commit["p50_ms"], from_commit["p99_ms"]
    row["all_p99_ms"] = summary(label, n, seconds, list(every.values()))["p99_ms"]
    row["warmup_max_ms"] = round(max((v for i, v in every.items() if i not in counted), default=0.0) * 1000, 2)
    stamps: _Stamps = results["_relay"][0]
    row["stages"] = _stages(label, n, seconds, counted, [
        ("commit -> relay took it", commits, stamps.selected), ("-> JetStream acked", stamps.selected, stamps.acked),
        ("-> consumer's handler", stamps.acked, started), ("-> effect committed", started, handled)])
    if mode == "drain":  # waiting in a prefilled outbox is not latency
        row["p50_ms"] = row["p99_ms"] = row["created_p50_ms"] = row["created_p99_ms"] = None
    return row


def _stages(label: str, n: int, seconds: float, counted: set[str],
            stages: list[tuple[str, dict[str, float], dict[str, float]]]) -> str:
    """Where an event's time goes: each stage's p50 / p99 in ms, from one process's stamps to the next's (the events
    `counted` only)."""
    parts = []
    for name, start, end in stages:
        row = summary(label, n, seconds, [at - start[i] for i, at in end.items() if i in start and i in counted])
        parts.append(f"{name} {row['p50_ms']} / {row['p99_ms']}")
    return ", ".join(parts)


def _ratio(a: Row, b: Row) -> str:
    return f"{float(a['events_per_s']) / float(b['events_per_s']):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--lone", type=int, default=40, help="events of the lone run, at --lone-rate per second")
    parser.add_argument("--lone-rate", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds from a run's first commit whose events the latency from commit leaves out")
    parser.add_argument("--transport", choices=("both", "table", "wal"), default="both",
                        help="the outbox transports to run (CommonSettings.outbox_transport), side by side")
    parser.add_argument("--loop", choices=tuple(LOOPS), default="uvloop",
                        help="the event loop of every measured part (the services run uvloop)")
    args = parser.parse_args()
    os.environ[LOOP_ENV] = args.loop  # inherited by the processes spawned below
    transports: list[Transport] = ["table", "wal"] if args.transport == "both" else [args.transport]
    n, w = args.events, args.writers
    rows: list[Row] = []
    with servers_and_stack() as (settings, stack):
        base = LOOPS[args.loop](baseline(settings, n))
        plain = writers_run(settings, n, w, outbox=False, stack=stack)
        single_plain = writers_run(settings, n, w, outbox=False, stack=stack, one_statement=True)
        rows += [base, plain, single_plain]
        ratios: list[str] = []
        for t in transports:
            drain = outbox_run(settings, n, w, "drain", stack=stack, transport=t)
            with_event = writers_run(settings, n, w, outbox=True, stack=stack, transport=t)
            single = writers_run(settings, n, w, outbox=True, stack=stack, one_statement=True, transport=t)
            live = outbox_run(settings, n, w, "live", stack=stack, transport=t, warmup=args.warmup)
            half = outbox_run(settings, n // 2, w, "half", rate=float(live["events_per_s"]) / 2, stack=stack,
                              transport=t, warmup=args.warmup)
            lone = outbox_run(settings, args.lone, 1, "lone", rate=args.lone_rate, writer_procs=1, stack=stack,
                              transport=t, warmup=args.warmup)
            rows += [drain, with_event, single, live, half, lone]
            ratios += [
                f"[{t}] writers with the event (nothing relayed) / without it: {_ratio(with_event, plain)}; one "
                f"statement each, without a transaction (as the api's create): {_ratio(single, single_plain)}",
                f"[{t}] live with the outbox / the same writers without it: {_ratio(live, plain)}",
                f"[{t}] outbox drain / plain JetStream: {_ratio(drain, base)}",
                f"[{t}] half load, commit -> consumer handled: p50 {half['p50_ms']} ms, p99 {half['p99_ms']} ms "
                f"after the warm-up (p99 with it {half['all_p99_ms']}, its worst {half['warmup_max_ms']}; from the "
                f"event's creation, with it {half['created_p50_ms']} / {half['created_p99_ms']}; {half['stages']}); "
                f"lone p50 {lone['p50_ms']} ms, p99 {lone['p99_ms']} ms "
                f"(from creation {lone['created_p50_ms']} / {lone['created_p99_ms']})",
            ]
            if t == "table":
                # the copy on the bare type each public event gets for a release (SPEC 11): what it costs the relay
                copies = outbox_run(settings, n, w, "drain", legacy_copies=True, stack=stack)
                notifying = writers_run(settings, n, w, outbox=True, relay_awake=False, stack=stack)
                rows += [copies, notifying]
                ratios += [f"[table] drain with the legacy copies (WEIR_EVENTS_LEGACY_SUBJECTS=1) / without them: "
                           f"{_ratio(copies, drain)}; writers when every commit notifies: {_ratio(notifying, plain)}"]
    print(f"{'path (latency from commit; from creation)':90} {'events':>7} {'ev/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
          f" {'c p50':>8} {'c p99':>8}")
    for r in rows:
        print(f"{r['path']:90} {r['events']:>7} {r['events_per_s']:>9} {r['p50_ms']!s:>8} {r['p99_ms']!s:>8}"
              f" {r.get('created_p50_ms')!s:>8} {r.get('created_p99_ms')!s:>8}")
    for line in ratios:
        print(line)
    print("CPU per event, us (each process role; the servers from /proc; the drain's writers filled it first):")
    for r in rows[1:]:
        print(f"  {r['path'][:90]:90} " + ", ".join(f"{k} {v}" for k, v in r["cpu_us"].items()))
    print(json.dumps({"rows": rows, "loop": args.loop, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
