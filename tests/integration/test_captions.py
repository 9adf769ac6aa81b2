"""Caption tracks over real HTTP: auth and the api as processes, the session's PostgreSQL, S3 and NATS. A track is
uploaded with the secret key (WebVTT, or SubRip turned into WebVTT), offered in the master playlist as a SUBTITLES
rendition, and fetched by a player as HLS players fetch it (the playlists parsed with `m3u8`); a signed video's
tracks play only under its grant. The ready videos are made as tests/integration/test_playback.py makes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import m3u8
import pytest

from services.api import captions
from services.api.settings import ApiSettings
from shared.settings import CommonSettings
from tests.integration.apihelpers import UNLIMITED, Client, Services, new_app, run_services
from tests.integration.test_playback import (
    HEIGHTS,
    PLAYER_ADDRESS,
    SECONDS,
    Ladder,
    ladder,  # noqa: F401  (the module's fixture)
    new_key,
    new_video,
    player,  # noqa: F401  (the module's fixture)
    problem_code,
    ready_video,
    tampered,
    token_for,
    with_token,
)
from tests.stored import object_exists

pytestmark = pytest.mark.asyncio(loop_scope="session")

MOST_TRACKS = 3  # small, so that the limit is reached
MOST_BYTES = 4096
DEFAULTS = ApiSettings()

ENGLISH = ("WEBVTT - English\n\nNOTE written by hand\n\nintro\n00:00.500 --> 00:01.500 line:90%\nHello <b>there</b>\n\n"
           "00:00:02.000 --> 00:00:02.900\nGoodbye\n")
SUBRIP = ("1\r\n00:00:00,250 --> 00:00:01,000\r\nOlá\r\n\r\n2\r\n00:00:01,500 --> 00:00:02,750\r\n<i>Tchau</i>\r\n")
SUBRIP_AS_VTT = ("WEBVTT\n\n1\n00:00:00.250 --> 00:00:01.000\nOlá\n\n2\n00:00:01.500 --> 00:00:02.750\n<i>Tchau</i>\n")


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), captions_max_tracks=str(MOST_TRACKS),
                      captions_max_bytes=str(MOST_BYTES), **UNLIMITED) as s:
        yield s


@pytest.fixture
async def client(services: Services, prepared: CommonSettings) -> AsyncIterator[Client]:
    c = Client(services, (await new_app(prepared, "captions")).secret_key, PLAYER_ADDRESS)
    yield c
    await c.http.aclose()


async def put_track(client: Client, vid: str, language: str, text: str | bytes, *, media_type: str = "text/vtt",
                    **params: Any) -> httpx.Response:
    body = text.encode() if isinstance(text, str) else text
    return await client.call("PUT", f"/v1/videos/{vid}/captions/{language}", params=params, content=body,
                             headers={"Content-Type": media_type})


async def subtitles_of(http: httpx.AsyncClient, master_url: str) -> list[tuple[m3u8.Media, str, str]]:
    """What a player finds of the master playlist's SUBTITLES: each rendition, its WebVTT file's URL (through its
    media playlist, which must be one segment lasting the video) and that file."""
    r = await http.get(master_url)
    assert r.status_code == 200, r.text
    master = m3u8.loads(r.text, uri=master_url)
    found = []
    for media in master.media:
        assert media.type == "SUBTITLES" and media.group_id == captions.GROUP, media
        playlist_url = urljoin(master_url, media.uri)
        r = await http.get(playlist_url)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/vnd.apple.mpegurl"), r.text
        playlist = m3u8.loads(r.text, uri=playlist_url)
        assert playlist.is_endlist and len(playlist.segments) == 1, r.text
        assert playlist.segments[0].duration == pytest.approx(SECONDS, abs=0.1)
        vtt_url = urljoin(playlist_url, playlist.segments[0].uri)
        r = await http.get(vtt_url)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/vtt"), r.text
        assert r.headers["access-control-allow-origin"] == "*"
        found.append((media, vtt_url, r.text))
    if master.media:  # every rendition names the group, so that players offer the tracks with each
        assert {p.stream_info.subtitles for p in master.playlists} == {captions.GROUP}
    return found


async def test_tracks_uploaded_as_webvtt_and_subrip_are_offered_with_the_ladder_and_played(
    client: Client, player: httpx.AsyncClient, prepared: CommonSettings, ladder: Ladder  # noqa: F811
) -> None:
    video = await ready_video(client, prepared, ladder)
    vid, master_url = video["id"], video["playback"]["hls"]
    assert video["captions"] == [] and await subtitles_of(player, master_url) == []

    r = await put_track(client, vid, "EN", ENGLISH)
    assert r.status_code == 201, r.text
    english = r.json()
    base = str(client.http.base_url).rstrip("/")
    assert english == {"language": "en", "name": "en", "closed_captions": False, "size": len(ENGLISH.encode()),
                       "cues": 2, "created_at": english["created_at"], "updated_at": english["created_at"],
                       "url": f"{base}/v1/playback/{vid}/captions/en.vtt"}
    r = await put_track(client, vid, "pt-br", SUBRIP, media_type="application/x-subrip", name="Português (SDH)",
                        closed_captions="true")
    assert r.status_code == 201, r.text
    portuguese = r.json()
    assert (portuguese["language"], portuguese["name"], portuguese["closed_captions"], portuguese["cues"]) == (
        "pt-BR", "Português (SDH)", True, 2)

    listed = (await client.call("GET", f"/v1/videos/{vid}/captions")).json()["captions"]
    assert listed == [english, portuguese]  # in the order first uploaded
    assert (await client.call("GET", f"/v1/videos/{vid}")).json()["captions"] == listed
    assert (await client.call("GET", f"/v1/videos/{vid}/captions/pt-BR")).json() == portuguese

    offered = await subtitles_of(player, master_url)
    assert [(m.language, m.name, m.default, m.autoselect) for m, _, _ in offered] == [
        ("en", "en", "NO", "YES"), ("pt-BR", "Português (SDH)", "NO", "YES")]
    assert offered[0][0].characteristics is None
    assert offered[1][0].characteristics == captions.CLOSED_CAPTIONS_CHARACTERISTICS
    assert [text for _, _, text in offered] == [ENGLISH, SUBRIP_AS_VTT]  # as uploaded; SubRip as WebVTT
    # the track's own URL, as a page's <track> or the developer's server reads it
    r = await player.get(english["url"])
    assert r.status_code == 200 and r.text == ENGLISH
    assert r.headers["cache-control"] == f"public, max-age={DEFAULTS.playback_public_max_age_seconds}"

    # a file replaced: a new URL in the playlists (caches keep nothing stale), the first upload's time kept,
    # the old file gone from storage
    before = {m.language: uri for m, uri, _ in offered}
    replacement = ENGLISH.replace("Goodbye", "Bye now")
    await asyncio.sleep(0.01)
    r = await put_track(client, vid, "en", replacement, name="English")
    assert r.status_code == 200, r.text
    replaced = r.json()
    assert replaced["created_at"] == english["created_at"]
    assert datetime.fromisoformat(replaced["updated_at"]) > datetime.fromisoformat(english["updated_at"])
    after = {m.language: (uri, text, m.name) for m, uri, text in await subtitles_of(player, master_url)}
    assert after["en"][1:] == (replacement, "English") and after["en"][0] != before["en"]
    assert after["pt-BR"][0] == before["pt-BR"]
    assert not await object_exists(prepared, captions.caption_key(vid, "en", ENGLISH))
    assert await object_exists(prepared, captions.caption_key(vid, "en", replacement))

    # removed: no longer offered, its file gone; the video's deletion takes the rest
    assert (await client.call("DELETE", f"/v1/videos/{vid}/captions/en")).status_code == 204
    r = await client.call("DELETE", f"/v1/videos/{vid}/captions/en")
    assert r.status_code == 404 and problem_code(r) == "not_found"
    assert (await player.get(english["url"])).status_code == 404
    assert [m.language for m, _, _ in await subtitles_of(player, master_url)] == ["pt-BR"]
    assert not await object_exists(prepared, captions.caption_key(vid, "en", replacement))
    assert (await client.call("DELETE", f"/v1/videos/{vid}")).status_code == 204
    assert not await object_exists(prepared, captions.caption_key(vid, "pt-BR", SUBRIP_AS_VTT))


async def test_a_signed_videos_tracks_play_only_under_its_grant(
    client: Client, player: httpx.AsyncClient, prepared: CommonSettings, ladder: Ladder  # noqa: F811
) -> None:
    video = await ready_video(client, prepared, ladder, "signed")
    vid = video["id"]
    track = (await put_track(client, vid, "fr", ENGLISH.replace("Hello", "Bonjour"))).json()
    kid, private = await new_key(client)
    token = token_for(kid, private, vid)

    r = await player.get(track["url"])
    assert r.status_code == 401 and problem_code(r) == "playback_token_required"
    r = await player.get(f"{base_of(track['url'])}/v1/playback/{vid}/captions/fr.m3u8")
    assert r.status_code == 401 and problem_code(r) == "playback_token_required"
    r = await player.get(with_token(track["url"], token_for(kid, private, (await new_video(client))["id"])))
    assert r.status_code == 403 and problem_code(r) == "playback_token_invalid"  # another video's token
    assert (await player.get(with_token(track["url"], token))).text.startswith("WEBVTT")
    assert (await client.call("GET", urlsplit(track["url"]).path)).status_code == 200  # the app's own secret key

    ((media, vtt_url, text),) = await subtitles_of(player, with_token(video["playback"]["hls"], token))
    assert media.language == "fr" and "Bonjour" in text
    # the listed URLs are signed for the token's lifetime, each for its own file only
    query = parse_qs(urlsplit(vtt_url).query)
    assert query["kid"] == [kid] and "token" not in query
    r = await player.get(tampered(vtt_url))
    assert r.status_code == 403 and problem_code(r) == "playback_url_invalid"
    other_file = vtt_url.replace("/captions/fr.vtt", f"/{HEIGHTS[0]}/init.mp4")
    r = await player.get(other_file)
    assert r.status_code == 403 and problem_code(r) == "playback_url_invalid"
    r = await player.get(with_token(video["playback"]["hls"], token))
    assert r.headers["cache-control"] == "no-store"


def base_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def test_a_track_refused_says_why_and_changes_nothing(
    client: Client, player: httpx.AsyncClient, services: Services, prepared: CommonSettings  # noqa: F811
) -> None:
    vid = (await new_video(client))["id"]

    async def refused(language: str, text: str | bytes, status: int, code: str, *, says: str = "",
                      **kw: Any) -> None:
        r = await put_track(client, vid, language, text, **kw)
        assert r.status_code == status and problem_code(r) == code, r.text
        assert says in r.json()["detail"], r.json()

    await refused("english", ENGLISH, 400, "validation_error", says="BCP 47")
    await refused("en", ENGLISH, 415, "unsupported_media_type", media_type="application/json")
    await refused("en", "WEBVTT\n\n00:02.000 --> 00:01.000\nbackwards\n", 400, "invalid_captions", says="line 3")
    await refused("en", "WEBVTT\n\n00:01.000 -> 00:02.000\nno arrow\n", 400, "invalid_captions", says="line 3")
    await refused("en", "WEBVTT\n", 400, "invalid_captions", says="no cues")
    await refused("en", "just some text\n", 400, "invalid_captions", says="neither WebVTT")
    await refused("en", b"WEBVTT\n\n00:01.000 --> 00:02.000\n\xff\xfe\n", 400, "invalid_captions", says="UTF-8")
    await refused("en", ENGLISH, 400, "validation_error", name='say "hi"')
    cues = "".join(f"00:00:{i % 60:02d}.000 --> 00:00:{i % 60:02d}.500\ncue {i}\n\n" for i in range(MOST_BYTES))
    await refused("en", "WEBVTT\n\n" + cues, 413, "payload_too_large")
    assert (await client.call("GET", f"/v1/videos/{vid}/captions")).json() == {"captions": []}

    # a video not playing yet takes tracks; its playlists say it has nothing to play
    for i, language in enumerate(("de", "it", "ja")[:MOST_TRACKS]):
        assert (await put_track(client, vid, language, ENGLISH, name=f"track {i}")).status_code == 201
    await refused("ko", ENGLISH, 409, "conflict", says=f"{MOST_TRACKS} caption tracks")
    await refused("de", ENGLISH, 409, "conflict", says="named", name="track 1")  # a name is unique per video
    assert (await put_track(client, vid, "de", ENGLISH, name="track 0")).status_code == 200  # its own name again
    r = await player.get(f"{base_of(str(client.http.base_url))}/v1/playback/{vid}/captions/de.m3u8")
    assert r.status_code == 409 and problem_code(r) == "not_ready"

    # another app's key sees no such video
    stranger = Client(services, (await new_app(prepared, "stranger")).secret_key, PLAYER_ADDRESS)
    try:
        r = await put_track(stranger, vid, "en", ENGLISH)
        assert r.status_code == 404 and problem_code(r) == "not_found"
        assert (await stranger.call("GET", f"/v1/videos/{vid}/captions")).status_code == 404
    finally:
        await stranger.http.aclose()
