"""Playback over real HTTP (SPEC 14): auth and two api instances as processes, the session's PostgreSQL, S3 and NATS.

A ready video with HLS files is made without the farm: a short real CMAF ladder is made here with ffmpeg, put in
storage under the video's prefix, and announced by encode.completed v4 events (with `hls` and `artwork`) published
on the real stream, which the api's projection reads as it reads encode's.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit, urlunsplit

import httpx
import imageio_ffmpeg
import jwt
import m3u8
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from services.api.settings import ApiSettings
from shared.authcheck import AppCreated
from shared.authclient import create_account_with_app
from shared.bus import HDR_MSG_ID, connect
from shared.events import EncodeCompleted, EncodeStarted, Envelope, new_event
from shared.media.hls import measure_rendition
from shared.media.playback import Artwork, HlsRendition, artwork_prefix, hls_prefix
from shared.outbox import bus_subject
from shared.settings import CommonSettings
from shared.storage import s3_client
from tests.integration.apihelpers import UNLIMITED, Client, Services, run_services
from tests.integration.authhelpers import fresh_address
from tests.stored import object_exists
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

HEIGHTS = (90, 180)  # two small renditions: a ladder to choose from, cheap to make
SECONDS = 3
SEGMENT_SECONDS = 1
DEFAULTS = ApiSettings()
REVOKED_WITHIN_S = 1.0  # SPEC 14: a revoked signing key stops playback within 1 s on every api instance
PLAYER_ADDRESS = fresh_address()  # every player request of this module comes from here


@dataclass(frozen=True)
class Ladder:
    """Files made once for the module: per height an HLS directory and an MP4; a poster, sprite and storyboard."""

    root: Path

    def hls_dir(self, height: int) -> Path:
        return self.root / f"{height}p"

    def mp4(self, height: int) -> Path:
        return self.root / f"{height}p.mp4"


def _ffmpeg(*args: str) -> None:
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-y", *args], check=True,
                   timeout=120)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory: pytest.TempPathFactory) -> Ladder:
    root = tmp_path_factory.mktemp("ladder")
    source = ["-f", "lavfi", "-i", f"testsrc2=size=320x180:rate=25:duration={SECONDS}", "-f", "lavfi", "-i",
              f"sine=duration={SECONDS}"]
    for height in HEIGHTS:
        out = root / f"{height}p"
        out.mkdir()
        gop = ["-g", str(25 * SEGMENT_SECONDS), "-keyint_min", str(25 * SEGMENT_SECONDS), "-sc_threshold", "0"]
        video = ["-vf", f"scale=-2:{height}", "-c:v", "libx264", "-preset", "ultrafast", *gop, "-c:a", "aac",
                 "-shortest"]
        _ffmpeg(*source, *video, "-f", "hls", "-hls_time", str(SEGMENT_SECONDS), "-hls_playlist_type", "vod",
                "-hls_segment_type", "fmp4", "-hls_fmp4_init_filename", "init.mp4",
                "-hls_segment_filename", str(out / "seg-%05d.m4s"), str(out / "index.m3u8"))
        _ffmpeg(*source, *video, "-movflags", "+faststart", str(root / f"{height}p.mp4"))
    _ffmpeg(*source[:4], "-ss", "1", "-frames:v", "1", str(root / "poster.jpg"))
    _ffmpeg(*source[:4], "-vf", "fps=1,scale=80:45,tile=3x1", "-frames:v", "1", str(root / "sprite.jpg"))
    cues = [f"00:00:0{i}.000 --> 00:00:0{i + 1}.000\nsprite.jpg#xywh={80 * i},0,80,45\n" for i in range(SECONDS)]
    (root / "storyboard.vtt").write_text("WEBVTT\n\n" + "\n".join(cues))
    return Ladder(root)


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), **UNLIMITED) as s:
        yield s


@pytest.fixture(scope="module")
def other_api(services: Services, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Services]:
    """A second api instance beside the first (the same auth, database and bus)."""
    with run_services(stack_env, tmp_path_factory.mktemp("logs2"), names=("api",), **UNLIMITED) as s:
        yield s


@pytest.fixture(scope="module")
async def app(services: Services, prepared: CommonSettings) -> AppCreated:
    nc = await connect(prepared, name="test")
    try:
        _, created = await create_account_with_app(nc, "playback")
    finally:
        await nc.close()
    return created


@pytest.fixture
async def client(services: Services, app: AppCreated) -> AsyncIterator[Client]:
    c = Client(services, app.secret_key, PLAYER_ADDRESS)
    yield c
    await c.http.aclose()


@pytest.fixture
async def player() -> AsyncIterator[httpx.AsyncClient]:
    """A browser's player: no credential, the module's viewer address."""
    async with httpx.AsyncClient(timeout=30, headers={"X-Forwarded-For": PLAYER_ADDRESS}) as http:
        yield http


def measured(ladder: Ladder, height: int, playlist_key: str) -> HlsRendition:
    """What the farm would say of the ladder's rendition: measured from its files as the media worker measures them
    (shared/media/hls.py), so the master playlist served here carries the streams' own CODECS and bit rates."""
    directory = ladder.hls_dir(height)
    files = sorted(directory.iterdir())
    first = next(f for f in files if f.suffix == ".m4s")
    return measure_rendition(playlist_key=playlist_key, playlist=(directory / "index.m3u8").read_text(),
                             sizes={f.name: f.stat().st_size for f in files},
                             init=(directory / "init.mp4").read_bytes(), first_segment=first.read_bytes())


