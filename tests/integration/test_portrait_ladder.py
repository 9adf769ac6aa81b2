"""Portrait sources through encode and a media worker as processes (the session's real NATS, PostgreSQL and S3, real
ffmpeg): a rendition's "p" is its shorter side, so a phone's video is served at its own size.

Uploads are announced as the api announces them: with the size the api measured (width and height as shown), and
without, so that encode probes each source (the ladder by its shorter side as shown); each rendition stored is then
read back and measured with the project's probe.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from shared.media.probe import probe
from shared.settings import CommonSettings
from tests.integration.test_encode_helpers import (
    FFMPEG,
    Events,
    Procs,
    fast_farm,
    get_object,
    publish_upload,
    put_object,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


def make_clip(path: Path, width: int, height: int, *, rotation: int = 0) -> Path:
    """testsrc and a sine tone, 2 s, as H.264/AAC MP4 of width x height coded; `rotation`: with a display matrix that
    turns it (a phone's 1280x720 recorded upright shows 720x1280)."""
    coded = path.with_suffix(".coded.mp4") if rotation else path
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                    "-f", "lavfi", "-i", f"testsrc=size={width}x{height}:rate=10:duration=2",
                    "-f", "lavfi", "-i", "sine=duration=2",
                    "-c:v", "libx264", "-preset", "ultrafast", "-g", "10", "-c:a", "aac", "-shortest", str(coded)],
                   check=True, timeout=120)  # fmt: skip
    if rotation:
        subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                        "-display_rotation", str(rotation), "-i", str(coded), "-c", "copy", str(path)],
                       check=True, timeout=60)  # fmt: skip
    return path


# (coded width, coded height, rotation) -> {output: (width, height) as shown}
PORTRAIT = {
    (360, 640, 0): {360: (360, 640)},  # one output at its own size, not 202x360
    (720, 1280, 0): {360: (360, 640), 720: (720, 1280)},  # not 202x360, 406x720 and 608x1080
    (1280, 720, 90): {360: (360, 640), 720: (720, 1280)},  # a phone's: coded landscape, shown portrait
}


async def test_portrait_sources_are_encoded_with_their_shorter_side_as_the_rung_at_their_own_size(
    farm: Procs, events: Events, nc: NATS, prepared: CommonSettings, tmp_path: Path
) -> None:
    farm.start("encode", "media-1", **fast_farm(media_slots=3))
    videos: dict[str, tuple[int, int, int]] = {}
    for (width, height, rotation) in PORTRAIT:
        clip = make_clip(tmp_path / f"{width}x{height}r{rotation}.mp4", width, height, rotation=rotation)
        shown = (height, width) if rotation % 180 else (width, height)
        for announced in (None, shown):  # encode probes; the api's measure (source_width and source_height)
            video_id = str(uuid.uuid4())
            key = f"sources/portrait-test/{video_id}"
            size = await put_object(prepared, key, clip)
            await publish_upload(nc, video_id=video_id, object_key=key, size=size,
                                 source_width=announced[0] if announced else None,
                                 source_height=announced[1] if announced else None)
            videos[video_id] = (width, height, rotation)

    def ready(video_id: str) -> bool:
        return any(e.data.get("outputs_remaining") == 0 for e in events.of(video_id, "encode.completed"))

    await wait_for(lambda: all(ready(v) for v in videos), 120, "every portrait video to be ready")
    for video_id, source in videos.items():
        completed = {e.data["output"]: e.data for e in events.of(video_id, "encode.completed")}
        assert sorted(completed) == sorted(PORTRAIT[source]), (source, sorted(completed))
        for output, (width, height) in PORTRAIT[source].items():
            local = await get_object(prepared, completed[output]["object_key"], tmp_path / f"{video_id}-{output}.mp4")
            info = await probe(str(local))
            assert info is not None and (info.display_width, info.display_height) == (width, height), (source, info)
            hls = completed[output]["hls"]  # what the master playlist's RESOLUTION says of it
            assert hls is not None and (hls["width"], hls["height"]) == (width, height), (source, output, hls)
