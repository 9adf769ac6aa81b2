"""The encoding farm's figures beside their goals, on real servers, processes and ffmpeg: rendition (a worker's
offer-to-result time for one rendition over the same ffmpeg alone: at most 1.05x; HLS off, whose cost is figure 4's),
latency (upload.completed to the first output accepted: p99 at most 100 ms), utilisation (usable slots busy under a
backlog: 95 %), both issue 6's; playback (issue 32: a 1080p source's whole ladder with HLS and artwork at most 1.1x the
MP4-only ladder, and its lowest rendition playable within half the time of the whole ladder). The measuring points
are in each figure's function.

python -m bench.encode [--videos 20] [--latency-samples 200] [--rendition-runs 5] [--playback-rounds 3]
                       [--playback-seconds 20] [--playback-slots 4] [--only FIGURE]
(embedded servers; or WEIR_BENCH_EXTERNAL=1 with WEIR_NATS_URL, WEIR_DATABASE_URL, WEIR_S3_ENDPOINT)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench.bus import servers
from services.media.domain import EncodeOptions, encode_args
from services.media.settings import MediaSettings
from shared.bus import HDR_LEGACY_COPY, HDR_MSG_ID, connect
from shared.devstack.ports import free_port
from shared.events import Envelope, UploadCompleted, new_event
from shared.media.probe import ffmpeg_exe
from shared.media.protocol import (
    HEARTBEAT_SUBJECT,
    RESULT_SUBJECT,
    Heartbeat,
    Offer,
    OfferAnswer,
    Outcome,
    OutputResult,
    ResultAck,
    offer_subject,
)
from shared.media.source import open_source
from shared.settings import CommonSettings
from shared.storage import s3_client
from shared.videos import JobClass
from weir.up import prepare

Row = dict[str, Any]




def _env(settings: CommonSettings) -> dict[str, str]:
    return {
        **os.environ, "PYTHONUNBUFFERED": "1", "WEIR_LOG_LEVEL": "WARNING",
        "WEIR_NATS_URL": settings.nats_url, "WEIR_DATABASE_URL": settings.database_url,
        "WEIR_S3_ENDPOINT": settings.s3_endpoint, "WEIR_S3_BUCKET": settings.s3_bucket,
        "WEIR_S3_ACCESS_KEY": settings.s3_access_key,
        "WEIR_S3_SECRET_KEY": settings.s3_secret_key.get_secret_value(), "WEIR_S3_REGION": settings.s3_region,
    }


@contextlib.contextmanager
def service(settings: CommonSettings, name: str, logs: Path, **overrides: Any) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m services.<name>` until the block ends (SIGTERM, then SIGKILL)."""
    port = free_port()
    env = {**_env(settings), "WEIR_HTTP_PORT": str(port), **{f"WEIR_{k.upper()}": str(v) for k, v in overrides.items()}}
    with (logs / f"{name}-{port}.log").open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", f"services.{name.split('-')[0]}"], env=env, stdout=out,
                                stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; see {logs}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.05)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def make_source(path: Path, *, height: int, seconds: int) -> Path:
    width = height * 16 // 9 // 2 * 2
    subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                    "-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate=25:duration={seconds}",
                    "-f", "lavfi", "-i", f"sine=duration={seconds}",
                    "-c:v", "libx264", "-preset", "ultrafast", "-crf", "18", "-c:a", "aac", "-shortest", str(path)],
                   check=True)
    return path


async def put(settings: CommonSettings, path: Path) -> tuple[str, int]:
    key = f"sources/bench/{uuid.uuid4()}"
    async with s3_client(settings) as s3:
        await s3.upload_file(str(path), settings.s3_bucket, key)
        head = await s3.head_object(Bucket=settings.s3_bucket, Key=key)
    return key, int(head["ContentLength"])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# ------------------------------------------------------------------------------------------ 1. rendition


