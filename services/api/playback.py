"""Playback's decisions as plain functions (SPEC 14): the policy, playback tokens, the api's file-URL signatures, the
master playlist, rewriting the stored media playlists and storyboard, thumbnail requests, signing keys' forms.

No I/O and no clock: keys come in as records, time as `now` (seconds since the epoch).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final
from urllib.parse import quote, urlencode

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from shared.media.playback import Artwork, HlsRendition, video_prefix
from shared.videos import VideoStatus


class PlaybackPolicy(StrEnum):
    PUBLIC = "public"  # anyone with the URL plays it
    SIGNED = "signed"  # only with a playback token (a JWT signed by one of the app's playback keys)


class PlaybackCode(StrEnum):
    """The stable `code`s of playback's problem bodies."""

    TOKEN_REQUIRED = "playback_token_required"  # 401: a signed video, no token
    TOKEN_INVALID = "playback_token_invalid"  # 403: bad form, signature, key, video, audience or viewer
    TOKEN_EXPIRED = "playback_token_expired"  # 403: past its exp (beyond the leeway)
    URL_INVALID = "playback_url_invalid"  # 403: a file URL whose signature the api did not make, or a revoked key's
    URL_EXPIRED = "playback_url_expired"  # 403: a file URL past its expiry
    NOT_READY = "not_ready"  # 409: nothing to play (yet)


@dataclass(frozen=True)
class Refusal:
    status: int
    code: PlaybackCode
    detail: str


# --------------------------------------------------------------------------------------------- signing keys

ALGORITHMS: Final = ("ES256", "ES384", "RS256", "EdDSA")
GENERATED_ALGORITHM: Final = "ES256"  # what the api makes when asked to (EC P-256: small keys and tokens)
RSA_MIN_BITS: Final = 2048


@dataclass(frozen=True)
class PlaybackKey:
    """One of an app's playback signing keys, as stored (never its private half)."""

    id: str
    app_id: str
    algorithm: str
    public_key_pem: str
    fingerprint: str
    created_at: Any
    revoked_at: Any | None


@dataclass(frozen=True)
class PublicKeyRead:
    algorithm: str
    pem: str  # SubjectPublicKeyInfo PEM, as stored
    fingerprint: str


class KeyRefused(ValueError):
    """An uploaded key the api does not take (the route answers 400 with the message)."""


def fingerprint(spki_der: bytes) -> str:
    """`SHA256:` and the unpadded base64 of the public key's DER SubjectPublicKeyInfo digest (as ssh shows keys)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(spki_der).digest()).decode().rstrip("=")


def read_public_key(pem: str) -> PublicKeyRead:
    """The algorithm a public key signs with: EC P-256 ES256, P-384 ES384, RSA (2048 bits or more) RS256, Ed25519
    EdDSA. Anything else, or a private key, is refused."""
    if "PRIVATE KEY" in pem:
        raise KeyRefused("that is a private key: upload the public key only (the api never keeps a private key)")
    try:
        key = serialization.load_pem_public_key(pem.encode())
    except (ValueError, TypeError):
        raise KeyRefused("not a PEM public key (-----BEGIN PUBLIC KEY-----)") from None
    if isinstance(key, ec.EllipticCurvePublicKey):
        algorithm = {"secp256r1": "ES256", "secp384r1": "ES384"}.get(key.curve.name)
        if algorithm is None:
            raise KeyRefused(f"EC keys on P-256 or P-384 only, not {key.curve.name}")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < RSA_MIN_BITS:
            raise KeyRefused(f"RSA keys of at least {RSA_MIN_BITS} bits only")
        algorithm = "RS256"
    elif isinstance(key, ed25519.Ed25519PublicKey):
        algorithm = "EdDSA"
    else:
        raise KeyRefused("EC (P-256, P-384), RSA or Ed25519 public keys only")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    stored = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return PublicKeyRead(algorithm, stored, fingerprint(der))


def generate_key_pair() -> tuple[str, PublicKeyRead]:
    """A new ES256 pair: the private key's PKCS#8 PEM (shown once, never kept) and its public half as stored."""
    private = ec.generate_private_key(ec.SECP256R1())
    private_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()).decode()
    public_pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private_pem, read_public_key(public_pem)


