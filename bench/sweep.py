"""Sweep candidates per second on a table of 100,000 and then 1,000,000 videos, with the same 10,000 candidates.

A run's cost must follow its candidates, not the table: the sizes' runs within 1.2x, read in CPU per candidate
(this process, PostgreSQL, SeaweedFS), as wall-clock swings with a shared machine's neighbours. Baselines: the
candidate scan alone, and HEADs through the sweep's adapter and through botocore. Sizes interleave `--repeat` times.
    python -m bench.sweep [--sizes 100000,1000000] [--candidates 10000] [--open-uploads 500] [--stale-files 500]
                          [--repeat 3]    (embedded servers; or WEIR_BENCH_EXTERNAL=1 with the WEIR_* addresses)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

from bench.bus import servers_and_stack
from services.sweep import store
from services.sweep.settings import SweepSettings
from services.sweep.storage import S3Storage
from services.sweep.sweep import Sweeper
from shared import db
from shared.settings import CommonSettings
from shared.storage import s3_client
from weir.up import prepare

Row = dict[str, Any]
Pids = dict[str, int]
APPS = 10
NAME = "bench-sweep"
# a candidate's id, app and key from its number: the same candidates at every table size
CANDIDATE_ID = "md5('sweep-candidate-' || i)::uuid"
APP_ID = f"md5('sweep-app-' || (i % {APPS}))::uuid"


@contextlib.contextmanager
def servers() -> Iterator[tuple[CommonSettings, Pids]]:
    """Embedded servers (their pids, to count their CPU), or the external ones (CPU of this process only)."""
    with servers_and_stack() as (settings, stack):
        pids: Pids = {str(n): pid for n, pid in stack.pids.items() if n in ("postgres", "s3")} if stack else {}
        yield settings, pids


def _ticks(pid: int, *, children: bool) -> float:
    """CPU seconds of a process (with its reaped children's, for the PostgreSQL postmaster)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    used = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return used / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Pids) -> dict[str, float]:
    """CPU used so far by this process, PostgreSQL (postmaster, its backends) and SeaweedFS."""
    used = {"sweep": time.process_time()}
    if "postgres" in pids:
        backends = [int(p) for p in Path(f"/proc/{pids['postgres']}/task/{pids['postgres']}/children")
                    .read_text().split()]
        used["postgres"] = _ticks(pids["postgres"], children=True) + sum(_ticks(b, children=False) for b in backends)
    if "s3" in pids:
        used["seaweedfs"] = _ticks(pids["s3"], children=False)
    return used


FILLER = f"""INSERT INTO videos.videos (id, app_id, account_id, key_id, name, object_key, status, created_at,
        file_size, file_content_type, file_recorded_at, retired_at, retire_reason, deleted_at)
    SELECT id, app, app, app, '{NAME}', 'sources/' || app || '/' || id, status, created,
           CASE WHEN status IN ('uploaded', 'ready') THEN 1000 END,
           CASE WHEN status IN ('uploaded', 'ready') THEN 'video/mp4' END,
           CASE WHEN status IN ('uploaded', 'ready') THEN created + interval '1 minute' END,
           CASE WHEN status = 'retired' THEN created + interval '2 days' END,
           CASE WHEN status = 'retired' THEN 'never_uploaded' END,
           CASE WHEN status = 'deleted' THEN created + interval '1 hour' END
    FROM (SELECT md5('sweep-filler-' || i)::uuid AS id, {APP_ID} AS app,
                 now() - (i % 365) * interval '1 day' - (i % 86400) * interval '1 second' AS created,
                 CASE WHEN i % 100 < 2 THEN 'deleted' WHEN i % 100 = 2 THEN 'retired'
                      WHEN i % 2 = 0 THEN 'ready' ELSE 'uploaded' END AS status
          FROM generate_series($1::int, $2::int) AS i) AS f"""
"""Filler rows $1..$2: 97 % with a recorded file, 2 % deleted, 1 % retired, created over the past year; the index
of candidates never holds them."""


async def fill_candidates(conn: asyncpg.Connection, candidates: int, open_uploads: dict[int, str],
                          external: bool) -> None:
    """An empty table but for the candidates (the same ones at every size): 2 to 30 days old over 10 apps; a sample
    has an open upload (left) or an unrecorded file (retired `stale_file`), the rest nothing stored (retired
    `never_uploaded`): over the safety valve's share, so the runs use force."""
    if external:
        await conn.execute("DELETE FROM videos.videos WHERE name = $1", NAME)
    else:
        await conn.execute("TRUNCATE videos.videos")
    await conn.execute(
        f"""INSERT INTO videos.videos (id, app_id, account_id, key_id, name, object_key, status, created_at, upload_id)
            SELECT {CANDIDATE_ID}, {APP_ID}, {APP_ID}, {APP_ID}, '{NAME}',
                   'sources/' || {APP_ID} || '/' || {CANDIDATE_ID},
                   CASE WHEN u.upload_id IS NULL THEN 'created' ELSE 'uploading' END,
                   now() - interval '2 days' - (i % 28) * interval '1 day' - (i % 3600) * interval '1 second',
                   u.upload_id
            FROM generate_series(1, $1) AS i
            LEFT JOIN unnest($2::int[], $3::text[]) AS u(n, upload_id) ON u.n = i""",
        candidates, list(open_uploads), list(open_uploads.values()),
    )


async def resize(conn: asyncpg.Connection, filler_now: int, filler: int) -> float:
    """Grow or shrink the filler to `filler` rows (generated in PostgreSQL; recorded, retired or deleted videos, so
    `videos_sweep_candidates` never holds them); returns the seconds it took."""
    started = time.perf_counter()
    if filler > filler_now:
        await conn.execute(FILLER, filler_now + 1, filler)
    elif filler < filler_now:
        await conn.execute("DELETE FROM videos.videos WHERE id IN"
                           " (SELECT md5('sweep-filler-' || i)::uuid FROM generate_series($1::int, $2::int) AS i)",
                           filler + 1, filler_now)
    await conn.execute("VACUUM ANALYZE videos.videos")
    return time.perf_counter() - started


async def put_back(conn: asyncpg.Connection, candidates: int) -> None:
    """The candidates a run retired are candidates again (their files are put back by the caller)."""
    await conn.execute(
        f"UPDATE videos.videos SET status = 'created', retired_at = NULL, retire_reason = NULL"
        f" WHERE status = 'retired' AND id IN (SELECT {CANDIDATE_ID} FROM generate_series(1, $1) AS i)", candidates)
    await conn.execute("DELETE FROM sweep.outbox")  # no relay in this benchmark: keep the outbox small


async def candidate_keys(conn: asyncpg.Connection, numbers: list[int]) -> dict[int, str]:
    rows = await conn.fetch(
        f"SELECT i, 'sources/' || {APP_ID} || '/' || {CANDIDATE_ID} AS key FROM unnest($1::int[]) AS i", numbers)
    return {r["i"]: r["key"] for r in rows}


async def scan_alone(conn: asyncpg.Connection, now: datetime, page: int) -> tuple[int, float, str]:
    """Every candidate through the index, page by page, as the survey reads them: (count, seconds, plan)."""
    cutoff = now - timedelta(days=1)
    plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + store.CANDIDATES, cutoff))
    started = time.perf_counter()
    n = 0
    async for batch in store.candidates(conn, cutoff=cutoff, page=page):
        n += len(batch)
    return n, time.perf_counter() - started, plan


