"""Playback's pure decisions (services/api/playback.py): tokens, file-URL signatures, playlists, storyboard, thumbnails,
keys; and the status projection keeping each rendition's HLS and the video's artwork."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import jwt
import m3u8
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from services.api import playback
from services.api.domain import EncodeEvent, Projection, project
from services.api.playback import Grant, PlaybackCode, PlaybackKey, PlaybackPolicy, Refusal
from services.api.settings import ApiSettings
from shared.events import EncodeCompleted, Event, new_event
from shared.media.playback import Artwork, HlsRendition
from shared.videos import VideoStatus

NOW = 1_800_000_000.0
S = ApiSettings()
LEEWAY = S.playback_token_leeway_seconds
AUD = S.playback_token_audience
VIDEO, APP = str(uuid.uuid4()), str(uuid.uuid4())
SECRET = b"s" * 32


def _key(private: Any = None, *, app: str = APP, revoked: bool = False) -> tuple[PlaybackKey, Any]:
    private = private or ec.generate_private_key(ec.SECP256R1())
    pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    read = playback.read_public_key(pem)
    key = PlaybackKey(str(uuid.uuid4()), app, read.algorithm, read.pem, read.fingerprint, datetime.now(UTC),
                      datetime.now(UTC) if revoked else None)
    return key, private


def _token(key: PlaybackKey, private: Any, alg: str | None = None, **claims: Any) -> str:
    body = {"sub": VIDEO, "exp": int(NOW) + 600, **claims}
    body = {k: v for k, v in body.items() if v is not None}
    return jwt.encode(body, private, algorithm=alg or key.algorithm, headers={"kid": key.id})


def _verify(token: str, key: PlaybackKey | None, address: str = "203.0.113.7", now: float = NOW
            ) -> Grant | Refusal:
    return playback.verify_token(token, key, video_id=VIDEO, app_id=APP, client_address=address, now=now,
                                 leeway=LEEWAY, audience=AUD)


def _code(verdict: Grant | Refusal) -> str | None:
    return str(verdict.code) if isinstance(verdict, Refusal) else None


# ------------------------------------------------------------------------------------------------ tokens


def test_a_good_token_grants_until_its_exp_for_its_key() -> None:
    key, private = _key()
    token = _token(key, private, aud=AUD)
    assert playback.token_key_id(token) == key.id
    assert _verify(token, key) == Grant(key.id, int(NOW) + 600)


@pytest.mark.parametrize("make", [
    lambda: ec.generate_private_key(ec.SECP384R1()),
    lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
    lambda: ed25519.Ed25519PrivateKey.generate(),
])
def test_every_key_kind_verifies_with_its_own_algorithm(make: Any) -> None:
    key, private = _key(make())
    assert isinstance(_verify(_token(key, private), key), Grant), key.algorithm


def test_a_token_expiring_years_away_grants_urls_that_still_expire() -> None:
    key, private = _key()
    cap = S.playback_token_url_ttl_max_seconds
    far = _token(key, private, exp=10**100)
    assert playback.verify_token(far, key, video_id=VIDEO, app_id=APP, client_address="203.0.113.7", now=NOW,
                                 leeway=LEEWAY, audience=AUD, url_ttl_max=cap) == Grant(key.id, int(NOW + cap))
    near = _token(key, private, exp=int(NOW) + 60)  # sooner than the cap: its own exp
    assert playback.verify_token(near, key, video_id=VIDEO, app_id=APP, client_address="203.0.113.7", now=NOW,
                                 leeway=LEEWAY, audience=AUD, url_ttl_max=cap) == Grant(key.id, int(NOW) + 60)


def test_expiry_with_leeway() -> None:
    key, private = _key()
    token = _token(key, private, exp=int(NOW) - 1)
    assert isinstance(_verify(token, key), Grant)  # within the leeway
    assert _code(_verify(token, key, now=NOW + LEEWAY + 2)) == PlaybackCode.TOKEN_EXPIRED


@pytest.mark.parametrize(("claims", "why"), [
    ({"sub": str(uuid.uuid4())}, "another video"),
    ({"exp": None}, "`exp`"),
    ({"sub": None}, "`sub`"),
    ({"exp": "soon"}, "not a number"),
    ({"exp": 10**400}, "not a number"),  # larger than a double: refused, not an OverflowError
    ({"nbf": 10**400}, "not valid yet"),
    ({"aud": "elsewhere"}, "aud"),
    ({"aud": ["a", "b"]}, "aud"),
    ({"nbf": int(NOW) + 3600}, "not valid yet"),
    ({"ip": "198.51.100.1"}, "another viewer"),
    ({"ip": 7}, "another viewer"),
    ({"sub": 5}, "claims are not valid: Subject must be a string"),  # not "signature"
])
def test_claims_that_refuse(claims: dict[str, Any], why: str) -> None:
    key, private = _key()
    verdict = _verify(_token(key, private, **claims), key)
    assert _code(verdict) == PlaybackCode.TOKEN_INVALID and isinstance(verdict, Refusal) and why in verdict.detail


def test_the_keys_algorithm_is_pinned_and_its_signature_checked() -> None:
    key, private = _key()
    _, other_private = _key()
    # signed by another key but naming this one
    forged = jwt.encode({"sub": VIDEO, "exp": int(NOW) + 60}, other_private, algorithm="ES256",
                        headers={"kid": key.id})
    assert "signature" in str(_verify(forged, key))
    # HS256 with the public key as the secret (the classic confusion) is refused: the key's algorithm is pinned
    confused = jwt.api_jws.PyJWS(algorithms=["HS256"]).encode(
        b'{"sub":"%s","exp":%d}' % (VIDEO.encode(), int(NOW) + 60), b"k" * 32, algorithm="HS256",
        headers={"kid": key.id})
    assert _code(_verify(confused, key)) == PlaybackCode.TOKEN_INVALID
    assert _code(_verify(_token(key, private) + "x", key)) == PlaybackCode.TOKEN_INVALID


def test_a_revoked_unknown_or_other_apps_key_refuses() -> None:
    key, private = _key(revoked=True)
    assert "revoked" in str(_verify(_token(key, private), key))
    assert _code(_verify(_token(key, private), None)) == PlaybackCode.TOKEN_INVALID
    foreign, foreign_private = _key(app=str(uuid.uuid4()))
    assert _code(_verify(_token(foreign, foreign_private), foreign)) == PlaybackCode.TOKEN_INVALID


def test_a_token_without_a_kid_or_not_a_jwt() -> None:
    _, private = _key()
    assert isinstance(playback.token_key_id(jwt.encode({"sub": VIDEO}, private, algorithm="ES256")), Refusal)
    assert isinstance(playback.token_key_id("not.a.jwt"), Refusal)
    assert isinstance(playback.token_key_id(""), Refusal)


@pytest.mark.parametrize(("claimed", "client", "matches"), [
    ("203.0.113.7", "203.0.113.7", True),
    ("203.0.113.8", "203.0.113.7", False),
    ("203.0.113.0/24", "203.0.113.7", True),
    ("2001:db8:1:2::99", "2001:db8:1:2::/64", True),  # the api knows an IPv6 client by its /64
    ("2001:db8:1:3::99", "2001:db8:1:2::/64", False),
    ("203.0.113.7", "2001:db8:1:2::/64", False),
    ("nonsense", "203.0.113.7", False),
    ("203.0.113.7", "unknown", False),
])
def test_viewer_address(claimed: str, client: str, matches: bool) -> None:
    assert playback.viewer_matches(claimed, client) is matches


def test_who_needs_no_token() -> None:
    assert playback.open_grant(PlaybackPolicy.PUBLIC, owner=False, now=NOW, ttl=10) == Grant("public", int(NOW) + 10)
    assert playback.open_grant(PlaybackPolicy.SIGNED, owner=True, now=NOW, ttl=10) == Grant("app", int(NOW) + 10)
    assert playback.open_grant(PlaybackPolicy.SIGNED, owner=False, now=NOW, ttl=10) is None


# ------------------------------------------------------------------------------------------------ file URLs


def test_file_url_signatures() -> None:
    sig = playback.url_signature(SECRET, VIDEO, "360/seg-00000.m4s", int(NOW) + 60, "public")
    ok = (SECRET, VIDEO, "360/seg-00000.m4s", int(NOW) + 60, "public", sig)
    assert playback.url_refusal(*ok, NOW) is None
    tampered = [
        (SECRET, VIDEO, "360/seg-00001.m4s", int(NOW) + 60, "public", sig),
        (SECRET, str(uuid.uuid4()), "360/seg-00000.m4s", int(NOW) + 60, "public", sig),
        (SECRET, VIDEO, "360/seg-00000.m4s", int(NOW) + 61, "public", sig),
        (SECRET, VIDEO, "360/seg-00000.m4s", int(NOW) + 60, "app", sig),
        (SECRET, VIDEO, "360/seg-00000.m4s", int(NOW) + 60, "public", sig[:-1] + ("A" if sig[-1] != "A" else "B")),
        (b"t" * 32, VIDEO, "360/seg-00000.m4s", int(NOW) + 60, "public", sig),
    ]
    for args in tampered:
        refusal = playback.url_refusal(*args, NOW)
        assert refusal is not None and refusal.code == PlaybackCode.URL_INVALID, args
    expired = playback.url_refusal(*ok, NOW + 61)
    assert expired is not None and expired.code == PlaybackCode.URL_EXPIRED
    query = playback.signed_query(SECRET, VIDEO, "360/init.mp4", Grant("k", 5))
    assert query == f"exp=5&kid=k&sig={playback.url_signature(SECRET, VIDEO, '360/init.mp4', 5, 'k')}"


def test_a_file_urls_grant_must_still_hold() -> None:
    key, _ = _key()
    revoked, _ = _key(revoked=True)
    assert playback.grant_refusal("public", PlaybackPolicy.PUBLIC, None, APP) is None
    assert playback.grant_refusal("public", PlaybackPolicy.SIGNED, None, APP) is not None  # made signed since
    assert playback.grant_refusal("app", PlaybackPolicy.SIGNED, None, APP) is None
    assert playback.grant_refusal(key.id, PlaybackPolicy.SIGNED, key, APP) is None
    assert playback.grant_refusal(revoked.id, PlaybackPolicy.SIGNED, revoked, APP) is not None
    assert playback.grant_refusal(key.id, PlaybackPolicy.SIGNED, None, APP) is not None
    assert playback.grant_refusal(key.id, PlaybackPolicy.SIGNED, key, str(uuid.uuid4())) is not None


# ------------------------------------------------------------------------------------------------ playlists


def _hls(height: int, bandwidth: int, **more: Any) -> HlsRendition:
    return HlsRendition(playlist_key=f"renditions/{VIDEO}/{height}p-1/index.m3u8", bandwidth=bandwidth,
                        average_bandwidth=bandwidth * 3 // 4, codecs="avc1.64001f,mp4a.40.2", width=height * 16 // 9,
                        height=height, frame_rate=more.get("frame_rate", 25.0), segments=2, duration=7.5)


@pytest.mark.parametrize("status", list(VideoStatus))
def test_a_video_plays_while_processing_and_once_ready_and_never_otherwise(status: VideoStatus) -> None:
    renditions = [{"height": 360, "object_key": "b", "hls": _hls(360, 600_000).model_dump()}]
    listed = [h for h, _ in playback.playable(status, renditions)]
    assert listed == ([360] if status in (VideoStatus.PROCESSING, VideoStatus.READY) else [])


def test_the_master_lists_every_rendition_stored_so_far_by_bandwidth() -> None:
    renditions = [{"height": 720, "object_key": "a", "hls": _hls(720, 2_000_000).model_dump()},
                  {"height": 360, "object_key": "b", "hls": _hls(360, 600_000).model_dump()},
                  {"height": 1080, "object_key": "c"},  # from a worker that made no HLS: not listed
                  {"height": 480, "object_key": "d", "hls": {"garbled": True}}]
    assert playback.playable(VideoStatus.PROCESSING, renditions) == playback.playable(VideoStatus.READY, renditions)
    entries = playback.playable(VideoStatus.READY, renditions)
    assert [h for h, _ in entries] == [360, 720]
    text = playback.master_playlist([(f"{h}/index.m3u8?x=1", hls) for h, hls in entries])
    assert text.startswith("#EXTM3U\n#EXT-X-VERSION:7\n#EXT-X-INDEPENDENT-SEGMENTS\n")
    parsed = m3u8.loads(text)
    assert parsed.is_variant and [p.uri for p in parsed.playlists] == ["360/index.m3u8?x=1", "720/index.m3u8?x=1"]
    first = parsed.playlists[0].stream_info
    assert (first.bandwidth, first.average_bandwidth, first.resolution, first.codecs, first.frame_rate) == (
        600_000, 450_000, (640, 360), "avc1.64001f,mp4a.40.2", 25.0)


MEDIA = """#EXTM3U
#EXT-X-VERSION:7
#EXT-X-TARGETDURATION:4
#EXT-X-MEDIA-SEQUENCE:0
#EXT-X-PLAYLIST-TYPE:VOD
#EXT-X-INDEPENDENT-SEGMENTS
#EXT-X-MAP:URI="init.mp4"
#EXTINF:4.000000,
seg-00000.m4s
#EXTINF:3.500000,
seg-00001.m4s
#EXT-X-ENDLIST
"""


def test_every_uri_of_a_media_playlist_is_rewritten() -> None:
    text = playback.rewrite_media_playlist(MEDIA, lambda name: f"{name}?sig={name.upper()}")
    parsed = m3u8.loads(text)
    assert parsed.segment_map[0].uri == "init.mp4?sig=INIT.MP4"
    assert [s.uri for s in parsed.segments] == ["seg-00000.m4s?sig=SEG-00000.M4S", "seg-00001.m4s?sig=SEG-00001.M4S"]
    assert [s.duration for s in parsed.segments] == [4.0, 3.5] and parsed.is_endlist


@pytest.mark.parametrize("uri", ["../other/seg.m4s", "https://elsewhere.example/seg.m4s", "/abs/seg.m4s", "a/b.m4s",
                                 ".hidden"])
def test_a_playlist_naming_anything_but_a_file_beside_it_is_refused(uri: str) -> None:
    with pytest.raises(playback.UnsafeUri):
        playback.rewrite_media_playlist(MEDIA.replace("seg-00001.m4s", uri), lambda name: name)
    with pytest.raises(playback.UnsafeUri):
        playback.rewrite_media_playlist(MEDIA.replace('URI="init.mp4"', f'URI="{uri}"'), lambda name: name)


def test_the_storyboard_points_at_the_signed_sprite() -> None:
    vtt = ("WEBVTT\n\n00:00:00.000 --> 00:00:02.000\nsprite.jpg#xywh=0,0,160,90\n\n"
           "00:00:02.000 --> 00:00:04.000\nsprite.jpg#xywh=160,0,160,90\n")
    out = playback.rewrite_storyboard(vtt, "https://api.example/v1/videos/v/storyboard.jpg?sig=1")
    assert out.splitlines()[3] == "https://api.example/v1/videos/v/storyboard.jpg?sig=1#xywh=0,0,160,90"
    assert out.splitlines()[6].endswith("#xywh=160,0,160,90") and "sprite.jpg" not in out
    assert out.splitlines()[2] == "00:00:00.000 --> 00:00:02.000"
    with pytest.raises(playback.UnsafeUri):
        playback.rewrite_storyboard(vtt.replace("sprite.jpg", "../x.jpg"), "u")


# ------------------------------------------------------------------------------------------------ thumbnails


ART = Artwork(poster_key="p", poster_time=2.0, poster_width=640, poster_height=360, sprite_key="s",
              storyboard_key="v", tile_width=160, tile_height=90, tiles=4, interval=2.0, duration=8.0)


def _thumb(**kw: Any) -> playback.Thumb | str:
    args: dict[str, Any] = {"time": None, "width": None, "duration": 8.0, "source_width": 1280, "artwork": ART,
                            "min_width": S.thumbnail_min_width, "max_width": S.thumbnail_max_width,
                            "step": S.thumbnail_time_step_seconds, **kw}
    return playback.thumbnail_request(VIDEO, **args)


def test_thumbnail_requests() -> None:
    made = _thumb(time=3.04, width=320)
    assert isinstance(made, playback.Thumb) and (made.time, made.width) == (3.0, 320)
    assert made.key == f"renditions/{VIDEO}/thumbs/t3000-w320.jpg"
    assert _thumb(time=3.0, width=320) == made  # the same step: the same cached image
    only_width = _thumb(width=200)
    assert isinstance(only_width, playback.Thumb) and only_width.time == ART.poster_time
    only_time = _thumb(time=1.0, artwork=None)
    assert isinstance(only_time, playback.Thumb) and only_time.width == 1280
    for bad in ({"time": 8.0}, {"time": 99.0}, {"time": -1.0}, {"time": float("nan")},
                {"width": S.thumbnail_min_width - 1}, {"width": 1281}, {"width": S.thumbnail_max_width + 1}):
        assert isinstance(_thumb(**bad), str), bad


def test_the_source_and_the_duration() -> None:
    renditions = [{"height": 360, "object_key": "a", "hls": {"duration": 7.5}}, {"height": 720, "object_key": "b"}]
    assert playback.best_source(renditions) == renditions[1]
    assert playback.best_source([]) is None
    assert playback.duration_of(renditions, ART) == 7.5
    assert playback.duration_of([{"height": 360}], ART) == ART.duration
    assert playback.duration_of([], None) is None


def test_playback_shown() -> None:
    shown = playback.playback_shown(PlaybackPolicy.SIGNED, "http://api.example:8080/", VIDEO, hls=True,
                                    thumbnail=True, storyboard=False)
    assert shown == {"policy": "signed", "hls": f"http://api.example:8080/v1/playback/{VIDEO}/master.m3u8",
                     "thumbnail": f"http://api.example:8080/v1/videos/{VIDEO}/thumbnail.jpg", "storyboard": None,
                     "embed": f"http://api.example:8080/embed/{VIDEO}", "mp4": None}
    assert playback.playback_shown(PlaybackPolicy.PUBLIC, "http://a/", VIDEO, hls=False, thumbnail=False,
                                   storyboard=False)["embed"] is None


# ------------------------------------------------------------------------------------------------ keys


def test_keys_made_and_uploaded() -> None:
    private_pem, public = playback.generate_key_pair()
    assert public.algorithm == "ES256" and public.fingerprint.startswith("SHA256:")
    private = serialization.load_pem_private_key(private_pem.encode(), None)
    assert playback.read_public_key(public.pem) == public  # the same key, the same fingerprint
    token = jwt.encode({"sub": VIDEO, "exp": int(NOW) + 60}, private, algorithm="ES256")  # type: ignore[arg-type]
    assert jwt.decode(token, public.pem, algorithms=["ES256"], options={"verify_exp": False})["sub"] == VIDEO
    with pytest.raises(playback.KeyRefused, match="private key"):
        playback.read_public_key(private_pem)
    with pytest.raises(playback.KeyRefused):
        playback.read_public_key("-----BEGIN PUBLIC KEY-----\nnonsense\n-----END PUBLIC KEY-----\n")
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with pytest.raises(playback.KeyRefused, match="2048"):
        playback.read_public_key(small)
    k1 = ec.generate_private_key(ec.SECP256K1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with pytest.raises(playback.KeyRefused):
        playback.read_public_key(k1)


# ------------------------------------------------------------------------------------------------ projection


def _typed(data: EncodeCompleted) -> EncodeEvent:
    """As the api's consumer reads it off the wire."""
    event: EncodeEvent = Event[EncodeCompleted].model_validate_json(
        new_event(data, source="encode", subject=VIDEO).to_bytes())
    return event