@contextlib.asynccontextmanager
async def as_encode(nc: NATS) -> AsyncIterator[tuple[dict[str, asyncio.Future[OutputResult]], dict[str, str]]]:
    """The bench in encode's place: results answered, heartbeats read (worker name -> instance)."""
    waiting: dict[str, asyncio.Future[OutputResult]] = {}
    instances: dict[str, str] = {}

    async def on_result(msg: Msg) -> None:
        result = OutputResult.model_validate_json(msg.data)
        await msg.respond(ResultAck(recorded=True, applied=True).model_dump_json().encode())
        fut = waiting.get(result.video_id)
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def on_heartbeat(msg: Msg) -> None:
        hb = Heartbeat.model_validate_json(msg.data)
        instances[hb.worker] = hb.instance

    subs = [await nc.subscribe(RESULT_SUBJECT, cb=on_result), await nc.subscribe(HEARTBEAT_SUBJECT, cb=on_heartbeat)]
    try:
        yield waiting, instances
    finally:
        for s in subs:
            await s.unsubscribe()


async def rendition(settings: CommonSettings, work: Path, runs: int) -> Row:
    source = make_source(work / "1080p.mp4", height=1080, seconds=10)
    key, _ = await put(settings, source)
    height = 720
    media = MediaSettings()
    options = EncodeOptions(preset=media.media_x264_preset, crf=media.media_x264_crf,
                            audio_bitrate_kbps=media.media_audio_bitrate_kbps)
    nc = await connect(settings, name="bench-encode")
    worker_times: list[float] = []
    alone_times: list[float] = []
    with service(settings, "media-1", work, media_slots=2, media_worker_id="bench-1", media_hls=False):
        async with as_encode(nc) as (waiting, instances), s3_client(settings) as s3:
            while "bench-1" not in instances:
                await asyncio.sleep(0.05)
            stored = await open_source(s3, settings.s3_bucket, key)
            assert stored.sniffed.container is not None
            alone_args = encode_args(stored.url, skip=stored.sniffed.id3_bytes_skipped,
                                     container=stored.sniffed.container, height=height,
                                     output=str(work / "alone.mp4"), options=options)
            for _ in range(runs):
                t0 = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(ffmpeg_exe(), *alone_args, stdout=subprocess.DEVNULL,
                                                            stderr=subprocess.DEVNULL)
                assert await proc.wait() == 0
                alone_times.append(time.perf_counter() - t0)

                video_id = str(uuid.uuid4())
                waiting[video_id] = asyncio.get_running_loop().create_future()
                offer = Offer(video_id=video_id, output=height, attempt=1, job_class=JobClass.FIRST_PARTY,
                              object_key=key)
                t0 = time.perf_counter()
                reply = await nc.request(offer_subject(instances["bench-1"]), offer.model_dump_json().encode(),
                                         timeout=5)
                assert OfferAnswer.model_validate_json(reply.data).accepted
                result = await asyncio.wait_for(waiting[video_id], 300)
                worker_times.append(time.perf_counter() - t0)
                assert result.outcome == Outcome.COMPLETED, result
    await nc.close()
    alone, worker = statistics.median(alone_times), statistics.median(worker_times)
    return {"figure": "rendition", "source": "1080p 10 s -> 720p", "runs": runs,
            "alone_s": round(alone, 3), "worker_s": round(worker, 3), "ratio": round(worker / alone, 3),
            "ratio_of_fastest": round(min(worker_times) / min(alone_times), 3),
            "alone_all": [round(t, 3) for t in alone_times], "worker_all": [round(t, 3) for t in worker_times]}


# ------------------------------------------------------------------------------------------- 2. latency


WARMUP = 5
STARTED: dict[str, asyncio.Event] = {}
COMPLETED: dict[str, asyncio.Event] = {}


@contextlib.asynccontextmanager
async def encode_events(nc: NATS) -> AsyncIterator[dict[str, list[Envelope]]]:
    by_type: dict[str, list[Envelope]] = {"encode.started": [], "encode.completed": []}

    async def on(msg: Msg) -> None:
        if msg.headers and msg.headers.get(HDR_LEGACY_COPY) == "1":
            return  # the same event is on its account subject too
        envelope = Envelope.from_bytes(msg.data)
        if envelope.type in by_type:
            by_type[envelope.type].append(envelope)
        if envelope.type == "encode.started":
            STARTED.setdefault(envelope.subject, asyncio.Event()).set()
        if envelope.type == "encode.completed" and envelope.data.get("outputs_remaining") == 0:
            COMPLETED.setdefault(envelope.subject, asyncio.Event()).set()

    sub = await nc.subscribe("encode.>", cb=on)
    try:
        yield by_type
    finally:
        await sub.unsubscribe()