async def new_video(client: Client, policy: str = "public") -> dict[str, Any]:
    r = await client.call("POST", "/v1/videos", params={"playback_policy": policy}, json={"name": "clip"})
    assert r.status_code == 201, r.text
    video = r.json()
    assert video["playback"] == {"policy": policy, "hls": None, "thumbnail": None, "storyboard": None, "embed": None,
                                 "mp4": None}
    return dict(video)


async def complete(prepared: CommonSettings, ladder: Ladder, vid: str, heights: tuple[int, ...], *,
                   last_first: bool = False) -> None:
    """Outputs of the video completed as encode would: their files in storage, then encode.completed v4 for each
    (the lowest of HEIGHTS with the artwork), counting down the outputs left of HEIGHTS. `last_first`: the events
    published in the reverse order, as two api instances or a late replay may apply them."""
    events: list[Envelope] = []
    if HEIGHTS[0] in heights:  # encode dispatches the whole ladder at once
        events += [new_event(EncodeStarted(video_id=vid, output=h, worker="test"), source="encode", subject=vid)
                   for h in HEIGHTS]
    async with s3_client(prepared) as s3:
        async def put(key: str, path: Path) -> None:
            await s3.put_object(Bucket=prepared.s3_bucket, Key=key, Body=path.read_bytes())

        art_prefix = artwork_prefix(vid, 1)
        artwork = Artwork(poster_key=art_prefix + "poster.jpg", poster_time=1.0, poster_width=320, poster_height=180,
                          sprite_key=art_prefix + "sprite.jpg", storyboard_key=art_prefix + "storyboard.vtt",
                          tile_width=80, tile_height=45, tiles=SECONDS, interval=1.0, duration=float(SECONDS))
        for height in heights:
            first = height == HEIGHTS[0]
            if first:
                for name in ("poster.jpg", "sprite.jpg", "storyboard.vtt"):
                    await put(art_prefix + name, ladder.root / name)
            prefix = hls_prefix(vid, height, 1)
            for path in sorted(ladder.hls_dir(height).iterdir()):
                await put(prefix + path.name, path)
            mp4_key = f"renditions/{vid}/{height}p-1.mp4"
            await put(mp4_key, ladder.mp4(height))
            events.append(new_event(EncodeCompleted(
                video_id=vid, output=height, worker="test", object_key=mp4_key, size=ladder.mp4(height).stat().st_size,
                outputs_remaining=len(HEIGHTS) - HEIGHTS.index(height) - 1,
                hls=measured(ladder, height, prefix + "index.m3u8"), artwork=artwork if first else None),
                source="encode", subject=vid))
    nc = await connect(prepared, name="test")
    try:
        js = nc.jetstream()
        for event in reversed(events) if last_first else events:
            await js.publish(bus_subject(event) or event.type, event.to_bytes(), headers={HDR_MSG_ID: event.id})
    finally:
        await nc.close()


async def shown_when(client: Client, vid: str, status: str, what: str, heights: tuple[int, ...] = HEIGHTS
                     ) -> dict[str, Any]:
    """The video once shown with `status` and the renditions of `heights` (and the artwork, which the lowest
    carries). With two api instances sharing the status durable, events of one video may be applied in either order:
    the projection ends the same, but `ready` may come a moment before an earlier output's rendition."""
    async def shown() -> dict[str, Any] | None:
        got = (await client.call("GET", f"/v1/videos/{vid}")).json()
        caught_up = ({r["height"] for r in got["renditions"]} == set(heights)
                     and (HEIGHTS[0] not in heights or got["playback"]["storyboard"] is not None))
        return got if got["status"] == status and got["playback"]["hls"] and caught_up else None

    return await wait_for(shown, 30, what)


