"""How soon a durable's messages are handed on, and at what cost: shared/pull.py beside nats-py's `fetch` loop (what
`DurablePull` was until 2026-12-07, the baseline), in the same run, each reader in its own process as an instance.

- trickle: two readers on one durable (two instances of a service), `--messages` published at `--rate` per second,
  each handed on, then acknowledged `--work` ms later (as a consumer acks after its transaction); latency from the
  publish to the hand-off (the host's clock in both processes): median, p99, the slowest, and how many waited
  over 100 ms;
- drain: one reader, `--drain` messages waiting, each acknowledged as it is handed on: messages/s from the first
  hand-off to the last, and the reader's CPU per message.
Rounds alternate the order (fetch first, then pull first, ...).
    python -m bench.pull [--rounds 3] [--rate 100] [--messages 600] [--work 3] [--drain 20000]
    (embedded nats-server; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from typing import Any

import uvloop
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from bench.counters import nats_server, wait_up
from services.auth.settings import AuthSettings
from shared.bus import connect
from shared.pull import DurablePull, Source

WAIT = 1.0  # each request's wait: consumer_fetch_wait_seconds
BATCH = 64  # consumer_batch
VARIANTS = ("fetch", "pull")
SLOW = 0.1  # a hand-off later than this is counted


async def _fetch_loop(nc: NATS, source: Source, deliver: Any, stop: asyncio.Event) -> None:
    """The baseline: nats-py's PullSubscription.fetch in a loop."""
    sub = await nc.jetstream().pull_subscribe_bind(durable=source.durable, stream=source.stream)
    while not stop.is_set():
        try:
            messages = await sub.fetch(batch=BATCH, timeout=WAIT)
        except TimeoutError:
            continue
        await deliver(messages)


async def _read(url: str, variant: str, stream: str, work: float, stop_flag: Any, out: Any) -> None:
    nc = await connect(AuthSettings(nats_url=url), name=f"bench-pull-{variant}")
    handed: list[tuple[int, float]] = []
    acks: set[asyncio.Task[None]] = set()
    cpu = [time.process_time(), 0.0]

    async def ack_later(m: Msg) -> None:
        await asyncio.sleep(work)
        await m.ack()

    async def deliver(messages: list[Msg]) -> None:
        now = time.time()
        for m in messages:
            handed.append((m.metadata.sequence.stream, now))
            if work:
                task = asyncio.create_task(ack_later(m))
                acks.add(task)
                task.add_done_callback(acks.discard)
            else:
                await m.ack()
        cpu[1] = time.process_time()

    source = Source(stream, "reader", [])
    stop = asyncio.Event()
    pull = DurablePull(nc, source, inbox=None, batch=BATCH, wait=WAIT, deliver=deliver)
    fetching: asyncio.Task[None] | None = None
    if variant == "pull":
        pull.start()
    else:
        fetching = asyncio.create_task(_fetch_loop(nc, source, deliver, stop))
    out.put(("ready", None))
    while not stop_flag.is_set():
        await asyncio.sleep(0.02)
    stop.set()
    if fetching is None:
        await pull.stop(WAIT + 1)
    else:
        await asyncio.wait([fetching], timeout=WAIT + 1)
    out.put(("done", (handed, cpu[1] - cpu[0])))
    await nc.close()


def reader(url: str, variant: str, stream: str, work: float, stop_flag: Any, out: Any) -> None:
    uvloop.run(_read(url, variant, stream, work, stop_flag, out))