async def heads_per_second(settings: SweepSettings, keys: list[str]) -> Row:
    """Storage alone: HEAD requests per second, the sweep's adapter beside a botocore client, same concurrency."""
    slots = asyncio.Semaphore(settings.sweep_storage_concurrency)
    row: Row = {}
    async with S3Storage.from_settings(settings) as storage:
        async def lean(key: str) -> None:
            async with slots:
                await storage.read_file(key)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(lean(k) for k in keys))
        row["adapter_heads_per_s"] = round(len(keys) / (time.perf_counter() - started))
        row["adapter_cpu_ms_per_head"] = round((time.process_time() - cpu) / len(keys) * 1000, 3)
    async with s3_client(settings) as s3:
        async def boto(key: str) -> None:
            async with slots:
                try:
                    await s3.head_object(Bucket=settings.s3_bucket, Key=key)
                except s3.exceptions.ClientError:
                    pass

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(boto(k) for k in keys))
        row["botocore_heads_per_s"] = round(len(keys) / (time.perf_counter() - started))
        row["botocore_cpu_ms_per_head"] = round((time.process_time() - cpu) / len(keys) * 1000, 3)
    return row


async def one_run(conn: asyncpg.Connection, pool: asyncpg.Pool, settings: SweepSettings, size: int,
                  resize_seconds: float, pids: Pids, *, show_plan: bool) -> Row:
    now = datetime.now(UTC) + timedelta(days=2)  # files written just now count as a day old
    scanned, scan_seconds, plan = await scan_alone(conn, now, settings.sweep_page_size)
    phases: dict[str, float] = {}

    def progress(phase: str, done: int, total: int | None, t0: float = time.perf_counter()) -> None:
        phases.setdefault(phase, time.perf_counter() - t0)  # when each phase began

    before = cpu_seconds(pids)
    async with S3Storage.from_settings(settings) as storage:
        report = await Sweeper(pool=pool, storage=storage, settings=settings).run(force=True, now=now,
                                                                                  progress=progress)
    after = cpu_seconds(pids)
    seconds = report.duration_seconds or 0.0
    t = report.tally
    cpu = {name: round((after[name] - before[name]) / max(t.examined, 1) * 1000, 3) for name in after}
    if show_plan:
        print(f"-- plan of the candidate scan, {size:,} rows:\n{plan}", flush=True)
    return {
        "table_rows": size, "candidates": t.examined, "seconds": round(seconds, 2),
        "candidates_per_s": round(t.examined / seconds), "survey_s": round(phases.get("confirm", 0), 2),
        "retired": dict(t.retired), "left_alone": dict(t.left_alone), "errors": t.errors,
        "index_scan_candidates": scanned, "index_scan_ms": round(scan_seconds * 1000, 1),
        "uses_index": "videos_sweep_candidates" in plan, "resize_s": round(resize_seconds, 1),
        "cpu_ms_per_candidate": cpu, "cpu_ms_per_candidate_total": round(sum(cpu.values()), 3),
        "load_average": os.getloadavg()[0],
    }