async def ready_video(client: Client, prepared: CommonSettings, ladder: Ladder, policy: str = "public"
                      ) -> dict[str, Any]:
    """A video made ready as encode would make it, every output of HEIGHTS completed."""
    video = await new_video(client, policy)
    await complete(prepared, ladder, video["id"], HEIGHTS)
    return await shown_when(client, video["id"], "ready", "the video ready with HLS")


async def new_key(client: Client) -> tuple[str, Any]:
    """A playback key the api makes: its id and private key (shown once)."""
    r = await client.call("POST", "/v1/playback-keys", json={})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["algorithm"] == "ES256" and body["private_key"].startswith("-----BEGIN PRIVATE KEY-----")
    return body["id"], serialization.load_pem_private_key(body["private_key"].encode(), None)


def token_for(kid: str, private: Any, video_id: str, *, ttl: int = 600, alg: str = "ES256", **claims: Any) -> str:
    return jwt.encode({"sub": video_id, "exp": int(time.time()) + ttl, "aud": "playback", **claims}, private,
                      algorithm=alg, headers={"kid": kid})


def with_token(url: str, token: str) -> str:
    return f"{url}?{urlencode({'token': token})}"


async def play(http: httpx.AsyncClient, master_url: str, heights: tuple[int, ...] = HEIGHTS) -> dict[str, bytes]:
    """What a player does: the master (listing `heights`), each media playlist, each init and segment through the
    api's redirect to storage. Returns the bytes fetched by file name per rendition (`<height>/<name>`)."""
    r = await http.get(master_url)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/vnd.apple.mpegurl")
    assert r.headers["access-control-allow-origin"] == "*"
    master = m3u8.loads(r.text, uri=master_url)
    assert master.is_variant and [p.stream_info.resolution[1] for p in master.playlists] == list(heights)
    bandwidths = [p.stream_info.bandwidth for p in master.playlists]
    assert bandwidths == sorted(bandwidths)
    got: dict[str, bytes] = {}
    for variant in master.playlists:
        media_url = urljoin(master_url, variant.uri)
        r = await http.get(media_url)
        assert r.status_code == 200, r.text
        media = m3u8.loads(r.text, uri=media_url)
        assert media.is_endlist and len(media.segments) == SECONDS // SEGMENT_SECONDS
        height = urlsplit(media_url).path.split("/")[-2]
        uris = [media.segment_map[0].uri] + [s.uri for s in media.segments]
        for uri in uris:
            file_url = urljoin(media_url, uri)
            redirect = await http.get(file_url)
            assert redirect.status_code == 302, redirect.text
            stored = await http.get(redirect.headers["location"])
            assert stored.status_code == 200
            got[f"{height}/{urlsplit(file_url).path.rsplit('/', 1)[1]}"] = stored.content
    return got


