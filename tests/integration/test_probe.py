"""The content check and the probe on real media, generated here with imageio-ffmpeg (nothing is committed).

No Weir server is needed: files are read from a temp dir, and over HTTP from a small ranged server in a thread,
as ffmpeg reads a presigned S3 URL.
"""

from __future__ import annotations

import asyncio
import http.server
import random
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared.media import probe as probe_module
from shared.media.content import (
    HEAD_READ,
    ID3_FOOTER_SIZE,
    ID3_HEADER_SIZE,
    Container,
    SniffResult,
    sniff,
    sniff_object,
    syncsafe,
)
from shared.media.probe import ffmpeg_exe, ffmpeg_input, probe

FFMPEG = ffmpeg_exe()
LAVFI_VIDEO = "testsrc=size={size}:rate=25:duration=1"
LAVFI_AUDIO = "sine=duration=1"


def _encoders() -> set[str]:
    out = subprocess.run([FFMPEG, "-hide_banner", "-encoders"], capture_output=True, text=True, check=True).stdout
    return {m[1] for m in re.finditer(r"^\s*[VAS][.A-Z]{5}\s+(\S+)", out, re.M)}


ENCODERS = _encoders()


def ffmpeg(*args: str) -> None:
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y", *args], check=True, timeout=120)


def id3_tag(body: int, *, footer: bool = False) -> bytes:
    header = b"ID3\x04\x00" + (b"\x10" if footer else b"\x00") + syncsafe(body)
    return header + b"\x00" * body + (b"3DI" + header[3:] if footer else b"")


@dataclass(frozen=True)
class Sample:
    name: str
    encode: tuple[str, ...]  # ffmpeg arguments after the lavfi inputs
    container: Container
    width: int  # as displayed
    height: int
    codec: str
    needs: tuple[str, ...] = ()
    size: str = "1280x720"
    audio: bool = True


X264 = ("-c:v", "libx264", "-preset", "ultrafast")
AAC = ("-c:a", "aac")
SAMPLES = [
    Sample("clip.mp4", (*X264, *AAC), Container.MP4, 1280, 720, "h264"),
    Sample("small.mp4", (*X264, *AAC), Container.MP4, 426, 240, "h264", size="426x240"),
    Sample("faststart.mp4", (*X264, *AAC, "-movflags", "+faststart"), Container.MP4, 1280, 720, "h264"),
    Sample("video-only.mp4", X264, Container.MP4, 1280, 720, "h264", audio=False),
    Sample("clip.mov", (*X264, *AAC), Container.MP4, 1280, 720, "h264"),
    Sample("clip.mkv", (*X264, *AAC), Container.MATROSKA, 1280, 720, "h264"),
    Sample(
        "vp8.webm", ("-c:v", "libvpx", "-deadline", "realtime", "-c:a", "libopus"), Container.MATROSKA, 1280, 720,
        "vp8", needs=("libvpx", "libopus"),
    ),
    Sample(
        "vp9.webm", ("-c:v", "libvpx-vp9", "-deadline", "realtime", "-pix_fmt", "yuv420p", "-c:a", "libopus"),
        Container.MATROSKA, 426, 240, "vp9", needs=("libvpx-vp9", "libopus"), size="426x240",
    ),
    Sample("clip.avi", ("-c:v", "mpeg4", "-c:a", "libmp3lame"), Container.AVI, 1280, 720, "mpeg4",
           needs=("libmp3lame",)),
    Sample("clip.ts", (*X264, *AAC), Container.MPEGTS, 1280, 720, "h264"),
    Sample("clip.m2ts", (*X264, *AAC, "-f", "mpegts", "-mpegts_m2ts_mode", "1"), Container.MPEGTS, 1280, 720, "h264"),
]  # fmt: skip


def make(sample: Sample, out: Path) -> Path:
    missing = [e for e in sample.needs if e not in ENCODERS]
    if missing:
        pytest.skip(f"this ffmpeg has no {', '.join(missing)}")
    inputs = ["-f", "lavfi", "-i", LAVFI_VIDEO.format(size=sample.size)]
    if sample.audio:
        inputs += ["-f", "lavfi", "-i", LAVFI_AUDIO]
    ffmpeg(*inputs, *sample.encode, str(out))
    return out


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def mp4(media: Path) -> Path:
    return make(SAMPLES[0], media / "base.mp4")


