"""A worker's decisions as plain functions: which offers it takes, the ffmpeg command, reading ffmpeg's progress.

No I/O and no clock.
"""

from __future__ import annotations

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


def scale_filter(height: int) -> str:
    """Scale to `height` keeping the aspect ratio, never up: a shorter source keeps its height (made even for H.264).

    Applied after ffmpeg's autorotation, so `ih` is the height as shown.
    """
    return f"scale=-2:'trunc(min(ih,{height})/2)*2'"


def encode_args(
    source: str, *, skip: int, container: Container, height: int, output: str, options: EncodeOptions
) -> list[str]:
    """ffmpeg's arguments (after the executable): source (a presigned URL or a path) to an H.264/AAC MP4 at `height`.

    `-progress pipe:1` writes key=value blocks to stdout (read by `ProgressReader`); stderr carries the input's
    description (its Duration) and errors.
    """
    args = [
        "-hide_banner", "-nostdin", "-nostats", "-y",
        "-protocol_whitelist", ffmpeg_protocols(source, skip=skip),
        "-format_whitelist", FORMAT_WHITELIST,
        "-f", DEMUXER[container],
    ]  # fmt: skip
    if options.read_rate > 0:
        args += ["-readrate", f"{options.read_rate:g}"]
    args += [
        "-i", ffmpeg_input(source, skip=skip),
        "-map", "0:v:0", "-map", "0:a:0?",
        "-vf", scale_filter(height),
        "-c:v", "libx264", "-preset", options.preset, "-crf", str(options.crf), "-pix_fmt", "yuv420p",
        "-c:a", "aac", "-b:a", f"{options.audio_bitrate_kbps}k",
        "-movflags", "+faststart",
        "-progress", "pipe:1",
        "-f", "mp4", output,
    ]  # fmt: skip
    return args


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