def test_the_projection_keeps_each_renditions_hls_and_the_artwork() -> None:
    start = Projection(VideoStatus.PROCESSING, None, (), None)
    first = _typed(EncodeCompleted(video_id=VIDEO, output=360, worker="w", object_key="k360", size=1,
                                   outputs_remaining=1, hls=_hls(360, 600_000), artwork=ART))
    p = project(start, first)
    assert p.renditions[0]["hls"] == _hls(360, 600_000).model_dump(mode="json")
    assert p.artwork == ART.model_dump(mode="json")
    second = _typed(EncodeCompleted(video_id=VIDEO, output=720, worker="w", object_key="k720", size=1,
                                    outputs_remaining=0))
    p = project(p, second)
    assert p.status is VideoStatus.READY and p.artwork == ART.model_dump(mode="json")  # kept when not carried
    assert "hls" not in p.renditions[1] and [h for h, _ in playback.playable(p.status, p.renditions)] == [360]


# ------------------------------------------------------------------------------------------------ MP4 files

MP4S = [{"height": 720, "object_key": "r/720.mp4"}, {"height": 360, "object_key": "r/360.mp4"},
        {"height": 1080}, {"height": "480", "object_key": "r/odd.mp4"}]  # one not stored yet, one unreadable


@pytest.mark.parametrize(("name", "height"), [
    ("highest", 720), ("lowest", 360), ("360p", 360), ("720p", 720), ("1080p", None), ("480p", None),
    ("0360p", None), ("360", None), ("360P", None), ("p", None), ("Highest", None), ("", None), ("99999999p", None),
])
def test_a_stable_mp4_url_names_a_stored_rendition(name: str, height: int | None) -> None:
    picked = playback.mp4_pick(name, MP4S)
    assert (picked["height"] if picked is not None else None) == height
    assert playback.mp4_pick(name, [{"height": 1080}]) is None  # nothing stored: nothing named


