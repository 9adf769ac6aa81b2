"""Imports from a URL against direct uploads of the same file, on real servers (embedded NATS, PostgreSQL, S3), one
`python -m services.api` and `services.auth`, and a file server of its own (a process: `http.server` on 127.0.0.1).

An import's bytes go through the api (read from the URL, stored part by part); a direct upload's go from the client
straight to storage (presigned part URLs, the api only signs and completes). Each round times, in turn (mirrored: A B
B A), one of each for the same file, from the create to the file recorded (the import: its `import.state` completed,
seen by polling GET every 20 ms; the upload: complete answered), and the api's CPU seconds over it. Figures: medians
of the rounds, MiB/s, and the ratio import / upload of the same round.

    python -m bench.imports [--mib N] [--rounds R] [--part-mib P]
    (embedded servers; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL, WEIR_DATABASE_URL, WEIR_S3_ENDPOINT)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.api import at_least, cpu_seconds, provision, service_env, start, tiny_mp4
from bench.bus import servers
from shared.devstack.ports import free_port

POLL_S = 0.02
UPLOAD_CONCURRENCY = 4  # parts in flight, as @weir/upload sends them


def file_server(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                             str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            return proc, url
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError("the file server did not start") from None
            time.sleep(0.05)


async def imported(http: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    video = (await http.post("/v1/videos", json={"name": "import"})).json()
    r = await http.post(f"/v1/videos/{video['id']}/import", json={"url": url})
    assert r.status_code == 202, r.text
    while True:
        shown = (await http.get(f"/v1/videos/{video['id']}")).json()
        state = shown["import"]["state"]
        if state == "completed":
            return time.perf_counter() - t0
        assert state in ("queued", "fetching"), shown["import"]
        await asyncio.sleep(POLL_S)


async def uploaded(http: httpx.AsyncClient, data: bytes, part_bytes: int) -> float:
    t0 = time.perf_counter()
    video = (await http.post("/v1/videos", json={"name": "upload"})).json()
    path = f"/v1/videos/{video['id']}/upload"
    await http.post(path, json={"content_type": "video/mp4", "size": len(data)})
    count = -(-len(data) // part_bytes)
    urls = (await http.post(f"{path}/parts", json={"part_numbers": list(range(1, count + 1))})).json()["parts"]
    etags: dict[int, str] = {}
    todo = list(range(count))
    sem = asyncio.Semaphore(UPLOAD_CONCURRENCY)

    async def put(i: int) -> None:
        async with sem:
            r = await http.put(urls[i]["url"], content=data[i * part_bytes:(i + 1) * part_bytes])
            assert r.status_code == 200, r.text
            etags[i + 1] = r.headers["etag"]

    await asyncio.gather(*(put(i) for i in todo))
    done = await http.post(f"{path}/complete", json={"parts": [{"part_number": n, "etag": etags[n]}
                                                                for n in sorted(etags)]})
    assert done.status_code == 200 and done.json()["status"] == "uploaded", done.text
    return time.perf_counter() - t0


async def measure(api: str, key: str, api_pid: int, data: bytes, url: str, rounds: int, part_bytes: int
                  ) -> list[dict[str, float]]:
    rows = []
    async with httpx.AsyncClient(base_url=api, timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        await imported(http, url)  # warm: connections, the first import's code paths
        for r in range(rounds):
            row: dict[str, float] = {}
            order = ("import", "upload") if r % 2 == 0 else ("upload", "import")
            for what in (*order, *reversed(order)):
                cpu0 = cpu_seconds(api_pid)
                secs = await imported(http, url) if what == "import" else await uploaded(http, data, part_bytes)
                row[f"{what}_s"] = row.get(f"{what}_s", 0) + secs / 2
                row[f"{what}_api_cpu_s"] = row.get(f"{what}_api_cpu_s", 0) + (cpu_seconds(api_pid) - cpu0) / 2
            row["ratio"] = row["upload_s"] / row["import_s"]  # import throughput / upload throughput
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=at_least(6), default=128, help="the file's size in MiB (at least 6)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="rounds (each: two of each, mirrored)")
    parser.add_argument("--part-mib", type=at_least(5), default=16, help="part size of both, in MiB (at least 5)")
    args = parser.parse_args()
    part_bytes = args.part_mib * 1024 * 1024
    head = tiny_mp4()
    data = head + os.urandom(args.mib * 1024 * 1024 - len(head))  # a real MP4, then bytes a player skips
    with servers() as settings, tempfile.TemporaryDirectory(prefix="weir-bench-imports-") as tmp:
        (Path(tmp) / "clip.mp4").write_bytes(data)
        env = {**service_env(settings), "WEIR_IMPORT_ALLOW_PRIVATE": "1", "WEIR_IMPORT_POLL_SECONDS": "0.02",
               "WEIR_IMPORT_PART_BYTES": str(part_bytes), "WEIR_LIMIT_ADDRESS_PER_MINUTE": str(10**9)}
        procs = []
        try:
            server, files = file_server(Path(tmp))
            procs.append(server)
            auth, _ = start("services.auth", env)
            procs.append(auth)
            api, api_url = start("services.api", env)
            procs.append(api)
            _, app = asyncio.run(provision(settings))
            rows = asyncio.run(measure(api_url, app.secret_key, api.pid, data, f"{files}/clip.mp4", args.rounds,
                                       part_bytes))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    mib = len(data) / 2**20
    med: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\n{mib:.0f} MiB, parts of {args.part_mib} MiB, {args.rounds} rounds (medians):")
    print(f"  direct upload: {med['upload_s']:.2f} s, {mib / med['upload_s']:.0f} MiB/s, api CPU "
          f"{med['upload_api_cpu_s']:.2f} s")
    print(f"  import:        {med['import_s']:.2f} s, {mib / med['import_s']:.0f} MiB/s, api CPU "
          f"{med['import_api_cpu_s']:.2f} s ({med['import_api_cpu_s'] / mib * 1024:.1f} s per GiB)")
    per_round = ", ".join(f"{r['ratio']:.2f}" for r in rows)
    print(f"  import / upload throughput: {med['ratio']:.2f} (per round: {per_round})")


if __name__ == "__main__":
    main()