async def announce(nc: NATS, key: str, size: int, height: int) -> tuple[str, float]:
    video_id = str(uuid.uuid4())
    event = new_event(UploadCompleted(video_id=video_id, app_id=video_id, account_id=video_id, key_id=video_id,
                                      object_key=key, size=size, content_type="video/mp4", source_height=height),
                      source="api", subject=video_id)
    sent = time.time()
    await nc.jetstream().publish(event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id})
    return video_id, sent


async def latency(settings: CommonSettings, work: Path, samples: int) -> Row:
    source = make_source(work / "240p.mp4", height=240, seconds=1)
    key, size = await put(settings, source)
    nc = await connect(settings, name="bench-latency")
    latencies: list[float] = []
    sent_at: dict[str, float] = {}
    with contextlib.ExitStack() as procs:
        procs.enter_context(service(settings, "encode", work))
        for i in (1, 2):
            procs.enter_context(service(settings, f"media-{i}", work, media_slots=8, media_worker_id=f"bench-{i}"))
        async with encode_events(nc) as events:
            await asyncio.sleep(1.0)  # the workers' first heartbeats
            for i in range(WARMUP + samples):
                video_id, sent = await announce(nc, key, size, 240)
                sent_at[video_id] = sent
                await asyncio.wait_for(STARTED.setdefault(video_id, asyncio.Event()).wait(), 10)
                started = next(e for e in events["encode.started"] if e.subject == video_id)
                if i < WARMUP:  # the first uploads of a fresh encode (connections, prepared statements) are not kept
                    del sent_at[video_id]
                else:
                    latencies.append(started.time.timestamp() - sent)
                # the next upload comes once this one is encoded: its slot is free, and its ffmpeg no longer
                # shares the 2 cores with the next measurement
                await asyncio.wait_for(COMPLETED.setdefault(video_id, asyncio.Event()).wait(), 30)
            deadline = time.monotonic() + 60
            while len(events["encode.completed"]) < WARMUP + samples and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # nothing of this figure is left running into the next
            done = len(events["encode.completed"])
    await nc.close()
    # where the time goes: the consumer's transaction (processing starts), the round's first transaction (offered)
    conn = await asyncpg.connect(settings.database_url)
    try:
        rows = await conn.fetch(
            "SELECT v.video_id, v.processing_started_at AS opened, o.offered_at, o.started_at FROM encode.videos v"
            " JOIN encode.outputs o USING (video_id) WHERE v.video_id = ANY($1)", list(sent_at))
    finally:
        await conn.close()
    consumed = [r["opened"].timestamp() - sent_at[r["video_id"]] for r in rows]
    offered = [(r["offered_at"] - r["opened"]).total_seconds() for r in rows]
    accepted = [(r["started_at"] - r["offered_at"]).total_seconds() for r in rows]
    return {"figure": "latency", "samples": samples, "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p99_ms": round(pct(latencies, 0.99) * 1000, 1), "max_ms": round(max(latencies) * 1000, 1),
            "completed": done, "slowest_samples": sorted(range(len(latencies)), key=lambda i: -latencies[i])[:3],
            "p50_ms_parts": {"published->opened": round(statistics.median(consumed) * 1000, 1),
                             "opened->offered": round(statistics.median(offered) * 1000, 1),
                             "offered->accepted": round(statistics.median(accepted) * 1000, 1)},
            "p99_ms_parts": {"published->opened": round(pct(consumed, 0.99) * 1000, 1),
                             "opened->offered": round(pct(offered, 0.99) * 1000, 1),
                             "offered->accepted": round(pct(accepted, 0.99) * 1000, 1)}}


# --------------------------------------------------------------------------------------- 3. utilisation