@pytest.mark.parametrize(("video_name", "ascii_name", "utf8_name"), [
    ("clip", "clip-720p.mp4", "clip-720p.mp4"),
    ("Café \"live\"", "Caf_ _live_-720p.mp4", "Caf%C3%A9%20%22live%22-720p.mp4"),
    ("../../etc/passwd", "etc passwd-720p.mp4", "etc%20passwd-720p.mp4"),
    ("a\r\nContent-Type: x", "a Content-Type_ x-720p.mp4", "a%20Content-Type%3A%20x-720p.mp4"),
    ("", "video-720p.mp4", "video-720p.mp4"), ("日本", "_-720p.mp4", "%E6%97%A5%E6%9C%AC-720p.mp4"),
])
def test_a_downloads_file_name_is_the_videos_and_cannot_break_the_header(video_name: str, ascii_name: str,
                                                                         utf8_name: str) -> None:
    header = playback.attachment(video_name, 720)
    assert header == f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{utf8_name}"
    assert "\r" not in header and "\n" not in header and header.count('"') == 2


# ------------------------------------------------------------------------------------------------ animated previews

LIMITS = playback.AnimationLimits(default_seconds=5, max_seconds=10, default_width=320, max_width=640, default_fps=10,
                                  max_fps=30, step=0.1)