# --------------------------------------------------------------------------------------------- playback tokens

VIEWER_CLAIM: Final = "ip"  # optional: the viewer's address; the request's client address must match it


@dataclass(frozen=True)
class Grant:
    """Why a request may play a video, and until when the file URLs made for it work.

    `kid` is what the file URLs are signed for: a playback key's id (the URLs stop when it is revoked), `public` (they
    stop when the video is no longer public) or `app` (the app's own secret key asked; they last their TTL)."""

    kid: str
    expires: int


GRANT_PUBLIC: Final = "public"
GRANT_APP: Final = "app"


def token_key_id(token: str) -> str | Refusal:
    """The `kid` of a token's header (read before its signature is checked, to find the key), or a refusal."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        return Refusal(403, PlaybackCode.TOKEN_INVALID, "the playback token is not a JWT")
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid:
        return Refusal(403, PlaybackCode.TOKEN_INVALID, "the playback token's header names no key (kid)")
    return kid


def viewer_matches(claimed: str, client_address: str) -> bool:
    """Whether the request's client address (auth's: IPv4 in full, IPv6 as its /64) is the token's viewer: an address
    (IPv6 compared by its /64, all the api knows of an IPv6 client) or a network containing the client."""
    try:
        network = ipaddress.ip_network(claimed.strip(), strict=False)
        client = ipaddress.ip_network(client_address, strict=False)
    except ValueError:
        return False
    if network.version != client.version:
        return False
    if network.version == 6 and network.prefixlen > 64:
        network = network.supernet(new_prefix=64)
    return client.subnet_of(network)  # type: ignore[arg-type]


def verify_token(token: str, key: PlaybackKey | None, *, video_id: str, app_id: str, client_address: str,
                 now: float, leeway: float, audience: str, public_key: Any = None,
                 url_ttl_max: float = math.inf) -> Grant | Refusal:
    """A playback token's verdict for one video of one app: signed by a live key of the app with the key's own
    algorithm (pinned: never the token's choice), `sub` the video, `exp` not past (with `leeway` seconds), `aud` (if
    any) naming `audience`, the viewer claim (if any) matching the client address. `public_key` is the key already
    loaded (else its PEM is read). The file URLs it grants last until its `exp`, at most `url_ttl_max` seconds."""
    invalid = PlaybackCode.TOKEN_INVALID
    if key is None or key.app_id != app_id:
        return Refusal(403, invalid, "the playback token's key is not one of this video's app")
    if key.revoked_at is not None:
        return Refusal(403, invalid, "the playback token's key was revoked")
    try:
        claims = jwt.decode(token, public_key if public_key is not None else key.public_key_pem,
                            algorithms=[key.algorithm],
                            options={"verify_exp": False, "verify_nbf": False, "verify_iat": False,
                                     "verify_aud": False, "verify_iss": False, "require": ["exp", "sub"]})
    except jwt.MissingRequiredClaimError as missing:
        return Refusal(403, invalid, f"the playback token has no `{missing.claim}` claim")
    except jwt.InvalidAlgorithmError:
        return Refusal(403, invalid, f"the playback token must be signed with {key.algorithm}, its key's algorithm")
    except jwt.InvalidSignatureError:
        return Refusal(403, invalid, "the playback token's signature does not verify")
    except jwt.DecodeError:
        return Refusal(403, invalid, "the playback token is not a readable JWT")
    except jwt.PyJWTError as exc:  # a registered claim of the wrong type (`sub` not a string, ...)
        return Refusal(403, invalid, f"the playback token's claims are not valid: {exc}")
    return claims_verdict(claims, key.id, video_id=video_id, client_address=client_address, now=now, leeway=leeway,
                          audience=audience, url_ttl_max=url_ttl_max)


def _number(value: Any) -> bool:
    """A JSON number a time claim can be: finite, and an integer no larger than a double holds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) < 1e300 if isinstance(value, int) else math.isfinite(value)


