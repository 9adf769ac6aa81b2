"""A worker's decisions as plain functions: which offers it takes, the ffmpeg commands (the rendition, its HLS
packaging, the poster and storyboard), reading what ffmpeg says, the storyboard's grid and WebVTT.

No I/O and no clock.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from shared.media.content import Container
from shared.media.probe import DEMUXER, FORMAT_WHITELIST, ffmpeg_input, ffmpeg_protocols
from shared.videos import JobClass, is_large_output


@dataclass(frozen=True, slots=True)
class Slotted:
    """What admission needs to know of a job a worker runs (or is offered)."""

    job_class: JobClass
    height: int


class Refusal(StrEnum):
    FULL = "full"  # every slot is taken
    RESERVED = "reserved"  # the last free slot is kept for first-party jobs
    LARGE_RUNNING = "large_running"  # a large developer output (large_output_height and up) already runs here
    LEAVING = "leaving"  # SIGTERM: the worker takes no more work


def developer_capacity(slots: int) -> int:
    """Developer jobs fill at most slots - 1: one slot on every worker is kept for first-party jobs."""
    return max(0, slots - 1)


def admission(slots: int, running: Iterable[Slotted], offered: Slotted, *, large_height: int,
              leaving: bool = False) -> Refusal | None:
    """None when the worker takes the offered job now, else why it answers busy. It never queues a job.

    The caller checks and reserves in one step with no await between, so two offers racing for the last slot
    cannot both be taken.
    """
    if leaving:
        return Refusal.LEAVING
    jobs = list(running)
    if len(jobs) >= slots:
        return Refusal.FULL
    if offered.job_class == JobClass.DEVELOPER:
        if sum(1 for j in jobs if j.job_class == JobClass.DEVELOPER) >= developer_capacity(slots):
            return Refusal.RESERVED
        if is_large_output(offered.job_class, offered.height, large_height) and any(
                is_large_output(j.job_class, j.height, large_height) for j in jobs):
            return Refusal.LARGE_RUNNING
    return None


# --------------------------------------------------------------------------------------------- ffmpeg


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    preset: str = "veryfast"
    crf: int = 23
    audio_bitrate_kbps: int = 128
    read_rate: float = 0.0  # 0: as fast as ffmpeg reads
    keyframe_seconds: float = 2.0  # a keyframe at every multiple of this, in every rendition


def ffmpeg_niceness(*, first_playable: bool, ladder_nice: int) -> int:
    """The niceness a job's ffmpeg runs at: the job of the video's lowest output (its first playable rendition, the
    one that also makes the artwork, SPEC 14) at the worker's own; every other one `ladder_nice` lower in priority,
    so that on a busy worker the first playable rendition does not share the CPU evenly with larger ones."""
    return 0 if first_playable else ladder_nice


def keyframe_args(seconds: float) -> list[str]:
    """Keyframes at the same times in every rendition of a source: forced at each multiple of `seconds` (the first
    frame at or after it; every rendition keeps the source's frames and their times), and none elsewhere (no
    scene-cut keyframes), so HLS segments cut on them align across the ladder."""
    return ["-force_key_frames", f"expr:gte(t,n_forced*{seconds:g})", "-sc_threshold", "0"]


def source_input(source: str, *, skip: int, container: Container, read_rate: float = 0.0,
                 seek: float | None = None) -> list[str]:
    """ffmpeg's arguments that open an upload: only its own container's demuxer and the protocols it needs.
    `seek`: start decoding there (an input seek: only from the keyframe before it)."""
    args = [
        "-protocol_whitelist", ffmpeg_protocols(source, skip=skip),
        "-format_whitelist", FORMAT_WHITELIST,
        "-f", DEMUXER[container],
    ]  # fmt: skip
    if read_rate > 0:
        args += ["-readrate", f"{read_rate:g}"]
    if seek is not None:
        args += ["-ss", f"{seek:.3f}"]
    return [*args, "-i", ffmpeg_input(source, skip=skip)]


def scale_filter(side: int) -> str:
    """Scale a rendition to `side`p: its shorter side `side` (landscape and square: `side` lines tall, as before;
    portrait: `side` pixels wide), keeping the aspect ratio, never up. The other side follows, rounded to the nearest
    even number (-2: an odd side kept whole may gain a pixel); a source smaller than `side` on its shorter side keeps
    that side, made even for H.264 in 4:2:0.

    Applied after ffmpeg's autorotation, so `iw` and `ih` are the size as shown (a phone's 1920x1080 coded with
    rotation 90 is a portrait 1080x1920).
    """
    return (f"scale=w='if(gte(iw,ih),-2,trunc(min(iw,{side})/2)*2)'"
            f":h='if(gte(iw,ih),trunc(min(ih,{side})/2)*2,-2)'")


def height_cap_filter(max_height: int) -> str:
    """Scale to at most `max_height` lines tall whatever the orientation, keeping the aspect ratio, never up (the
    poster's cap, `media_poster_max_height`); a shorter picture keeps its height, made even."""
    return f"scale=-2:'trunc(min(ih,{max_height})/2)*2'"


def encode_args(
    source: str, *, skip: int, container: Container, height: int, output: str, options: EncodeOptions
) -> list[str]:
    """ffmpeg's arguments (after the executable): source (a presigned URL or a path) to an H.264/AAC MP4 at `height`p
    (the output's rung: its shorter side, `scale_filter`).

    `-progress pipe:1` writes key=value blocks to stdout (read by `ProgressReader`); stderr carries the input's
    description (its Duration) and errors.
    """
    return [
        "-hide_banner", "-nostdin", "-nostats", "-y",
        *source_input(source, skip=skip, container=container, read_rate=options.read_rate),
        "-map", "0:v:0", "-map", "0:a:0?",
        "-vf", scale_filter(height),
        "-c:v", "libx264", "-preset", options.preset, "-crf", str(options.crf), "-pix_fmt", "yuv420p",
        *keyframe_args(options.keyframe_seconds),
        "-c:a", "aac", "-b:a", f"{options.audio_bitrate_kbps}k",
        "-movflags", "+faststart",
        "-progress", "pipe:1",
        "-f", "mp4", output,
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ HLS

HLS_PLAYLIST = "index.m3u8"
HLS_INIT = "init.mp4"
HLS_SEGMENT_PATTERN = "seg-%05d.m4s"
CONTENT_TYPES = {".m3u8": "application/vnd.apple.mpegurl", ".mp4": "video/mp4", ".m4s": "video/iso.segment",
                 ".jpg": "image/jpeg", ".vtt": "text/vtt"}


def content_type(name: str) -> str:
    """The Content-Type a packaged file is stored with (players and browsers go by it)."""
    for suffix, kind in CONTENT_TYPES.items():
        if name.endswith(suffix):
            return kind
    return "application/octet-stream"


def hls_args(rendition: str, directory: str, *, segment_seconds: float) -> list[str]:
    """The rendition's MP4 remuxed (no encoding) to CMAF: a VOD media playlist, an init segment and fMP4 segments of
    `segment_seconds`, each cut on a keyframe (they fall on multiples of the keyframe interval)."""
    return [
        "-hide_banner", "-nostdin", "-nostats", "-y", "-loglevel", "error",
        "-i", rendition,
        "-map", "0", "-c", "copy",
        "-f", "hls", "-hls_segment_type", "fmp4", "-hls_time", f"{segment_seconds:g}",
        "-hls_playlist_type", "vod", "-hls_flags", "independent_segments",
        "-hls_fmp4_init_filename", HLS_INIT,
        "-hls_segment_filename", f"{directory}/{HLS_SEGMENT_PATTERN}",
        f"{directory}/{HLS_PLAYLIST}",
    ]  # fmt: skip


# -------------------------------------------------------------------------------------- poster, storyboard

POSTER = "poster.jpg"
SPRITE = "sprite.jpg"
STORYBOARD = "storyboard.vtt"


def poster_time(requested: float, duration: float) -> float:
    """The poster's time, inside the video: the requested time, at most half-way through (a short video's)."""
    if duration <= 0:
        return 0.0
    return round(min(max(requested, 0.0), duration / 2), 3)


def poster_args(source: str, *, skip: int, container: Container, at: float, max_height: int, output: str,
                quality: int) -> list[str]:
    """One JPEG of the source at `at` seconds (decoded from the keyframe before it), its size capped at
    `max_height` lines."""
    return [
        "-hide_banner", "-nostdin", "-nostats", "-y", "-loglevel", "error",
        *source_input(source, skip=skip, container=container, seek=at),
        "-map", "0:v:0", "-vf", height_cap_filter(max_height),
        "-frames:v", "1", "-q:v", str(quality), "-update", "1", "-f", "image2", output,
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoryboardPlan:
    """The tiles of a storyboard: one every `interval` seconds (a whole number of keyframe intervals, so every tile
    is a keyframe: the storyboard decodes nothing else), at most `max_tiles`, in a grid `columns` wide."""

    interval: float
    tiles: int  # tiles expected: one per interval begun
    columns: int
    rows: int


def storyboard_plan(duration: float, *, keyframe_seconds: float, max_tiles: int, columns: int) -> StoryboardPlan:
    steps = max(1, math.ceil(duration / (keyframe_seconds * max_tiles) - 1e-9))
    interval = float(steps * keyframe_seconds)
    tiles = min(max_tiles, max(1, math.ceil(duration / interval - 1e-9)))
    width = min(columns, tiles)
    return StoryboardPlan(interval=interval, tiles=tiles, columns=width, rows=math.ceil(tiles / width))


def storyboard_args(rendition: str, *, plan: StoryboardPlan, keyframe_seconds: float, tile_width: int, output: str,
                    quality: int) -> list[str]:
    """The sprite: keyframes only are decoded (`-skip_frame nokey`), one kept every plan.interval (the first at or
    past half a keyframe interval before it is due), scaled to `tile_width`, tiled row by row. `showinfo` logs each
    tile kept (`storyboard_tile`), so the WebVTT lists only tiles that exist."""
    keep = f"select='isnan(prev_selected_t)+gte(t-prev_selected_t,{plan.interval - keyframe_seconds / 2:g})'"
    return [
        "-hide_banner", "-nostdin", "-nostats", "-y", "-loglevel", "info",
        "-skip_frame", "nokey", "-i", rendition,
        "-map", "0:v:0", "-an",
        "-vf", f"{keep},showinfo,scale={tile_width}:-2,tile={plan.columns}x{plan.rows}",
        "-fps_mode", "passthrough", "-frames:v", "1", "-q:v", str(quality), "-update", "1", "-f", "image2", output,
    ]  # fmt: skip


_SHOWINFO_FRAME = re.compile(r"\[Parsed_showinfo_\d+ @ [^\]]*\]\s+n:\s*\d+\s+pts:")


def storyboard_tile(stderr_line: str) -> bool:
    """Whether a line of ffmpeg's stderr is showinfo's line of one frame (one tile) of the storyboard."""
    return _SHOWINFO_FRAME.search(stderr_line) is not None


def vtt_time(seconds: float) -> str:
    ms = round(max(seconds, 0.0) * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


def storyboard_vtt(plan: StoryboardPlan, *, tiles: int, tile_width: int, tile_height: int, duration: float,
                   sprite: str = SPRITE) -> str:
    """The WebVTT of a storyboard: cue i covers [i * interval, (i + 1) * interval), the last one until the end of the
    video, and names tile i of the sprite (row by row) as `sprite#xywh=x,y,w,h`, relative to the VTT file."""
    count = max(1, min(tiles, plan.columns * plan.rows))
    lines = ["WEBVTT", ""]
    for i in range(count):
        start = i * plan.interval
        end = duration if i == count - 1 else (i + 1) * plan.interval
        x, y = (i % plan.columns) * tile_width, (i // plan.columns) * tile_height
        lines += [f"{vtt_time(start)} --> {vtt_time(max(end, start))}",
                  f"{sprite}#xywh={x},{y},{tile_width},{tile_height}", ""]
    return "\n".join(lines)


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a JPEG, from its start-of-frame marker."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG")
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise ValueError("a JPEG marker was expected")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker in _SOF and pos + 9 <= len(data):
            height, width = struct.unpack_from(">HH", data, pos + 5)
            return width, height
        pos += 2 + length
    raise ValueError("a JPEG without a frame header")


def duration_seconds(stderr_line: str) -> float | None:
    """The input's duration from ffmpeg's `  Duration: 00:01:02.50, start: ...` line; None for any other line."""
    line = stderr_line.strip()
    if not line.startswith("Duration:"):
        return None
    value = line[len("Duration:") :].split(",", 1)[0].strip()
    try:
        h, m, s = value.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    except ValueError:
        return None  # "N/A"


@dataclass
class ProgressReader:
    """Reads ffmpeg's `-progress` blocks line by line; `feed` returns the fraction done at the end of each block."""

    duration: float | None = None
    _out_time_us: int | None = None
    ended: bool = False

    def feed(self, line: str) -> float | None:
        key, sep, value = line.strip().partition("=")
        if not sep:
            return None
        if key in ("out_time_us", "out_time_ms"):  # both are microseconds (ffmpeg's historical naming)
            try:
                self._out_time_us = int(value)
            except ValueError:
                pass  # N/A before the first frame
            return None
        if key != "progress":
            return None
        if value == "end":
            self.ended = True
            return 1.0
        return progress_fraction(self._out_time_us, self.duration)

    @property
    def out_time_seconds(self) -> float | None:
        return None if self._out_time_us is None else self._out_time_us / 1e6


def progress_fraction(out_time_us: int | None, duration: float | None) -> float | None:
    """Fraction done, from 0 to 1; None while either is unknown. Never 1 before ffmpeg says `progress=end`."""
    if out_time_us is None or duration is None or duration <= 0:
        return None
    return min(max(out_time_us / 1e6 / duration, 0.0), 0.999)