def animation(**asked: Any) -> playback.Animation | str:
    given: dict[str, Any] = {"start": None, "end": None, "width": None, "fps": None, "duration": 30.0,
                             "source_width": 1280, **asked}
    return playback.animation_request(VIDEO, limits=LIMITS, **given)


def test_an_animation_asked_for_nothing_is_the_first_seconds_at_the_defaults() -> None:
    made = animation()
    assert isinstance(made, playback.Animation)
    assert (made.start, made.seconds, made.width, made.fps) == (0.0, LIMITS.default_seconds, LIMITS.default_width,
                                                                LIMITS.default_fps)
    assert made.key.endswith("thumbs/anim-s0-e5000-w320-f10.gif") and VIDEO in made.key


@pytest.mark.parametrize(("asked", "expected"), [
    ({"start": 12.34}, (12.3, 5.0, 320, 10)),  # rounded down to the step
    ({"start": 2, "end": 4.05}, (2.0, 2.0, 320, 10)),
    ({"start": 28}, (28.0, 2.0, 320, 10)),  # cut at the video's end
    ({"width": 641 - 1, "fps": 30}, (0.0, 5.0, 640, 30)),
    ({"width": 101}, (0.0, 5.0, 100, 10)),  # even
    ({"source_width": 200}, (0.0, 5.0, 200, 10)),  # never wider than the source
    ({"duration": None, "start": 100}, (100.0, 5.0, 320, 10)),  # a duration not known: not bounded by it
    ({"start": 3.04, "end": 3.09}, (3.0, 0.1, 320, 10)),  # within one step: one step long
])
def test_an_animation_is_what_was_asked_within_its_bounds(asked: dict[str, Any],
                                                         expected: tuple[float, float, int, int]) -> None:
    made = animation(**asked)
    assert isinstance(made, playback.Animation), made
    assert (made.start, made.seconds, made.width, made.fps) == pytest.approx(expected)