def claims_verdict(claims: Mapping[str, Any], key_id: str, *, video_id: str, client_address: str, now: float,
                   leeway: float, audience: str, url_ttl_max: float = math.inf) -> Grant | Refusal:
    """The claims' rules, once the signature verified."""
    invalid = PlaybackCode.TOKEN_INVALID
    exp, sub = claims.get("exp"), claims.get("sub")
    if not isinstance(exp, int | float) or not _number(exp):
        return Refusal(403, invalid, "the playback token's `exp` is not a number")
    if now > exp + leeway:
        return Refusal(403, PlaybackCode.TOKEN_EXPIRED, "the playback token has expired")
    nbf = claims.get("nbf")
    if nbf is not None and (not _number(nbf) or now + leeway < nbf):
        return Refusal(403, invalid, "the playback token is not valid yet (nbf)")
    if sub != video_id:
        return Refusal(403, invalid, "the playback token is for another video")
    if "aud" in claims:
        aud = claims["aud"]
        named = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if audience not in named:
            return Refusal(403, invalid, f"the playback token's `aud` does not name {audience!r}")
    if VIEWER_CLAIM in claims:
        viewer = claims[VIEWER_CLAIM]
        if not isinstance(viewer, str) or not viewer_matches(viewer, client_address):
            return Refusal(403, invalid, f"the playback token is for another viewer address (`{VIEWER_CLAIM}`)")
    return Grant(key_id, int(min(exp, now + url_ttl_max)))  # an `exp` years away: URLs that still expire


def open_grant(policy: PlaybackPolicy, *, owner: bool, now: float, ttl: int) -> Grant | None:
    """The grant of a request that needs no token: anyone on a public video, the app's own secret key on any (its
    file URLs last `ttl` seconds); None: a token is needed."""
    if policy is PlaybackPolicy.PUBLIC:
        return Grant(GRANT_PUBLIC, int(now) + ttl)
    if owner:
        return Grant(GRANT_APP, int(now) + ttl)
    return None


# --------------------------------------------------------------------------------------------- file URL signatures


def url_signature(secret: bytes, video_id: str, file: str, expires: int, kid: str) -> str:
    """HMAC-SHA256 over the video, the file (e.g. `360/seg-00001.m4s`), the expiry and the grant's key id."""
    message = f"{video_id}\n{file}\n{expires}\n{kid}".encode()
    return base64.urlsafe_b64encode(hmac.new(secret, message, hashlib.sha256).digest()).decode().rstrip("=")


def signed_query(secret: bytes, video_id: str, file: str, grant: Grant) -> str:
    """The query string of a file URL: `exp`, `kid`, `sig`."""
    sig = url_signature(secret, video_id, file, grant.expires, grant.kid)
    return urlencode({"exp": grant.expires, "kid": grant.kid, "sig": sig})


def url_refusal(secret: bytes, video_id: str, file: str, expires: int, kid: str, sig: str,
                now: float) -> Refusal | None:
    """Whether a file URL is one the api signed (compared in constant time) and not past its expiry."""
    expected = url_signature(secret, video_id, file, expires, kid)
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        return Refusal(403, PlaybackCode.URL_INVALID, "this file URL was not signed by the api")
    if now > expires:
        return Refusal(403, PlaybackCode.URL_EXPIRED, "this file URL has expired; load the playlist again")
    return None


