"""Upload a 720p source through the HTTP API, and get back 360p and 720p renditions (auth, api, encode, media).

Real servers, real processes, real ffmpeg; the source is made at test time.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from shared.bus import connect
from shared.settings import CommonSettings
from tests.integration.apihelpers import TRUSTED, Client, create, upload
from tests.integration.authhelpers import TEST_SECRETS, fresh_address, new_app
from tests.integration.test_encode_helpers import (
    Procs,
    clean_encode_state,
    decode,
    fast_farm,
    make_source,
    prepare_encode_consumers,
    processes,
    stream_info,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def stack_procs(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    env = {**stack_env, **{f"WEIR_{k.upper()}": v for k, v in TEST_SECRETS.items()}, "WEIR_TRUSTED_PROXIES": TRUSTED}
    with processes(env, tmp_path_factory.mktemp("e2e-logs")) as procs:
        yield procs


@pytest.fixture(scope="module")
async def client(stack_procs: Procs, prepared: CommonSettings) -> AsyncIterator[Client]:
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    # two developer slots besides the kept one; sources read at real time, so "processing" can be seen
    [_, api, _, _] = stack_procs.start("auth", "api", "encode", "media-1",
                                       **fast_farm(media_slots=3, media_read_rate=1))
    nc = await connect(prepared, name="test")
    demo = await new_app(nc)
    await nc.close()
    c = Client(SimpleNamespace(api_url=api.url), demo.app.secret_key, fresh_address())  # type: ignore[arg-type]
    yield c
    await c.http.aclose()
    await clean_encode_state(prepared)


async def video(client: Client, video_id: str) -> dict[str, Any]:
    r = await client.call("GET", f"/v1/videos/{video_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_an_uploaded_720p_video_gets_360p_and_720p_renditions_and_is_ready(
    client: Client, stack_procs: Procs, tmp_path: Path
) -> None:
    source = make_source(tmp_path / "clip.mp4", height=720, seconds=2, fps=10)
    created = await create(client)
    done = await upload(client, created["id"], source.read_bytes())
    assert done.status_code == 200 and done.json()["status"] == "uploaded"

    async def encoding() -> dict[str, Any] | None:
        v = await video(client, created["id"])
        p = v["processing"]
        # deadline_at comes only from encode's own answer (the api's projection of events has none)
        if v["status"] == "processing" and p and p["deadline_at"] and any(o["state"] == "encoding"
                                                                          for o in p["outputs"]):
            return v
        return None

    shown = await wait_for(encoding, 20, "the video to show encoding outputs")
    assert {o["height"] for o in shown["processing"]["outputs"]} == {360, 720}
    assert all(o["worker"] == "media-1" for o in shown["processing"]["outputs"] if o["state"] == "encoding")

    async def is_ready() -> dict[str, Any] | None:
        v = await video(client, created["id"])
        return v if v["status"] == "ready" else None

    ready = await wait_for(is_ready, 40, "the video to be ready")
    assert [r["height"] for r in ready["renditions"]] == [360, 720] and ready["failure"] is None
    async with httpx.AsyncClient(timeout=30) as http:
        for rendition, size in zip(ready["renditions"], ("640x360", "1280x720"), strict=True):
            got = await http.get(rendition["url"])  # a presigned GET URL
            assert got.status_code == 200 and len(got.content) == rendition["size"]
            path = tmp_path / f"{rendition['height']}.mp4"
            path.write_bytes(got.content)
            assert decode(path) == (0, ""), "ffmpeg decodes every frame"
            info = stream_info(path)
            assert "Video: h264" in info and "Audio: aac" in info and size in info


async def test_without_encode_the_api_shows_its_projection(
    client: Client, stack_procs: Procs, tmp_path: Path
) -> None:
    encode = next(p for p in stack_procs.procs if p.name == "encode")
    encode.kill9()
    created = await create(client, name=f"while encode is down {uuid.uuid4()}")
    source = make_source(tmp_path / "small.mp4", height=240, seconds=1)
    assert (await upload(client, created["id"], source.read_bytes())).status_code == 200
    shown = await video(client, created["id"])  # no answer from encode: the api's own view, at once
    assert shown["status"] == "uploaded" and shown["processing"] is None
    stack_procs.start("encode", **fast_farm())  # back: the upload waited on the stream

    async def is_ready() -> dict[str, Any] | None:
        v = await video(client, created["id"])
        return v if v["status"] == "ready" else None

    ready = await wait_for(is_ready, 30, "the video to be ready")
    assert [r["height"] for r in ready["renditions"]] == [240]