@pytest.mark.parametrize(("asked", "says"), [
    ({"start": -1}, "start must be"), ({"end": float("nan")}, "end must be"), ({"start": float("inf")}, "start"),
    ({"start": 30}, "within the video"), ({"start": 5, "end": 5}, "after start"), ({"start": 5, "end": 4}, "after"),
    ({"start": 0, "end": 10.5}, "at most 10 s"), ({"width": 15}, "width must be from 16 to 640"),
    ({"width": 641}, "16 to 640"), ({"source_width": 300, "width": 320}, "16 to 300"), ({"fps": 0}, "fps"),
    ({"fps": 31}, "fps must be from 1 to 30"),
])
def test_an_animation_out_of_bounds_says_why(asked: dict[str, Any], says: str) -> None:
    made = animation(**asked)
    assert isinstance(made, str) and says in made, made


def test_an_animation_is_made_from_the_smallest_mp4_wide_enough() -> None:
    renditions = [{"height": 1080, "object_key": "k/1080", "hls": {"width": 1920}},
                  {"height": 360, "object_key": "k/360", "hls": {"width": 640}},
                  {"height": 720, "object_key": "k/720"}, {"height": 2160}]  # no hls: its height; not stored
    assert [(playback.animation_source(renditions, w) or {}).get("object_key") for w in (320, 640, 641, 720, 721,
                                                                                         4000)] == [
        "k/360", "k/360", "k/720", "k/720", "k/1080", "k/1080"]
    assert playback.animation_source([{"height": 360}], 320) is None