def grant_refusal(kid: str, policy: PlaybackPolicy, key: PlaybackKey | None, app_id: str) -> Refusal | None:
    """A signed file URL still works: a public grant while the video is public, a key's while the key is live."""
    if kid == GRANT_APP:
        return None
    if kid == GRANT_PUBLIC:
        if policy is PlaybackPolicy.PUBLIC:
            return None
        return Refusal(403, PlaybackCode.URL_INVALID, "the video is no longer public; play it with a token")
    if key is None or key.app_id != app_id or key.revoked_at is not None:
        return Refusal(403, PlaybackCode.URL_INVALID, "the playback key this URL was signed for was revoked")
    return None


# --------------------------------------------------------------------------------------------- playlists

PLAYLIST_TYPE: Final = "application/vnd.apple.mpegurl"
VTT_TYPE: Final = "text/vtt; charset=utf-8"
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class UnsafeUri(ValueError):
    """A stored playlist or storyboard names something other than a plain file beside it."""


# a video plays while it is processing: each rendition as soon as its HLS files are stored (its encode.completed),
# so a viewer starts on the lowest while the larger ones encode, and the master playlist grows as they are added
PLAYABLE: Final = frozenset({VideoStatus.PROCESSING, VideoStatus.READY})


def playable(status: VideoStatus, renditions: Sequence[Mapping[str, Any]]) -> list[tuple[int, HlsRendition]]:
    """The renditions a master playlist lists: every one with HLS, by bandwidth, while the video is processing (those
    done so far) or ready."""
    if status not in PLAYABLE:
        return []
    found = []
    for r in renditions:
        hls = r.get("hls")
        if hls:
            try:
                found.append((int(r["height"]), HlsRendition.model_validate(hls)))
            except ValueError:
                continue  # a rendition this release cannot read is not listed
    return sorted(found, key=lambda item: (item[1].bandwidth, item[0]))


def master_playlist(entries: Sequence[tuple[str, HlsRendition]], subtitles: Sequence[str] = (),
                    group: str = "") -> str:
    """The master playlist of (media playlist URI, rendition), in the order given (by bandwidth); `subtitles`: the
    EXT-X-MEDIA lines of a SUBTITLES `group`, which every rendition then names."""
    lines = ["#EXTM3U", "#EXT-X-VERSION:7", "#EXT-X-INDEPENDENT-SEGMENTS", *subtitles]
    for uri, hls in entries:
        attributes = [f"BANDWIDTH={hls.bandwidth}", f"AVERAGE-BANDWIDTH={hls.average_bandwidth}",
                      f"RESOLUTION={hls.width}x{hls.height}", f'CODECS="{hls.codecs}"']
        if hls.frame_rate is not None:
            attributes.append(f"FRAME-RATE={hls.frame_rate:.3f}")
        if subtitles:
            attributes.append(f'SUBTITLES="{group}"')
        lines += ["#EXT-X-STREAM-INF:" + ",".join(attributes), uri]
    return "\n".join(lines) + "\n"


_URI_ATTRIBUTE = re.compile(r'URI="([^"]*)"')


def _checked_name(uri: str) -> str:
    if not FILE_NAME.match(uri) or ".." in uri:
        raise UnsafeUri(f"not a plain file name: {uri[:80]!r}")
    return uri


def rewrite_media_playlist(text: str, url_of: Callable[[str], str]) -> str:
    """A stored media playlist with every URI (segments, and `URI="..."` attributes such as EXT-X-MAP's) replaced by
    `url_of(file name)`. Raises UnsafeUri for a URI that is not a plain file name beside the playlist."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            line = _URI_ATTRIBUTE.sub(lambda m: f'URI="{url_of(_checked_name(m.group(1)))}"', line)
        else:
            line = url_of(_checked_name(line))
        out.append(line)
    return "\n".join(out) + "\n"


def rewrite_storyboard(text: str, sprite_url: str) -> str:
    """A stored storyboard WebVTT with each cue's sprite reference (`<file>#xywh=...`) pointing at `sprite_url`."""
    out = []
    for line in text.splitlines():
        name, hash_, fragment = line.strip().partition("#")
        if hash_ and fragment.startswith("xywh=") and "-->" not in line:
            _checked_name(name)
            line = f"{sprite_url}#{fragment}"
        out.append(line)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------- thumbnails