async def bench(base: CommonSettings, pids: Pids, sizes: list[int], candidates: int, n_open: int, n_stale: int,
                repeat: int) -> list[Row]:
    external = os.environ.get("WEIR_BENCH_EXTERNAL") == "1"
    await prepare(base)
    values = {**base.model_dump(), "s3_secret_key": base.s3_secret_key.get_secret_value(), "sweep_daily_enabled": False}
    settings = SweepSettings.model_validate(values)
    conn = await asyncpg.connect(base.database_url)
    pool = await db.create_pool(base.database_url, schema=db.SCHEMAS["sweep"],
                                max_size=settings.sweep_batch_concurrency + 2)
    rows: list[Row] = []
    try:
        # the sample: candidates 1..n_open have an open upload, the next n_stale an unrecorded file
        keys = await candidate_keys(conn, list(range(1, n_open + n_stale + 1)))
        async with s3_client(settings) as s3:
            sem = asyncio.Semaphore(32)

            async def open_one(i: int) -> tuple[int, str]:
                async with sem:
                    resp = await s3.create_multipart_upload(Bucket=settings.s3_bucket, Key=keys[i])
                    return i, str(resp["UploadId"])

            open_uploads = dict(await asyncio.gather(*(open_one(i) for i in range(1, n_open + 1))))

            async def put_one(i: int) -> None:
                async with sem:
                    await s3.put_object(Bucket=settings.s3_bucket, Key=keys[i], Body=b"\x00" * 4096)

            await fill_candidates(conn, candidates, open_uploads, external)
            filler = 0
            for attempt in range(repeat):  # sizes interleaved: a neighbour's burst of load falls on both alike
                for size in sizes:
                    resize_seconds = await resize(conn, filler, size - candidates)
                    filler = size - candidates
                    await put_back(conn, candidates)
                    await asyncio.gather(*(put_one(i) for i in range(n_open + 1, n_open + n_stale + 1)))
                    rows.append(await one_run(conn, pool, settings, size, resize_seconds, pids,
                                              show_plan=not attempt))
                    print(json.dumps(rows[-1]), flush=True)
        sample = [keys[i] for i in range(1, n_open + n_stale + 1)] + [f"sources/none/{i}" for i in range(2000)]
        rows.append(await heads_per_second(settings, sample))
    finally:
        await pool.close()
        await conn.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--candidates", type=int, default=10_000)
    parser.add_argument("--open-uploads", type=int, default=500)
    parser.add_argument("--stale-files", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with servers() as (settings, pids):
        # uvloop, as the sweep service runs (shared.runtime.main)
        rows = uvloop.run(bench(settings, pids, sizes, args.candidates, args.open_uploads, args.stale_files,
                                args.repeat))
    runs, storage = rows[:-1], rows[-1]
    print(f"{'table rows':>12} {'candidates':>10} {'seconds':>8} {'cand/s':>8} {'survey s':>9} {'scan ms':>8} "
          f"{'CPU ms/cand':>12} {'load':>5}  CPU ms per candidate by process")
    for r in runs:
        print(f"{r['table_rows']:>12,} {r['candidates']:>10,} {r['seconds']:>8} {r['candidates_per_s']:>8,} "
              f"{r['survey_s']:>9} {r['index_scan_ms']:>8} {r['cpu_ms_per_candidate_total']:>12} "
              f"{r['load_average']:>5.1f}  {r['cpu_ms_per_candidate']}")
    print(f"each run: retired {runs[0]['retired']}, left alone {runs[0]['left_alone']}")
    summary: dict[int, Row] = {}
    for size in sizes:
        mine = [r for r in runs if r["table_rows"] == size]
        summary[size] = {
            "best": max(r["candidates_per_s"] for r in mine),
            "median": statistics.median(r["candidates_per_s"] for r in mine),
            "cpu_ms": round(statistics.median(r["cpu_ms_per_candidate_total"] for r in mine), 3),
        }
        print(f"{size:,} rows over {len(mine)} run(s): best {summary[size]['best']:,} candidates/s, median "
              f"{summary[size]['median']:,.0f}; median CPU {summary[size]['cpu_ms']} ms per candidate (all processes)")
    if len(sizes) > 1:
        first, last = summary[sizes[0]], summary[sizes[-1]]
        print(f"{sizes[0]:,} rows against {sizes[-1]:,}: best {first['best'] / last['best']:.2f}, "
              f"median {first['median'] / last['median']:.2f}, "
              f"CPU per candidate {last['cpu_ms'] / first['cpu_ms']:.2f}")
    print(f"storage alone: {storage}")
    print(json.dumps({"runs": runs, "summary": summary, "storage": storage}))


if __name__ == "__main__":
    main()
