"""Limit-counter increments per second and latency, with and without batching, beside a NATS echo in the same run.

`--workers` concurrent callers in one process (as one auth instance) increment `--subjects` counters (1: one hot
counter, the case batching is for) until `--ops`: echo (a core request/reply, the round-trip ceiling), unbatched
(one `Nats-Incr: +1` publish each) and batched (concurrent increments folded into one `+k` publish).
    python -m bench.counters [--ops N] [--workers W] [--subjects S] [--rounds R]
    (embedded nats-server; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.auth.counters import JetStreamCounters, counter_stream, counter_subject
from services.auth.settings import AuthSettings
from shared.bus import connect
from shared.devstack.ports import free_port
from shared.streams import apply_streams

Row = dict[str, Any]
BENCH_TIMEOUT_MS = 5_000  # throughput, not the budget, is measured here


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    if os.environ.get("WEIR_BENCH_EXTERNAL") == "1":
        yield AuthSettings().nats_url
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="weir-bench-counters-") as tmp:
        binary = Path(sys.executable).parent / "nats-server"
        proc = subprocess.Popen(
            [str(binary), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


async def wait_up(settings: AuthSettings) -> NATS:
    host, _, port = settings.nats_url.removeprefix("nats://").partition(":")
    deadline = time.monotonic() + 30
    while True:  # until the port accepts, so the client does not log refused connections
        try:
            _, writer = await asyncio.open_connection(host, int(port or 4222))
            writer.close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    nc = await connect(settings, name="bench-counters")
    await nc.jetstream().account_info()
    return nc


def echo_service(url: str, ready: Any) -> None:
    """The baseline's responder, in its own process as a service would be."""

    async def serve() -> None:
        nc = await connect(AuthSettings(nats_url=url), name="bench-echo")

        async def echo(msg: Msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("bench.echo", cb=echo)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(serve())


async def drive(name: str, op: Callable[[int], Awaitable[object]], ops: int, workers: int) -> Row:
    latencies: list[float] = []
    next_op = 0

    async def worker() -> None:
        nonlocal next_op
        while next_op < ops:
            i = next_op
            next_op += 1
            started = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    seconds = time.perf_counter() - started
    lat = sorted(latencies)
    return {
        "path": name,
        "ops": ops,
        "per_s": round(ops / seconds),
        "p50_ms": round(statistics.median(lat) * 1000, 3),
        "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 3),
    }


async def one_round(nc: NATS, ops: int, workers: int, subjects: int) -> list[Row]:
    rows = [await drive("echo", lambda i: nc.request("bench.echo", b"x", timeout=5), ops, workers)]
    for batch in (False, True):
        store = JetStreamCounters(nc, timeout_ms=BENCH_TIMEOUT_MS, batch=batch)
        run_id = uuid.uuid4().hex[:8]
        names = [counter_subject("key", f"{run_id}-{n}", 0) for n in range(subjects)]

        async def incr(i: int, store: JetStreamCounters = store, names: list[str] = names) -> int:
            return await store.incr(names[i % len(names)])

        row = await drive("batched" if batch else "unbatched", incr, ops, workers)
        row["publishes"] = store.publishes
        totals = [json.loads((await nc.jetstream().get_last_msg("LIMITS", n)).data or b"{}")["val"] for n in names]
        assert sum(int(t) for t in totals) == ops, totals  # every increment counted, once
        rows.append(row)
    return rows


async def run(ops: int, workers: int, subjects: int, rounds: int) -> list[Row]:
    """The paths in turn, `rounds` times; each figure is the round with the median rate (a shared machine is noisy)."""
    by_path: dict[str, list[Row]] = {}
    with nats_server() as url:
        settings = AuthSettings(nats_url=url)
        nc = await wait_up(settings)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        responder = ctx.Process(target=echo_service, args=(url, ready), daemon=True)
        responder.start()
        try:
            await apply_streams(nc.jetstream(), settings, (counter_stream(settings),))
            if not await asyncio.to_thread(ready.wait, 30):
                raise RuntimeError("the echo service did not start")
            for _ in range(rounds):
                for row in await one_round(nc, ops, workers, subjects):
                    by_path.setdefault(row["path"], []).append(row)
        finally:
            responder.terminate()
            responder.join(10)
            await nc.close()
    rows = [sorted(rs, key=lambda r: r["per_s"])[len(rs) // 2] for rs in by_path.values()]
    echo_rate = rows[0]["per_s"]
    for row in rows:
        row["vs_echo"] = round(row["per_s"] / echo_rate, 2)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--subjects", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args.ops, args.workers, args.subjects, args.rounds))
    print(f"workers={args.workers} subjects={args.subjects}")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