@dataclass(frozen=True)
class Thumb:
    time: float
    width: int
    key: str  # where it is cached in storage


def thumbnail_request(video_id: str, *, time: float | None, width: int | None, duration: float | None,
                      source_width: int, artwork: Artwork | None, min_width: int, max_width: int,
                      step: float) -> Thumb | str:
    """The frame to make for `?time=&width=` (a missing one from the poster, else the start and the source's width),
    its time rounded down to `step`; or why it cannot be made (the route answers 400)."""
    if time is not None and (not math.isfinite(time) or time < 0):
        return "time must be a number of seconds, 0 or more"
    if time is not None and duration is not None and time >= duration:
        return f"time must be within the video's {duration:.3f} s"
    widest = min(max_width, source_width)
    if width is not None and not min_width <= width <= widest:
        return f"width must be from {min_width} to {widest} pixels"
    at = time if time is not None else (artwork.poster_time if artwork is not None else 0.0)
    wide = width if width is not None else min(artwork.poster_width if artwork is not None else source_width, widest)
    at = math.floor(at / step) * step
    key = f"{video_prefix(video_id)}thumbs/t{round(at * 1000)}-w{wide}.jpg"
    return Thumb(round(at, 3), wide, key)


@dataclass(frozen=True)
class Animation:
    start: float
    seconds: float
    width: int
    fps: int
    key: str  # where it is cached in storage


@dataclass(frozen=True)
class AnimationLimits:
    default_seconds: float
    max_seconds: float
    default_width: int
    max_width: int
    default_fps: int
    max_fps: int
    step: float  # start and end are rounded down to it (one cached file per step)


def animation_request(video_id: str, *, start: float | None, end: float | None, width: int | None, fps: int | None,
                      duration: float | None, source_width: int, limits: AnimationLimits) -> Animation | str:
    """The animated preview `?start=&end=&width=&fps=` asks for (defaults: from the start, `default_seconds` long,
    `default_width` wide, at most the source's, `default_fps`), start and end rounded down to `step`; or why it
    cannot be made (the route answers 400)."""
    for name, value in (("start", start), ("end", end)):
        if value is not None and (not math.isfinite(value) or value < 0):
            return f"{name} must be a number of seconds, 0 or more"
    begin = start if start is not None else 0.0
    if duration is not None and begin >= duration:
        return f"start must be within the video's {duration:.3f} s"
    stop = end if end is not None else begin + limits.default_seconds
    if duration is not None:
        stop = min(stop, duration)
    if stop <= begin:
        return "end must be after start"
    if stop - begin > limits.max_seconds:
        return f"an animation lasts at most {limits.max_seconds:g} s"
    widest = min(limits.max_width, source_width)
    if width is not None and not 16 <= width <= widest:
        return f"width must be from 16 to {widest} pixels"
    if fps is not None and not 1 <= fps <= limits.max_fps:
        return f"fps must be from 1 to {limits.max_fps}"
    wide = width if width is not None else min(limits.default_width, widest)
    wide -= wide % 2  # even, as encoders want
    rate = fps if fps is not None else limits.default_fps
    begin, stop = (math.floor(t / limits.step) * limits.step for t in (begin, stop))
    if stop <= begin:
        stop = begin + limits.step
    key = f"{video_prefix(video_id)}thumbs/anim-s{round(begin * 1000)}-e{round(stop * 1000)}-w{wide}-f{rate}.gif"
    return Animation(round(begin, 3), round(stop - begin, 3), wide, rate, key)