@pytest.fixture(scope="module")
def id3_mp4(media: Path, mp4: Path) -> tuple[Path, int]:
    """The MP4 behind two ID3v2 tags, the second with a v2.4 footer; and the tags' length."""
    tags = id3_tag(1000) + id3_tag(333, footer=True)
    path = media / "id3.mp4"
    path.write_bytes(tags + mp4.read_bytes())
    return path, len(tags)


def read_file(path: Path) -> bytes:
    return path.read_bytes()


def head_of(path: Path) -> SniffResult:
    with path.open("rb") as f:
        data = f.read(HEAD_READ)
    return sniff(data, eof=len(data) < HEAD_READ)


async def ranged_sniff(data: bytes) -> tuple[SniffResult, int]:
    """sniff_object over ranged reads of data, as the api reads a stored object; and how many reads it took."""
    reads = 0

    async def read(offset: int, length: int) -> bytes:
        nonlocal reads
        reads += 1
        return data[offset : offset + length]

    return await sniff_object(read, size=len(data)), reads


# ---------------------------------------------------------------------------------------------------------------------
# every accepted container: recognised from its first bytes, and its height read by the probe


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
async def test_each_container_is_recognised_and_probed(sample: Sample, media: Path) -> None:
    path = make(sample, media / sample.name)
    assert head_of(path) == SniffResult(sample.container, 0, None)
    info = await probe(str(path))
    assert info is not None
    assert (info.display_width, info.display_height, info.codec) == (sample.width, sample.height, sample.codec)
    assert info.duration is not None and 0.9 <= info.duration <= 1.2
    # forcing the sniffed container's demuxer reads the same
    assert await probe(str(path), container=sample.container) == info


async def test_a_rotated_video_reports_its_displayed_height(media: Path, mp4: Path) -> None:
    rotated = media / "rotated.mp4"
    try:
        ffmpeg("-display_rotation", "90", "-i", str(mp4), "-c", "copy", str(rotated))
    except subprocess.CalledProcessError:  # ffmpeg before 6.1 has no -display_rotation
        ffmpeg("-i", str(mp4), "-c", "copy", "-metadata:s:v", "rotate=90", str(rotated))
    info = await probe(str(rotated))
    assert info is not None
    assert (info.coded_width, info.coded_height) == (1280, 720)
    assert (info.display_width, info.display_height) == (720, 1280)
    assert info.rotation in (90, 270)


@pytest.mark.parametrize("layout", ["mdat-first", "moov-first"])
async def test_a_quicktime_movie_without_ftyp_is_mp4(layout: str, media: Path, mp4: Path) -> None:
    """Old QuickTime files begin straight with their atoms; made here by renaming ftyp to free (offsets unchanged)."""
    path = media / f"bare-{layout}.mov"
    ffmpeg("-i", str(mp4), "-c", "copy", *(["-movflags", "+faststart"] if layout == "moov-first" else []), str(path))
    data = bytearray(read_file(path))
    assert data[4:8] == b"ftyp"
    data[4:8] = b"free"
    path.write_bytes(data)
    assert head_of(path) == SniffResult(Container.MP4, 0, None)
    info = await probe(str(path), container=Container.MP4)
    assert info is not None and info.display_height == 720


# ---------------------------------------------------------------------------------------------------------------------
# ID3v2 tags before the content


async def test_an_mp4_behind_two_id3_tags_is_mp4_and_probed_through_subfile(id3_mp4: tuple[Path, int]) -> None:
    path, tags = id3_mp4
    assert tags == 2 * ID3_HEADER_SIZE + 1333 + ID3_FOOTER_SIZE
    result = head_of(path)
    assert result == SniffResult(Container.MP4, tags, None)
    # ffmpeg itself cannot open it ("moov atom not found"): the skip is what makes it readable
    assert await probe(str(path)) is None
    info = await probe(str(path), skip=result.id3_bytes_skipped, container=result.container)
    assert info is not None and info.display_height == 720