async def utilisation(settings: CommonSettings, work: Path, videos: int) -> Row:
    source = make_source(work / "720p.mp4", height=720, seconds=4)
    key, size = await put(settings, source)
    slots = 2  # one developer slot on each worker (the other is kept for first-party jobs)
    usable = 2 * (slots - 1)
    nc = await connect(settings, name="bench-utilisation")
    with contextlib.ExitStack() as procs:
        procs.enter_context(service(settings, "encode", work))
        for i in (1, 2):
            procs.enter_context(service(settings, f"media-{i}", work, media_slots=slots,
                                        media_worker_id=f"util-{i}"))
        async with encode_events(nc) as events:
            await asyncio.sleep(1.0)
            ids = [(await announce(nc, key, size, 720))[0] for _ in range(videos)]
            wanted = {(v, h) for v in ids for h in (360, 720)}
            deadline = time.monotonic() + 60 * videos
            while {(e.subject, e.data["output"]) for e in events["encode.completed"]} < wanted:
                if time.monotonic() > deadline:
                    raise RuntimeError("the backlog did not finish")
                await asyncio.sleep(0.1)
            started = {(e.subject, e.data["output"]): e.time for e in events["encode.started"] if e.subject in ids}
    await nc.close()
    conn = await asyncpg.connect(settings.database_url)
    try:
        rows = await conn.fetch("SELECT video_id, output, recorded_at FROM media.results WHERE video_id = ANY($1)",
                                ids)
    finally:
        await conn.close()
    freed: dict[tuple[str, int], datetime] = {(r["video_id"], r["output"]): r["recorded_at"] for r in rows}
    busy = sum((freed[k] - started[k]).total_seconds() for k in wanted)
    window = (max(freed[k] for k in wanted) - min(started[k] for k in wanted)).total_seconds()
    gaps = sorted((freed[k] - started[k]).total_seconds() for k in wanted)
    return {"figure": "utilisation", "videos": videos, "outputs": len(wanted), "workers": 2, "usable_slots": usable,
            "window_s": round(window, 2), "busy_slot_s": round(busy, 2),
            "utilisation": round(busy / (usable * window), 4), "job_s_median": round(statistics.median(gaps), 3)}


# ------------------------------------------------------------------------------------------ 4. playback


async def heard_twice(nc: NATS, worker: str) -> None:
    """Until two heartbeats of `worker` came: encode, which hears the same ones, knows it by then."""
    beats = 0
    heard = asyncio.Event()

    async def on(msg: Msg) -> None:
        nonlocal beats
        if Heartbeat.model_validate_json(msg.data).worker == worker:
            beats += 1
            if beats >= 2:
                heard.set()

    sub = await nc.subscribe(HEARTBEAT_SUBJECT, cb=on)
    try:
        await asyncio.wait_for(heard.wait(), 30)
    finally:
        await sub.unsubscribe()