def animation_source(renditions: Sequence[Mapping[str, Any]], width: int) -> Mapping[str, Any] | None:
    """The MP4 an animation is made from: the smallest at least `width` wide (the least to decode), else the widest."""
    mp4s = sorted((r for r in renditions if r.get("object_key") and isinstance(r.get("height"), int)),
                  key=lambda r: int(r["height"]))

    def wide(r: Mapping[str, Any]) -> int:
        hls = r.get("hls")
        return int((hls.get("width") if isinstance(hls, Mapping) else None) or r["height"])

    return next((r for r in mp4s if wide(r) >= width), mp4s[-1] if mp4s else None)


def best_source(renditions: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The rendition thumbnails are made from: the tallest MP4."""
    mp4s = [r for r in renditions if r.get("object_key")]
    return max(mp4s, key=lambda r: int(r["height"])) if mp4s else None


def duration_of(renditions: Sequence[Mapping[str, Any]], artwork: Artwork | None) -> float | None:
    """The video's duration as playback knows it: its HLS renditions', else the storyboard's; None if unknown."""
    durations = [float(r["hls"]["duration"]) for r in renditions if isinstance(r.get("hls"), dict)
                 and _number(r["hls"].get("duration"))]
    if durations:
        return max(durations)
    return artwork.duration if artwork is not None else None


# --------------------------------------------------------------------------------------------- MP4 files

MP4_NAMES: Final = ("highest", "lowest")  # besides `<p>p`, e.g. `720p`


def mp4_pick(name: str, renditions: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The stored MP4 rendition a stable MP4 URL names (`/v1/playback/{id}/<name>.mp4`): `highest`, `lowest`, or a
    rendition's p (`720p`); None when the video has none such (yet)."""
    mp4s = sorted((r for r in renditions if r.get("object_key") and isinstance(r.get("height"), int)),
                  key=lambda r: int(r["height"]))
    if not mp4s:
        return None
    if name == "highest":
        return mp4s[-1]
    if name == "lowest":
        return mp4s[0]
    m = re.fullmatch(r"([1-9][0-9]{1,4})p", name)
    return next((r for r in mp4s if m is not None and int(r["height"]) == int(m.group(1))), None)


def attachment(video_name: str, height: int) -> str:
    """The Content-Disposition of a download: the video's name and the rendition's p as the file name, an ASCII one
    for old clients and the UTF-8 one (RFC 6266, RFC 8187) for the rest."""
    stem = re.sub(r"\.{2,}", ".", re.sub(r"[\x00-\x1f\x7f/\\]+", " ", video_name)).strip(" .") or "video"
    stem = stem[:100]
    ascii_stem = re.sub(r"[^A-Za-z0-9 ._()-]+", "_", stem).strip() or "video"
    return (f'attachment; filename="{ascii_stem}-{height}p.mp4"; '
            f"filename*=UTF-8''{quote(f'{stem}-{height}p.mp4', safe='')}")


# --------------------------------------------------------------------------------------------- shown


def playback_shown(policy: PlaybackPolicy, base_url: str, video_id: str, *, hls: bool, thumbnail: bool,
                   storyboard: bool, mp4: bool = False) -> dict[str, Any]:
    """The video's `playback`: its policy and absolute URLs, each null until there is something there. A signed video's
    URLs need `?token=` added by the player's page."""
    base = base_url.rstrip("/")
    vid = quote(video_id, safe="")
    return {
        "policy": str(policy),
        "hls": f"{base}/v1/playback/{vid}/master.m3u8" if hls else None,
        "thumbnail": f"{base}/v1/videos/{vid}/thumbnail.jpg" if thumbnail else None,
        "storyboard": f"{base}/v1/videos/{vid}/storyboard.vtt" if storyboard else None,
        "embed": f"{base}/embed/{vid}" if hls else None,
        "mp4": f"{base}/v1/playback/{vid}/highest.mp4" if mp4 else None,
    }