def test_the_subfile_input_decodes_every_frame(id3_mp4: tuple[Path, int]) -> None:
    """What the encoder must do with an accepted file that has ID3 tags: every frame decodes, no error."""
    path, tags = id3_mp4
    run = subprocess.run(
        [FFMPEG, "-hide_banner", "-nostdin", "-v", "error", "-protocol_whitelist", "subfile,file",
         "-i", ffmpeg_input(str(path), skip=tags), "-map", "0:v", "-f", "null", "-"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0 and run.stderr == ""


@pytest.fixture(scope="module")
def long_id3_mp4(media: Path, mp4: Path) -> tuple[Path, int]:
    """The MP4 behind three ID3v2 tags, the first two each longer than a first read; and the tags' length."""
    tags = id3_tag(HEAD_READ * 2) + id3_tag(HEAD_READ + 10, footer=True) + id3_tag(5)
    path = media / "long-id3.mp4"
    path.write_bytes(tags + mp4.read_bytes())
    return path, len(tags)


async def test_id3_tags_longer_than_the_first_read_take_ranged_reads(long_id3_mp4: tuple[Path, int]) -> None:
    path, tags = long_id3_mp4
    assert head_of(path) == SniffResult(None, HEAD_READ * 2 + ID3_HEADER_SIZE, HEAD_READ * 2 + ID3_HEADER_SIZE)
    result, reads = await ranged_sniff(read_file(path))
    assert result == SniffResult(Container.MP4, tags, None)
    assert reads == 3
    info = await probe(str(path), skip=result.id3_bytes_skipped, container=result.container)
    assert info is not None and info.display_height == 720


# ---------------------------------------------------------------------------------------------------------------------
# what is refused


@pytest.fixture(scope="module")
def refused(media: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    if "libmp3lame" in ENCODERS:
        mp3 = media / "sine.mp3"
        ffmpeg("-f", "lavfi", "-i", LAVFI_AUDIO, "-c:a", "libmp3lame", "-id3v2_version", "0", str(mp3))
        files["mp3"] = mp3
        tagged = media / "tagged.mp3"
        tagged.write_bytes(id3_tag(2000) + mp3.read_bytes())
        files["mp3 with id3"] = tagged
        ffmpeg_tagged = media / "ffmpeg-tagged.mp3"  # ffmpeg writes its own ID3v2.4 tag
        ffmpeg("-f", "lavfi", "-i", LAVFI_AUDIO, "-c:a", "libmp3lame", "-metadata", "title=x", str(ffmpeg_tagged))
        files["mp3 tagged by ffmpeg"] = ffmpeg_tagged
    wav = media / "sine.wav"
    ffmpeg("-f", "lavfi", "-i", LAVFI_AUDIO, "-c:a", "pcm_s16le", str(wav))
    files["wav"] = wav
    text = media / "notes.txt"
    text.write_text("I'm free to upload what I like.\n" * 500)
    files["text"] = text
    noise = media / "random.bin"
    noise.write_bytes(random.Random(7).randbytes(200_000))
    files["random"] = noise
    empty = media / "empty"
    empty.write_bytes(b"")
    files["empty"] = empty
    png = media / "frame.png"
    ffmpeg("-f", "lavfi", "-i", LAVFI_VIDEO.format(size="320x240"), "-frames:v", "1", str(png))
    files["png"] = png
    return files


@pytest.mark.parametrize(
    "name", ["mp3", "mp3 with id3", "mp3 tagged by ffmpeg", "wav", "text", "random", "empty", "png"]
)
async def test_what_is_not_an_accepted_video_is_refused(name: str, refused: dict[str, Path]) -> None:
    if name not in refused:
        pytest.skip("this ffmpeg has no libmp3lame")
    path = refused[name]
    result = head_of(path)
    assert result.container is None and result.decided
    assert (await ranged_sniff(read_file(path)))[0] == result
    if name == "mp3 with id3":
        assert result.id3_bytes_skipped == ID3_HEADER_SIZE + 2000


async def test_the_probe_finds_no_video_in_audio_text_or_nothing(refused: dict[str, Path], media: Path) -> None:
    # ffmpeg left to itself calls the text file an "ansi" video of 640x400: the format whitelist is what refuses it
    for name in ("mp3", "mp3 tagged by ffmpeg", "wav", "text", "random", "empty", "png"):
        if name in refused:
            assert await probe(str(refused[name])) is None, name
    assert await probe(str(media / "does-not-exist.mp4")) is None


# ---------------------------------------------------------------------------------------------------------------------
# over HTTP, as from a presigned URL: ranged reads, a small part of the file, and a timeout that kills ffmpeg


class RangeServer:
    """Serves a directory over HTTP/1.1 with Range support, counting the bytes it manages to send."""

    def __init__(self, root: Path) -> None:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                # a small send buffer, so that what ffmpeg does not read is not counted as sent
                self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
                super().setup()

            def do_GET(self) -> None:
                path = root / self.path.split("?", 1)[0].lstrip("/")
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if m:
                    start = int(m[1])
                    end = min(int(m[2]) if m[2] else len(data) - 1, len(data) - 1)
                    body = data[start : end + 1]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                else:
                    body = data
                    self.send_response(200)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for i in range(0, len(body), 16 * 1024):
                        self.wfile.write(body[i : i + 16 * 1024])
                        with server.lock:
                            server.sent += min(16 * 1024, len(body) - i)
                except OSError:
                    pass  # ffmpeg closed the connection: it had read what it wanted

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.lock = threading.Lock()
        self.sent = 0
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RangeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def served(media: Path) -> Iterator[RangeServer]:
    with RangeServer(media) as server:
        yield server


@pytest.fixture(scope="module")
def big_mp4(media: Path) -> Path:
    """About 13 MB of 720p video with its moov at the end, as most phones and ffmpeg write it."""
    path = media / "big.mp4"
    ffmpeg("-f", "lavfi", "-i", "testsrc2=size=1280x720:rate=25:duration=10", "-f", "lavfi", "-i", "sine=duration=10",
           "-c:v", "libx264", "-preset", "ultrafast", "-qp", "10", "-c:a", "aac", str(path))  # fmt: skip
    return path


@pytest.mark.parametrize("fmt", ["mp4", "mkv", "ts"])
async def test_probing_a_url_reads_a_small_part_of_the_file(
    fmt: str, big_mp4: Path, media: Path, served: RangeServer
) -> None:
    path = big_mp4 if fmt == "mp4" else media / f"big.{fmt}"
    if not path.exists():
        ffmpeg("-i", str(big_mp4), "-c", "copy", str(path))
    before = served.sent
    info = await probe(f"{served.url}/{path.name}?X-Amz-Signature=abc&X-Amz-Expires=300")
    assert info is not None and (info.display_width, info.display_height) == (1280, 720)
    with served.lock:
        sent = served.sent - before
    # what the server wrote includes what sat in loopback socket buffers when ffmpeg closed (timing-dependent, a few
    # MB at most): well under half of the file means the probe did not fetch it
    assert sent < path.stat().st_size / 2, f"{sent} of {path.stat().st_size} bytes sent"


async def test_probing_a_url_behind_id3_tags(id3_mp4: tuple[Path, int], served: RangeServer) -> None:
    path, tags = id3_mp4
    info = await probe(f"{served.url}/{path.name}", skip=tags, container=Container.MP4)
    assert info is not None and info.display_height == 720
    assert await probe(f"{served.url}/missing.mp4") is None


async def test_a_source_that_never_answers_is_given_up_and_ffmpeg_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    connections: list[asyncio.StreamReader] = []
    closed = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(reader)
        while await reader.read(4096):  # read the request, answer nothing, until ffmpeg goes away
            pass
        closed.set()
        writer.close()

    started: list[asyncio.subprocess.Process] = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await real_exec(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording_exec)
    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        t0 = time.monotonic()
        assert await probe(f"http://127.0.0.1:{port}/slow.mp4", timeout=1.0) is None
        assert time.monotonic() - t0 < 5
        assert connections, "ffmpeg never connected"
        assert len(started) == 1 and started[0].returncode is not None  # killed and reaped
        async with asyncio.timeout(5):
            await closed.wait()  # its connection went with it
    finally:
        server.close()
        await server.wait_closed()


async def test_a_cancelled_probe_kills_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[asyncio.subprocess.Process] = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await real_exec(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording_exec)

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(4096):
            pass
        writer.close()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        task = asyncio.create_task(probe(f"http://127.0.0.1:{port}/slow.mp4", timeout=30))
        async with asyncio.timeout(10):
            while not started:
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert started[0].returncode is not None
    finally:
        server.close()
        await server.wait_closed()


async def test_a_missing_ffmpeg_is_no_answer(monkeypatch: pytest.MonkeyPatch, mp4: Path) -> None:
    monkeypatch.setattr(probe_module, "ffmpeg_exe", lambda: "/nonexistent/ffmpeg")
    assert await probe(str(mp4)) is None