async def _run(url: str, variant: str, *, readers: int, prefill: int, messages: int, rate: float, work: float
               ) -> tuple[dict[int, float], list[tuple[int, float]], float]:
    """Publishes, lets `readers` processes read; returns publish times, every hand-off, the readers' CPU."""
    nc = await wait_up(AuthSettings(nats_url=url))
    js = nc.jetstream()
    stream = f"BENCHPULL{uuid.uuid4().hex[:8].upper()}"
    subject = f"{stream.lower()}.x"
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    await js.add_consumer(stream, api.ConsumerConfig(durable_name="reader", ack_policy=api.AckPolicy.EXPLICIT,
                                                     ack_wait=30, max_ack_pending=max(1000, 2 * BATCH)))
    published: dict[int, float] = {}
    for _ in range(prefill):
        at = time.time()
        ack = await js.publish(subject, b"x")
        published[ack.seq] = at
    ctx = mp.get_context("spawn")
    out, stop_flag = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=reader, args=(url, variant, stream, work / 1000, stop_flag, out))
             for _ in range(readers)]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=60)[0] == "ready"
    if messages:
        await asyncio.sleep(WAIT)  # every reader's first request open
    for _ in range(messages):
        at = time.time()  # before the publish: its ack may come after the reader has the message
        ack = await js.publish(subject, b"x")
        published[ack.seq] = at
        await asyncio.sleep(1 / rate)
    last = max(published)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until every message is acknowledged
        info = await js.consumer_info(stream, "reader")
        if info.ack_floor.stream_seq >= last:
            break
        await asyncio.sleep(0.05)
    stop_flag.set()
    handed: list[tuple[int, float]] = []
    cpu = 0.0
    for _ in procs:
        _, (got, spent) = out.get(timeout=60)
        handed += got
        cpu += spent
    for p in procs:
        p.join(timeout=10)
    await js.delete_stream(stream)
    await nc.close()
    return published, handed, cpu


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


async def bench(url: str, args: argparse.Namespace) -> None:
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}

    def keep(variant: str, name: str, value: float) -> None:
        rows[variant].setdefault(name, []).append(value)

    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            published, handed, _ = await _run(url, variant, readers=2, prefill=0, messages=args.messages,
                                              rate=args.rate, work=args.work)
            first: dict[int, float] = {}
            for seq, at in handed:
                first.setdefault(seq, at)
            lat = sorted(first[s] - published[s] for s in published if s in first)
            keep(variant, "trickle: handed on", len(first) / len(published))
            keep(variant, "trickle: median ms", statistics.median(lat) * 1000)
            keep(variant, "trickle: p99 ms", lat[int(0.99 * (len(lat) - 1))] * 1000)
            keep(variant, "trickle: slowest ms", lat[-1] * 1000)
            keep(variant, f"trickle: over {SLOW * 1000:.0f} ms", sum(x > SLOW for x in lat))
        for variant in order:
            published, handed, cpu = await _run(url, variant, readers=1, prefill=args.drain, messages=0,
                                                rate=1.0, work=0.0)
            times = [at for _, at in handed]
            keep(variant, "drain: messages/s", len(handed) / max(1e-9, max(times) - min(times)))
            keep(variant, "drain: reader CPU us/message", cpu / len(handed) * 1e6)
        print(f"round {r + 1}: " + "; ".join(f"{v} {k} {vals[-1]:.1f}" for v in VARIANTS
                                             for k, vals in rows[v].items() if k.startswith("trickle: p99")),
              flush=True)
    print(f"\nbench.pull: {args.rounds} rounds, trickle {args.messages} at {args.rate:g}/s, 2 readers, ack after "
          f"{args.work:g} ms; drain {args.drain}, 1 reader; medians of the rounds (each round's in brackets)")
    print("| | nats-py fetch (baseline) | shared/pull.py | pull / fetch |")
    print("|---|---|---|---|")
    for name in rows["fetch"]:
        f, p = rows["fetch"][name], rows["pull"][name]
        mf, mp_ = statistics.median(f), statistics.median(p)
        ratio = f"{mp_ / mf:.2f}" if mf else "-"
        print(f"| {name} | {mf:.1f} ({', '.join(f'{x:.1f}' for x in f)}) | {mp_:.1f} "
              f"({', '.join(f'{x:.1f}' for x in p)}) | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--messages", type=int, default=600)
    parser.add_argument("--work", type=float, default=3.0, help="ms from hand-off to ack")
    parser.add_argument("--drain", type=int, default=20000)
    args = parser.parse_args()
    with nats_server() as url:
        uvloop.run(bench(url, args))


if __name__ == "__main__":
    main()