async def playback(settings: CommonSettings, work: Path, rounds: int, seconds: int, slots: int) -> Row:
    """One encode; per round a fresh worker with HLS and artwork on (`media_hls`) or off, alternating, and one upload
    of the same 1080p source. Whole ladder: upload.completed published -> the encode.completed of its last output
    (its time is encode's commit of the result). First segment playable: -> the encode.completed of the lowest
    output, whose result encode records once its media playlist, init and segments are all in storage (the worker
    stores the playlist last). Each round waits for its video to be ready, so the rounds never overlap."""
    source = make_source(work / f"1080p-{seconds}s.mp4", height=1080, seconds=seconds)
    key, size = await put(settings, source)
    nc = await connect(settings, name="bench-playback")
    whole: dict[bool, list[float]] = {True: [], False: []}
    first: list[float] = []
    with service(settings, "encode", work):
        async with encode_events(nc) as events:
            for i in range(2 * rounds):
                hls = (i % 2 == 0) != (i // 2 % 2 == 1)  # HLS, MP4, MP4, HLS, ...: neither side always first
                name = f"playback-{i}"
                with service(settings, "media-1", work, media_slots=slots, media_worker_id=name, media_hls=hls):
                    await heard_twice(nc, name)
                    video_id, sent = await announce(nc, key, size, 1080)
                    await asyncio.wait_for(COMPLETED.setdefault(video_id, asyncio.Event()).wait(), 60 * seconds)
                done = sorted((e for e in events["encode.completed"] if e.subject == video_id),
                              key=lambda e: e.data["output"])
                assert (done[0].data.get("hls") is not None) == hls, "the worker packaged as told"
                whole[hls].append(max(e.time.timestamp() for e in done) - sent)
                if hls:
                    assert done[0].data.get("artwork") is not None, "the lowest output made the artwork"
                    first.append(done[0].time.timestamp() - sent)
                print(f"   round {i + 1}: {'HLS + artwork' if hls else 'MP4 only'}: whole ladder "
                      f"{whole[hls][-1]:.2f} s" + (f", lowest playable {first[-1]:.2f} s" if hls else ""), flush=True)
    await nc.close()
    with_hls, mp4_only = statistics.median(whole[True]), statistics.median(whole[False])
    first_ratios = [f / w for f, w in zip(first, whole[True], strict=True)]
    return {"figure": "playback", "source": f"1080p {seconds} s, ladder 360p-1080p", "rounds": rounds,
            "slots": slots, "hls_s": round(with_hls, 3), "mp4_only_s": round(mp4_only, 3),
            "ratio": round(with_hls / mp4_only, 3), "first_segment_s": round(statistics.median(first), 3),
            "first_ratio": round(statistics.median(first_ratios), 3),
            "hls_all": [round(t, 3) for t in whole[True]], "mp4_only_all": [round(t, 3) for t in whole[False]]}


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--videos", type=int, default=20)
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--rendition-runs", type=int, default=5)
    parser.add_argument("--playback-rounds", type=int, default=3, help="rounds of each kind (HLS, MP4 only)")
    parser.add_argument("--playback-seconds", type=int, default=20, help="length of the 1080p source")
    parser.add_argument("--playback-slots", type=int, default=4, help="the worker's slots (one kept for first-party)")
    parser.add_argument("--only", choices=["rendition", "latency", "utilisation", "playback"], default=None)
    args = parser.parse_args()
    rows: list[Row] = []
    with servers() as settings, tempfile.TemporaryDirectory(prefix="weir-bench-encode-") as tmp:
        work = Path(tmp)
        asyncio.run(prepare(settings))
        if args.only in (None, "rendition"):
            rows.append(asyncio.run(rendition(settings, work, args.rendition_runs)))
            r = rows[-1]
            print(f"1. rendition ({r['source']}), medians: alone {r['alone_s']} s, worker {r['worker_s']} s, ratio "
                  f"{r['ratio']} (goal <= 1.05); fastest runs' ratio {r['ratio_of_fastest']}; runs alone "
                  f"{r['alone_all']}, worker {r['worker_all']}", flush=True)
        if args.only in (None, "latency"):
            rows.append(asyncio.run(latency(settings, work, args.latency_samples)))
            r = rows[-1]
            print(f"2. upload.completed -> first output accepted, {r['samples']} uploads one at a time: "
                  f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms (goal <= 100), max {r['max_ms']} ms; "
                  f"p50 parts {r['p50_ms_parts']}, p99 parts {r['p99_ms_parts']}", flush=True)
        if args.only in (None, "utilisation"):
            rows.append(asyncio.run(utilisation(settings, work, args.videos)))
            r = rows[-1]
            print(f"3. utilisation, {r['workers']} workers, {r['videos']} videos ({r['outputs']} outputs), "
                  f"{r['usable_slots']} usable slots: {r['utilisation'] * 100:.1f} % busy over {r['window_s']} s "
                  f"(goal >= 95 %); median job {r['job_s_median']} s", flush=True)
        if args.only in (None, "playback"):
            rows.append(asyncio.run(playback(settings, work, args.playback_rounds, args.playback_seconds,
                                             args.playback_slots)))
            r = rows[-1]
            print(f"4. playback ({r['source']}, {r['slots']} slots, medians of {r['rounds']} alternate rounds): whole "
                  f"ladder with HLS and artwork {r['hls_s']} s, MP4 only {r['mp4_only_s']} s, ratio {r['ratio']} "
                  f"(goal <= 1.1); lowest rendition playable after {r['first_segment_s']} s, "
                  f"{r['first_ratio']} of the whole ladder (goal <= 0.5)", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