def tampered(url: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query["sig"] = ("A" if query["sig"][0] != "A" else "B") + query["sig"][1:]
    return urlunsplit(parts._replace(query=urlencode(query)))


async def first_segment_url(http: httpx.AsyncClient, master_url: str) -> str:
    master = m3u8.loads((await http.get(master_url)).text, uri=master_url)
    media_url = urljoin(master_url, master.playlists[0].uri)
    media = m3u8.loads((await http.get(media_url)).text, uri=media_url)
    return urljoin(media_url, media.segments[0].uri)


def problem_code(r: httpx.Response) -> str:
    assert r.headers["content-type"].startswith("application/problem+json"), r.text
    return str(r.json()["code"])


# ----------------------------------------------------------------------------------------------- tests


async def test_a_public_video_plays_its_ladder_from_storage(client: Client, player: httpx.AsyncClient,
                                                            prepared: CommonSettings, ladder: Ladder) -> None:
    video = await ready_video(client, prepared, ladder)
    base = str(client.http.base_url).rstrip("/")
    assert video["playback"] == {"policy": "public", "hls": f"{base}/v1/playback/{video['id']}/master.m3u8",
                                 "thumbnail": f"{base}/v1/videos/{video['id']}/thumbnail.jpg",
                                 "storyboard": f"{base}/v1/videos/{video['id']}/storyboard.vtt",
                                 "embed": f"{base}/embed/{video['id']}",
                                 "mp4": f"{base}/v1/playback/{video['id']}/highest.mp4"}
    page = (await client.call("POST", f"/v1/videos/{video['id']}/upload-token")).json()["upload_token"]
    shown = (await client.call("GET", f"/sdk/v1/videos/{video['id']}", page)).json()
    assert len(shown["renditions"]) == len(HEIGHTS), shown  # a public video's MP4s: a page may play them
    got = await play(player, video["playback"]["hls"])
    for height in HEIGHTS:  # every file came back as stored, byte for byte
        for path in ladder.hls_dir(height).iterdir():
            if path.suffix != ".m3u8":
                assert got[f"{height}/{path.name}"] == path.read_bytes(), path
    r = await player.get(video["playback"]["hls"])
    assert r.headers["cache-control"] == f"public, max-age={DEFAULTS.playback_public_max_age_seconds}"
    # players' routes are limited by the client address like any request without a credential (SPEC 3)
    assert r.headers["ratelimit-policy"].startswith(f'"address";q={UNLIMITED["limit_address_per_minute"]};')
    segment = await first_segment_url(player, video["playback"]["hls"])
    refused = await player.get(tampered(segment))
    assert refused.status_code == 403 and problem_code(refused) == "playback_url_invalid"
    unsigned = await player.get(segment.split("?")[0])
    assert unsigned.status_code == 403 and problem_code(unsigned) == "playback_url_invalid"

    # made signed by PATCH: its public file URLs stop at once, and the master asks for a token
    r = await client.call("PATCH", f"/v1/videos/{video['id']}", json={"playback_policy": "signed"})
    assert r.status_code == 200 and r.json()["playback"]["policy"] == "signed", r.text
    assert (await player.get(segment)).status_code == 403
    r = await player.get(video["playback"]["hls"])
    assert r.status_code == 401 and problem_code(r) == "playback_token_required"
    for bad in ({"playback_policy": "secret"}, {}, {"playback_policy": None}):
        r = await client.call("PATCH", f"/v1/videos/{video['id']}", json=bad)
        assert r.status_code == 400 and problem_code(r) == "validation_error", (bad, r.text)


async def test_the_embed_page_refuses_a_start_or_captions_it_could_not_use(client: Client,
                                                                            player: httpx.AsyncClient) -> None:
    """A page in an iframe that silently ignored `start=abc` would leave its developer guessing: 400, naming it."""
    embed = f"{str(client.http.base_url).rstrip('/')}/embed/{uuid.uuid4()}"
    for query in ("start=-1", "start=abc", "start=nan", "start=inf", "captions=english%20please", "captions=e",
                  f"captions={'x' * 41}"):
        r = await player.get(f"{embed}?{query}")
        assert r.status_code == 400 and problem_code(r) == "validation_error", (query, r.text)
        named = [r.json()["detail"], *(e["loc"][-1] for e in r.json().get("errors", []))]
        assert any(query.split("=")[0] in n for n in named), (query, r.text)
    for query in ("", "start=0", "start=12.5&captions=pt-BR", "captions=es-419&muted=1&autoplay=1"):
        r = await player.get(f"{embed}?{query}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (query, r.text)


async def test_a_processing_video_plays_each_rendition_as_it_is_added(client: Client, player: httpx.AsyncClient,
                                                                      prepared: CommonSettings, ladder: Ladder) -> None:
    """SPEC 14's master playlist updated as a rendition is added: the lowest plays while the rest encode, and the master
    (never cached meanwhile) lists each one from its encode.completed, with the streams' own CODECS and sizes."""
    video = await new_video(client)
    vid = video["id"]
    await complete(prepared, ladder, vid, HEIGHTS[:1])
    shown = await shown_when(client, vid, "processing", "the video processing with its first rendition playable",
                             HEIGHTS[:1])
    r = await player.get(shown["playback"]["hls"])
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache", (r.status_code, r.headers)
    got = await play(player, shown["playback"]["hls"], HEIGHTS[:1])
    assert {name.split("/")[0] for name in got} == {str(HEIGHTS[0])}
    await complete(prepared, ladder, vid, HEIGHTS[1:])
    ready = await shown_when(client, vid, "ready", "the video ready")
    r = await player.get(ready["playback"]["hls"])
    assert r.headers["cache-control"] == f"public, max-age={DEFAULTS.playback_public_max_age_seconds}"
    master = m3u8.loads(r.text)
    for height, variant in zip(HEIGHTS, master.playlists, strict=True):  # by bandwidth: the lowest first
        want = measured(ladder, height, "k")
        assert (variant.stream_info.codecs, variant.stream_info.bandwidth, variant.stream_info.resolution) == (
            want.codecs, want.bandwidth, (want.width, want.height))
    await play(player, ready["playback"]["hls"])


async def test_a_videos_events_applied_last_first_show_what_they_show_in_order(client: Client,
                                                                              prepared: CommonSettings,
                                                                              ladder: Ladder) -> None:
    """Several api instances share the status durable, and a replay comes late: a video whose encode events are
    applied last-first is shown as one whose events came in order (every output done, not back to encoding)."""
    in_order, last_first = (await new_video(client))["id"], (await new_video(client))["id"]
    await complete(prepared, ladder, in_order, HEIGHTS)
    await complete(prepared, ladder, last_first, HEIGHTS, last_first=True)

    async def all_applied(vid: str) -> dict[str, Any] | None:  # the starts come last: each output shows its start
        got = (await client.call("GET", f"/v1/videos/{vid}")).json()
        outputs = (got["processing"] or {}).get("outputs", [])
        return got if len(outputs) == len(HEIGHTS) and all(o.get("started_at") for o in outputs) else None

    want = await wait_for(lambda: all_applied(in_order), 30, "the events applied in order")
    got = await wait_for(lambda: all_applied(last_first), 30, "the events applied last-first")
    assert [(o["height"], o["state"], o["worker"]) for o in got["processing"]["outputs"]] == [
        (o["height"], o["state"], o["worker"]) for o in want["processing"]["outputs"]] == [
        (h, "done", "test") for h in HEIGHTS]
    assert got["status"] == want["status"] == "ready"
    assert [r["height"] for r in got["renditions"]] == [r["height"] for r in want["renditions"]] == list(HEIGHTS)
    assert got["playback"]["storyboard"] is not None


async def test_a_signed_video_plays_only_with_a_good_token(client: Client, player: httpx.AsyncClient,
                                                           prepared: CommonSettings, ladder: Ladder) -> None:
    video = await ready_video(client, prepared, ladder, "signed")
    other = await ready_video(client, prepared, ladder, "signed")
    vid, master_url = video["id"], video["playback"]["hls"]
    kid, private = await new_key(client)

    async def refused(token: str | None, code: str, status: int = 403) -> None:
        r = await player.get(with_token(master_url, token) if token is not None else master_url)
        assert r.status_code == status and problem_code(r) == code, (code, r.text)
        assert r.headers["access-control-allow-origin"] == "*"

    await refused(None, "playback_token_required", 401)
    # a page's credential (an upload token, which goes to browsers) gets no MP4 URL of a signed video: those would
    # play it without a playback token; the app's server (its secret key) still gets them
    assert len((await client.call("GET", f"/v1/videos/{vid}")).json()["renditions"]) == len(HEIGHTS)
    page = (await client.call("POST", f"/v1/videos/{vid}/upload-token")).json()["upload_token"]
    r = await client.call("GET", f"/sdk/v1/videos/{vid}", page)
    assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["renditions"] == [], r.text
    leeway = int(DEFAULTS.playback_token_leeway_seconds)
    await refused(token_for(kid, private, vid, ttl=-(leeway + 5)), "playback_token_expired")
    await refused(token_for(kid, private, other["id"]), "playback_token_invalid")  # another video's
    good = token_for(kid, private, vid)
    await refused(good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB"), "playback_token_invalid")
    await refused(token_for(kid, private, vid, ip=fresh_address()), "playback_token_invalid")  # another viewer
    await refused(token_for(kid, private, vid, aud="elsewhere"), "playback_token_invalid")
    await refused("not-a-jwt", "playback_token_invalid")

    got = await play(player, with_token(master_url, token_for(kid, private, vid, ip=PLAYER_ADDRESS)))
    assert len(got) == len(HEIGHTS) * (1 + SECONDS // SEGMENT_SECONDS)
    r = await player.get(with_token(master_url, good))
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    # the listed URLs are signed for the token's lifetime, and only for their own file
    segment = await first_segment_url(player, with_token(master_url, good))
    assert int(parse_qs(urlsplit(segment).query)["exp"][0]) == jwt.decode(
        good, options={"verify_signature": False})["exp"]
    r = await player.get(tampered(segment))
    assert r.status_code == 403 and problem_code(r) == "playback_url_invalid"
    r = await player.get(segment.replace("seg-00000", "seg-00001"))
    assert r.status_code == 403 and problem_code(r) == "playback_url_invalid"

    # the app's own secret key plays it without a token
    r = await client.call("GET", f"/v1/playback/{vid}/master.m3u8")
    assert r.status_code == 200, r.text

    # a key uploaded by the developer (its public half only)
    mine = ed25519.Ed25519PrivateKey.generate()
    pem = mine.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    r = await client.call("POST", "/v1/playback-keys", json={"public_key": pem})
    assert r.status_code == 201 and r.json()["algorithm"] == "EdDSA" and r.json()["private_key"] is None, r.text
    uploaded = r.json()["id"]
    assert (await player.get(with_token(master_url, token_for(uploaded, mine, vid, alg="EdDSA")))).status_code == 200
    # a token of another app's key is refused
    nc = await connect(prepared, name="test")
    try:
        _, stranger = await create_account_with_app(nc, "stranger")
    finally:
        await nc.close()
    strangers = Client(Services(str(client.http.base_url), {}, [], {}), stranger.secret_key, PLAYER_ADDRESS)
    try:
        skid, sprivate = await new_key(strangers)
    finally:
        await strangers.http.aclose()
    await refused(token_for(skid, sprivate, vid), "playback_token_invalid")


async def test_a_revoked_key_stops_playback_on_every_instance_within_a_second(
    client: Client, player: httpx.AsyncClient, other_api: Services, prepared: CommonSettings, ladder: Ladder
) -> None:
    video = await ready_video(client, prepared, ladder, "signed")
    kid, private = await new_key(client)
    token = token_for(kid, private, video["id"])
    masters = [with_token(video["playback"]["hls"], token),
               with_token(video["playback"]["hls"].replace(str(client.http.base_url).rstrip("/"),
                                                           other_api.api_url), token)]
    segments = [await first_segment_url(player, m) for m in masters]
    for url in [*masters, *segments]:
        assert (await player.get(url)).status_code in (200, 302), url

    r = await client.call("GET", "/v1/playback-keys")
    listed = {k["id"]: k for k in r.json()["keys"]}
    assert set(listed[kid]) == {"id", "algorithm", "fingerprint", "public_key", "created_at", "revoked_at"}
    assert listed[kid]["revoked_at"] is None and listed[kid]["fingerprint"].startswith("SHA256:")

    r = await client.call("DELETE", f"/v1/playback-keys/{kid}")
    assert r.status_code == 204
    revoked_at = time.monotonic()

    async def all_refused() -> bool:
        answers = [await player.get(url) for url in [*masters, *segments]]
        return all(a.status_code == 403 for a in answers)

    await wait_for(all_refused, REVOKED_WITHIN_S, "every instance refusing the revoked key's token and URLs",
                   interval=0.02)
    assert time.monotonic() - revoked_at <= REVOKED_WITHIN_S + 0.5  # the last poll's own requests
    r = await player.get(masters[1])
    assert problem_code(r) == "playback_token_invalid" and "revoked" in r.json()["detail"]
    listed = {k["id"]: k for k in (await client.call("GET", "/v1/playback-keys")).json()["keys"]}
    assert listed[kid]["revoked_at"] is not None
    assert (await client.call("DELETE", f"/v1/playback-keys/{kid}")).status_code == 204  # again: still revoked
    r = await client.call("DELETE", "/v1/playback-keys/00000000-0000-0000-0000-000000000000")
    assert r.status_code == 404 and problem_code(r) == "not_found"


async def test_playback_keys_need_the_secret_key_and_never_keep_a_private_one(client: Client) -> None:
    r = await client.call("POST", "/v1/playback-keys", None, json={})
    assert r.status_code == 401
    _, private_pem = await new_key(client)
    pem = private_pem.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    r = await client.call("POST", "/v1/playback-keys", json={"public_key": pem})
    assert r.status_code == 400 and problem_code(r) == "validation_error"
    r = await client.call("POST", "/v1/playback-keys", json={"public_key": "nonsense"})
    assert r.status_code == 400
    keys = (await client.call("GET", "/v1/playback-keys")).json()["keys"]
    assert keys and all("private_key" not in k for k in keys)


def _thumbs_made(services: Services, family: str = "weir_thumbnails_made_total") -> float:
    metrics = httpx.get(f"{services.urls['api']}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(family))


async def test_thumbnails_are_made_once_and_the_storyboard_points_at_the_signed_sprite(
    client: Client, player: httpx.AsyncClient, services: Services, prepared: CommonSettings, ladder: Ladder
) -> None:
    video = await ready_video(client, prepared, ladder)
    vid, thumb_url = video["id"], video["playback"]["thumbnail"]
    r = await player.get(thumb_url)  # the farm's poster
    assert r.status_code == 302 and r.headers["location"].split("?")[0].endswith("/poster.jpg")
    assert (await player.get(r.headers["location"])).content == (ladder.root / "poster.jpg").read_bytes()

    made = _thumbs_made(services)
    width = 64
    r = await player.get(thumb_url, params={"time": "1.5", "width": str(width)})
    assert r.status_code == 302, r.text
    key = f"renditions/{vid}/thumbs/t{round(1.5 * 1000)}-w{width}.jpg"
    assert await object_exists(prepared, key)
    assert urlsplit(r.headers["location"]).path.endswith(key)
    image = (await player.get(r.headers["location"])).content
    assert image[:2] == b"\xff\xd8"  # a JPEG
    assert _thumbs_made(services) == made + 1
    r = await player.get(thumb_url, params={"time": "1.5", "width": str(width)})
    assert r.status_code == 302 and _thumbs_made(services) == made + 1  # from the cache: no ffmpeg this time
    for params in ({"time": str(SECONDS + 1)}, {"width": "100000"}, {"width": "0"}, {"time": "-1"},
                   {"time": "soon"}):
        r = await player.get(thumb_url, params=params)
        assert r.status_code == 400 and problem_code(r) == "validation_error", (params, r.text)

    r = await player.get(video["playback"]["storyboard"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/vtt")
    cues = [line for line in r.text.splitlines() if "#xywh=" in line]
    assert len(cues) == SECONDS and all(c.startswith(f"{str(client.http.base_url).rstrip('/')}/v1/videos/{vid}/"
                                                     "storyboard.jpg?") for c in cues)
    sprite = await player.get(cues[0].split("#")[0])
    assert sprite.status_code == 302
    assert (await player.get(sprite.headers["location"])).content == (ladder.root / "sprite.jpg").read_bytes()
    assert (await player.get(tampered(cues[0].split("#")[0]))).status_code == 403

    # a signed video's thumbnail and storyboard: a token, or the app's secret key
    signed = await ready_video(client, prepared, ladder, "signed")
    for url in (signed["playback"]["thumbnail"], signed["playback"]["storyboard"]):
        r = await player.get(url)
        assert r.status_code == 401 and problem_code(r) == "playback_token_required"
        path = urlsplit(url).path
        assert (await client.call("GET", path)).status_code in (200, 302)
    kid, private = await new_key(client)
    r = await player.get(with_token(signed["playback"]["storyboard"], token_for(kid, private, signed["id"])))
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    assert r.text.count(f"kid={kid}") == SECONDS


async def test_an_mp4_has_a_stable_url_under_the_videos_rules_and_downloads_with_its_name(
    client: Client, player: httpx.AsyncClient, prepared: CommonSettings, ladder: Ladder
) -> None:
    """`/v1/playback/{id}/<highest|lowest|<p>p>.mp4`: a redirect to the stored MP4 as long as the grant lasts (a
    `<video>` reads its ranges from the storage URL for the whole viewing); `download=1` names the file."""
    video = await ready_video(client, prepared, ladder)
    vid, base = video["id"], str(client.http.base_url).rstrip("/")
    assert video["playback"]["mp4"] == f"{base}/v1/playback/{vid}/highest.mp4"
    for name, height in (("highest", max(HEIGHTS)), ("lowest", min(HEIGHTS)), (f"{HEIGHTS[0]}p", HEIGHTS[0])):
        r = await player.get(f"{base}/v1/playback/{vid}/{name}.mp4")
        assert r.status_code == 302 and r.headers["cache-control"] == "no-store", r.text
        location = r.headers["location"]
        expires = int(parse_qs(urlsplit(location).query)["X-Amz-Expires"][0])
        assert expires > DEFAULTS.playback_storage_url_ttl_seconds  # the grant's lifetime, not a redirect's minute
        assert expires <= DEFAULTS.playback_public_url_ttl_seconds
        stored = await player.get(location)
        assert stored.status_code == 200 and stored.content == ladder.mp4(height).read_bytes(), name
        assert "content-disposition" not in stored.headers
    for missing in ("1080p", "0090p", "best", "HIGHEST"):
        r = await player.get(f"{base}/v1/playback/{vid}/{missing}.mp4")
        assert r.status_code == 404 and problem_code(r) == "not_found", missing
    r = await client.call("PATCH", f"/v1/videos/{vid}", json={"name": "Café \"live\"/2"})
    assert r.status_code == 200, r.text
    r = await player.get(f"{base}/v1/playback/{vid}/highest.mp4", params={"download": "1"})
    stored = await player.get(r.headers["location"])
    assert stored.status_code == 200 and stored.headers["content-disposition"] == (
        f"attachment; filename=\"Caf_ _live_ 2-{max(HEIGHTS)}p.mp4\"; "
        f"filename*=UTF-8''Caf%C3%A9%20%22live%22%202-{max(HEIGHTS)}p.mp4")

    # signed: a token's viewing, or the app's own key; nothing before
    signed = await ready_video(client, prepared, ladder, "signed")
    url = signed["playback"]["mp4"]
    r = await player.get(url)
    assert r.status_code == 401 and problem_code(r) == "playback_token_required"
    kid, private = await new_key(client)
    token = token_for(kid, private, signed["id"], ttl=120)
    r = await player.get(with_token(url, token))
    assert r.status_code == 302
    assert int(parse_qs(urlsplit(r.headers["location"]).query)["X-Amz-Expires"][0]) <= 120
    assert (await client.call("GET", urlsplit(url).path)).status_code == 302
    nothing = await new_video(client)
    r = await player.get(f"{base}/v1/playback/{nothing['id']}/highest.mp4")
    assert r.status_code == 404 and problem_code(r) == "not_found"


ANIMATIONS = "weir_animations_made_total"


def gif_frames(data: bytes) -> tuple[int, int, int]:
    """(width, height, frames) of a GIF: its header, and the frames ffmpeg decodes from it."""
    assert data[:6] == b"GIF89a", data[:16]
    out = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-i", "pipe:0",
                          "-f", "framemd5", "pipe:1"], input=data, capture_output=True, check=True, timeout=60)
    frames = [line for line in out.stdout.decode().splitlines() if line and not line.startswith("#")]
    return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little"), len(frames)


async def test_an_animated_preview_is_made_once_from_the_asked_stretch_under_the_videos_rules(
    client: Client, player: httpx.AsyncClient, prepared: CommonSettings, ladder: Ladder, services: Services
) -> None:
    video = await ready_video(client, prepared, ladder)
    url = f"{str(client.http.base_url).rstrip('/')}/v1/videos/{video['id']}/animated.gif"
    fps, start, end, width = 5, 0.5, 2.5, 96
    r = await player.get(url, params={"start": start, "end": end, "width": width, "fps": fps})
    assert r.status_code == 302, r.text
    made = await player.get(r.headers["location"])
    assert made.status_code == 200 and made.headers["content-type"] == "image/gif"
    w, h, frames = gif_frames(made.content)
    assert w == width and h == width * 180 // 320 and abs(frames - (end - start) * fps) <= 1, (w, h, frames)
    before = _thumbs_made(services, ANIMATIONS)
    again = await player.get(url, params={"start": start, "end": end, "width": width, "fps": fps})
    assert again.status_code == 302 and _thumbs_made(services, ANIMATIONS) == before  # from the cache
    # the defaults: from the start, as long as the clip (shorter than the default 5 s), 320 wide at most the source
    made = await player.get((await player.get(url)).headers["location"])
    w, _, frames = gif_frames(made.content)
    assert w == min(DEFAULTS.animation_default_width, 320)
    assert abs(frames - SECONDS * DEFAULTS.animation_default_fps) <= 1
    for bad in ({"start": SECONDS + 1}, {"start": 2, "end": 1}, {"fps": DEFAULTS.animation_max_fps + 1},
                {"width": 8}, {"width": 321}):  # wider than the source
        r = await player.get(url, params=bad)
        assert r.status_code == 400 and problem_code(r) == "validation_error", (bad, r.text)
    signed = await ready_video(client, prepared, ladder, "signed")
    r = await player.get(f"{str(client.http.base_url).rstrip('/')}/v1/videos/{signed['id']}/animated.gif")
    assert r.status_code == 401 and problem_code(r) == "playback_token_required"
    r = await player.get(f"{str(client.http.base_url).rstrip('/')}/v1/videos/{(await new_video(client))['id']}"
                         "/animated.gif")
    assert r.status_code == 409 and problem_code(r) == "not_ready"

