"""The source video's size, read cheaply with `ffmpeg -i` (imageio-ffmpeg ships no ffprobe).

ffmpeg reads a presigned URL itself with ranged GETs, so only the headers (and at most `probesize` bytes of media)
cross the network, not the whole upload. `parse_ffmpeg_info` is pure; `probe` is the one I/O seam.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

from shared.media.content import Container

log = logging.getLogger("weir.media.probe")

PROBE_TIMEOUT_S = 20.0
PROBE_BYTES = 2_000_000  # ffmpeg -probesize: enough for a TS stream's first keyframe, far below a whole upload
PROBE_DURATION_US = 2_000_000  # ffmpeg -analyzeduration, in microseconds
STDERR_CAP = 256 * 1024  # a damaged file can make ffmpeg log without end; the stream list comes first

# ffmpeg's demuxer for each accepted container. Only these may ever open an upload (-format_whitelist): left to
# guess, ffmpeg reads a text file as an "ansi" video of 640x400, and an MP3's cover art as a video stream.
DEMUXER: dict[Container, str] = {
    Container.MP4: "mov",
    Container.MATROSKA: "matroska",
    Container.AVI: "avi",
    Container.MPEGTS: "mpegts",
}
FORMAT_WHITELIST = ",".join(DEMUXER.values())


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """The first video stream of a file.

    display_width, display_height: as shown, after rotation (1920x1080 coded with rotation 90 shows 1080x1920);
        the shorter of the two is the side the encode ladder starts from (a rendition's p is its shorter side).
    coded_width, coded_height: as stored in the stream.
    rotation: clockwise degrees, 0 to 359 (the old `rotate` tag's convention).
    duration: the container's duration in seconds, None when ffmpeg reports N/A.
    """

    display_width: int
    display_height: int
    codec: str
    duration: float | None
    rotation: int
    coded_width: int
    coded_height: int


_STREAM = re.compile(r"^\s*Stream #0:\d+")
_VIDEO_STREAM = re.compile(r"^\s*Stream #0:\d+(?:\[[^\]]*\])?(?:\([^)]*\))?:\s*Video:\s*(?P<desc>.*)$")
_SIZE = re.compile(r"^(?P<w>\d+)x(?P<h>\d+)(?:\s|$)")
_DURATION = re.compile(r"^\s*Duration:\s*(?P<h>\d+):(?P<m>\d{2}):(?P<s>\d{2}(?:\.\d+)?)")
_DISPLAY_MATRIX = re.compile(r"display\s*matrix\s*:\s*rotation of\s*(?P<deg>[-+]?\d+(?:\.\d+)?)\s*degrees", re.I)
_ROTATE_TAG = re.compile(r"^\s*rotate\s*:\s*(?P<deg>[-+]?\d+(?:\.\d+)?)\s*$")
# lines that end a stream's block of Metadata / Side data (ffmpeg 4 indents streams like their metadata)
_BLOCK_END = re.compile(r"^(?:\S|\s*(?:Stream #|Program \d|Chapters?\b|Input #|Output #))")
_NOT_THE_PICTURE = ("(attached pic)", "(timed thumbnails)")  # cover art and thumbnails are not the video


def _top_level_parts(desc: str) -> list[str]:
    """Split a stream description at commas outside parentheses and brackets: "yuv420p(tv, bt709)" is one part."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(desc):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(desc[start:i].strip())
            start = i + 1
    parts.append(desc[start:].strip())
    return parts


def _clockwise_rotation(block: list[str]) -> int:
    """The stream's rotation from its display matrix (counter-clockwise) or, in older ffmpeg, its `rotate` tag."""
    for line in block:
        if m := _DISPLAY_MATRIX.search(line):
            return round(-float(m["deg"])) % 360
    for line in block:
        if m := _ROTATE_TAG.match(line):
            return round(float(m["deg"])) % 360
    return 0


def _duration(lines: list[str]) -> float | None:
    for line in lines:
        if m := _DURATION.match(line):
            return int(m["h"]) * 3600 + int(m["m"]) * 60 + float(m["s"])
    return None


def parse_ffmpeg_info(stderr: str) -> VideoInfo | None:
    """The first video stream (not cover art) of input #0 in `ffmpeg -hide_banner -i` output; None if there is none."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        m = _VIDEO_STREAM.match(line)
        if m is None or any(mark in line for mark in _NOT_THE_PICTURE):
            continue
        parts = _top_level_parts(m["desc"])
        size = next((s for p in parts if (s := _SIZE.match(p))), None)
        if size is None or int(size["w"]) == 0 or int(size["h"]) == 0:
            continue  # size unknown (the probe read too little, or a broken stream): not a usable video stream
        block: list[str] = []
        for following in lines[i + 1 :]:
            if _BLOCK_END.match(following):
                break
            block.append(following)
        coded_w, coded_h = int(size["w"]), int(size["h"])
        rotation = _clockwise_rotation(block)
        sideways = rotation in (90, 270)
        return VideoInfo(
            display_width=coded_h if sideways else coded_w,
            display_height=coded_w if sideways else coded_h,
            codec=parts[0].split(maxsplit=1)[0] if parts[0] else "unknown",
            duration=_duration(lines[:i]),
            rotation=rotation,
            coded_width=coded_w,
            coded_height=coded_h,
        )
    return None


def is_remote(url_or_path: str) -> bool:
    return url_or_path.startswith(("http://", "https://"))


def ffmpeg_input(url_or_path: str, *, skip: int = 0) -> str:
    """The `-i` argument that makes ffmpeg read url_or_path as if it began `skip` bytes in.

    An MP4 behind ID3 tags cannot be opened by ffmpeg ("moov atom not found"), and -skip_initial_bytes leaves its
    sample offsets pointing `skip` bytes too early; the subfile protocol shifts every read, so offsets stay right.
    Anything that reads an accepted upload (the encoder too) must open it this way with the sniffed id3_bytes_skipped.
    """
    # a local path is always a file: a colon in it must not be taken for a protocol
    source = url_or_path if is_remote(url_or_path) else f"file:{url_or_path}"
    if skip <= 0:
        return source
    return f"subfile,,start,{skip},end,0,,:{source}"


def ffmpeg_protocols(url_or_path: str, *, skip: int = 0) -> str:
    """The -protocol_whitelist for that input: nothing but what it needs (no concat, no playlists fetching others)."""
    protocols = ["https", "http", "tls", "tcp"] if is_remote(url_or_path) else ["file"]
    if skip > 0:
        protocols.append("subfile")
    return ",".join(protocols)


def ffmpeg_probe_args(
    url_or_path: str,
    *,
    skip: int = 0,
    container: Container | None = None,
    probesize: int = PROBE_BYTES,
    analyzeduration_us: int = PROBE_DURATION_US,
) -> list[str]:
    """ffmpeg's arguments (after the executable) for reading the stream list of url_or_path and nothing more."""
    args = [
        "-hide_banner", "-nostdin",
        "-probesize", str(probesize), "-analyzeduration", str(analyzeduration_us),
        "-protocol_whitelist", ffmpeg_protocols(url_or_path, skip=skip),
        "-format_whitelist", FORMAT_WHITELIST,
    ]  # fmt: skip
    if container is not None:
        args += ["-f", DEMUXER[container]]
    return [*args, "-i", ffmpeg_input(url_or_path, skip=skip)]


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    exe: str = imageio_ffmpeg.get_ffmpeg_exe()
    return exe


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(64 * 1024):
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    return bytes(kept)


async def probe(
    url_or_path: str,
    *,
    timeout: float = PROBE_TIMEOUT_S,
    skip: int = 0,
    container: Container | None = None,
    probesize: int = PROBE_BYTES,
    analyzeduration_us: int = PROBE_DURATION_US,
) -> VideoInfo | None:
    """The first video stream of url_or_path (a presigned http(s) URL or a local path); None when it cannot be read.

    skip: bytes of ID3 tags before the content (SniffResult.id3_bytes_skipped); without it ffmpeg cannot open an
        MP4 behind ID3 tags. container: the sniffed container, to force its demuxer (else ffmpeg picks among the four).
    ffmpeg is killed when the timeout passes or the caller is cancelled. Failures are logged without the URL (a
    presigned URL is a credential for its lifetime).
    """
    args = ffmpeg_probe_args(
        url_or_path, skip=skip, container=container, probesize=probesize, analyzeduration_us=analyzeduration_us
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            ffmpeg_exe(), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    except OSError as exc:
        log.warning("probe: cannot start ffmpeg: %s", exc)
        return None
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(timeout):
            raw = await _read_capped(proc.stderr, STDERR_CAP)
            await proc.wait()
    except TimeoutError:
        log.warning("probe: ffmpeg gave no answer within %.1f s", timeout)
        return None
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
    stderr = raw.decode("utf-8", errors="replace")
    info = parse_ffmpeg_info(stderr)
    if info is None:
        last = stderr.strip().splitlines()[-1:] or [""]
        log.info("probe: no video stream found (ffmpeg: %s)", last[0].replace(url_or_path, "<source>")[:300])
    return info
