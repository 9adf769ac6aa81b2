"""What the playback routes do with the outside: playback keys from the database (a short cache), stored playlists
and storyboards, presigned redirects, and thumbnails made on demand with ffmpeg (SPEC 14)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from cryptography.hazmat.primitives import serialization

from services.api import playback, store
from services.api.objects import Objects, StorageUnavailable
from services.api.settings import ApiSettings
from shared.media.probe import ffmpeg_exe
from shared.metrics import Metrics
from shared.problems import Problem

log = logging.getLogger("weir.api.playback")


def url_secret(settings: ApiSettings) -> bytes:
    """The file URLs' HMAC secret: the setting, else derived from the internal token (the same on every instance),
    else a random one of this process (a single development instance; said once)."""
    own = settings.playback_url_secret.get_secret_value()
    if own:
        return own.encode()
    internal = settings.internal_token.get_secret_value()
    if internal:
        return hmac.new(internal.encode(), b"weir playback file urls v1", hashlib.sha256).digest()
    log.warning("neither WEIR_PLAYBACK_URL_SECRET nor WEIR_INTERNAL_TOKEN is set: playback file URLs are signed "
                "with a secret of this instance only")
    return secrets.token_bytes(32)


@dataclass
class _Cached:
    key: playback.PlaybackKey | None
    loaded: Any  # the public key object, ready for pyjwt
    until: float


@dataclass
class Player:
    pool: asyncpg.Pool
    objects: Objects
    settings: ApiSettings
    metrics: Metrics
    _secret: bytes = b""
    _keys: dict[str, _Cached] = field(default_factory=dict)
    _thumb_slots: asyncio.Semaphore | None = None

    @property
    def secret(self) -> bytes:
        if not self._secret:  # at first use, not at start: a settings-only build (docs, tests) signs nothing
            self._secret = url_secret(self.settings)
        return self._secret

    # ------------------------------------------------------------------------------------- keys

    async def key(self, key_id: str) -> tuple[playback.PlaybackKey | None, Any]:
        """The playback key (and its loaded public key), read from the database at most every
        `playback_key_cache_seconds` (well under a second: a revocation reaches every instance within it)."""
        now = time.monotonic()
        cached = self._keys.get(key_id)
        if cached is not None and cached.until > now:
            return cached.key, cached.loaded
        async with self.pool.acquire() as conn:
            key = await store.playback_key(conn, key_id)
        loaded = serialization.load_pem_public_key(key.public_key_pem.encode()) if key is not None else None
        ttl = self.settings.playback_key_cache_seconds
        if ttl > 0:
            if len(self._keys) > 10_000:  # a flood of made-up key ids must not grow the cache without end
                self._keys = {k: v for k, v in self._keys.items() if v.until > now}
            self._keys[key_id] = _Cached(key, loaded, now + ttl)
        return key, loaded

    # ------------------------------------------------------------------------------------- access

    async def grant(self, video: store.Video, *, owner: bool, token: str | None, client_address: str
                    ) -> playback.Grant:
        """Who may play: anyone on a public video, the app's secret key, else a valid playback token; a Problem
        otherwise."""
        now = time.time()
        s = self.settings
        opened = playback.open_grant(video.playback_policy, owner=owner, now=now,
                                     ttl=s.playback_public_url_ttl_seconds)
        if opened is not None:
            return opened
        if not token:
            raise refused(playback.Refusal(401, playback.PlaybackCode.TOKEN_REQUIRED,
                                           "this video plays only with a playback token: ?token=<JWT>"))
        kid = playback.token_key_id(token)
        if isinstance(kid, playback.Refusal):
            raise refused(kid)
        key, loaded = await self.key(kid)
        verdict = playback.verify_token(token, key, video_id=video.id, app_id=video.app_id,
                                        client_address=client_address, now=now,
                                        leeway=s.playback_token_leeway_seconds, audience=s.playback_token_audience,
                                        public_key=loaded, url_ttl_max=s.playback_token_url_ttl_max_seconds)
        if isinstance(verdict, playback.Refusal):
            raise refused(verdict)
        return verdict

    async def check_file_url(self, video: store.Video, file: str, expires: int, kid: str, sig: str) -> None:
        """A file URL the api signed, not expired, whose grant still holds (a revoked key's URLs stop too)."""
        refusal = playback.url_refusal(self.secret, video.id, file, expires, kid, sig, time.time())
        if refusal is None and kid not in (playback.GRANT_PUBLIC, playback.GRANT_APP):
            key, _ = await self.key(kid)
            refusal = playback.grant_refusal(kid, video.playback_policy, key, video.app_id)
        elif refusal is None:
            refusal = playback.grant_refusal(kid, video.playback_policy, None, video.app_id)
        if refusal is not None:
            raise refused(refusal)

    def file_query(self, video_id: str, file: str, grant: playback.Grant) -> str:
        return playback.signed_query(self.secret, video_id, file, grant)

    # ------------------------------------------------------------------------------------- storage

    async def stored_text(self, key: str) -> str:
        data = await self.objects.read_small(key, self.settings.playback_file_max_bytes)
        if data is None:
            raise Problem(404, "not_found", "the stored file is missing")
        return data.decode("utf-8", errors="replace")

    async def redirect_url(self, key: str) -> str:
        return await self.objects.get_url(key, self.settings.playback_storage_url_ttl_seconds)

    # ------------------------------------------------------------------------------------- thumbnails

    async def thumbnail(self, source_key: str, thumb: playback.Thumb) -> None:
        """Make the frame (cached in storage at `thumb.key`) unless it is there already: ffmpeg reads the source's
        presigned URL from just before the time (-ss before -i: a keyframe seek)."""
        args = ["-ss", f"{thumb.time:.3f}", "-i", "{source}", "-frames:v", "1", "-vf", f"scale={thumb.width}:-2",
                "-q:v", "3", "-f", "image2pipe", "-c:v", "mjpeg", "pipe:1"]
        if await self._made(source_key, thumb.key, args, "image/jpeg", self.settings.thumbnail_max_bytes,
                            "no frame at that time"):
            self.metrics.inc("thumbnails_made_total", help="thumbnails made on demand with ffmpeg (not from the cache)")

    async def animation(self, source_key: str, anim: playback.Animation) -> None:
        """Make the animated GIF (cached in storage at `anim.key`) unless it is there already: `anim.seconds` of the
        source from `anim.start`, at `anim.fps`, with a palette of its own frames (ffmpeg's palettegen)."""
        graph = (f"fps={anim.fps},scale={anim.width}:-2:flags=lanczos,split[a][b];[a]palettegen=stats_mode=diff[p];"
                 "[b][p]paletteuse=dither=bayer:bayer_scale=4")
        args = ["-ss", f"{anim.start:.3f}", "-t", f"{anim.seconds:.3f}", "-i", "{source}", "-an", "-filter_complex",
                graph, "-loop", "0", "-f", "gif", "pipe:1"]
        if await self._made(source_key, anim.key, args, "image/gif", self.settings.animation_max_bytes,
                            "nothing to animate at that time"):
            self.metrics.inc("animations_made_total", help="animated previews made on demand with ffmpeg (not from "
                             "the cache)")

    async def _made(self, source_key: str, key: str, args: list[str], content_type: str, most: int,
                    nothing: str) -> bool:
        """An image ffmpeg makes of a stored MP4 (`{source}` in `args`: its presigned URL), stored at `key` unless it
        is there already (False); in a bounded number of slots, within a bounded time (503 past it)."""
        if await self.objects.head(key) is not None:
            return False
        s = self.settings
        if self._thumb_slots is None:
            self._thumb_slots = asyncio.Semaphore(s.thumbnail_concurrency)
        try:
            async with asyncio.timeout(s.thumbnail_timeout_seconds):
                async with self._thumb_slots:
                    source = await self.objects.get_url(source_key, max(60, int(s.thumbnail_timeout_seconds) * 2))
                    image = await _ffmpeg([source if a == "{source}" else a for a in args], source, most)
        except TimeoutError:
            raise Problem(503, "unavailable", "the image took too long to make; retry shortly",
                          headers={"Retry-After": "1"}) from None
        if not image:
            raise Problem(400, "validation_error", nothing)
        await self.objects.put(key, image, content_type)
        return True


async def _ffmpeg(args: list[str], source: str, most: int) -> bytes:
    """What ffmpeg writes to its stdout with `args`; empty when it fails. ffmpeg is killed when the caller gives up
    (a timeout or a cancel)."""
    args = ["-hide_banner", "-loglevel", "error", "-nostdin", *args]
    proc = await asyncio.create_subprocess_exec(ffmpeg_exe(), *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
    if len(out) > most:
        raise StorageUnavailable("the image is larger than allowed")
    if proc.returncode != 0:
        # never the URL in a log: a presigned URL is a credential for its lifetime
        log.info("image: ffmpeg failed: %s", err.decode(errors="replace").replace(source, "<source>")[-300:])
        return b""
    return out


def refused(refusal: playback.Refusal) -> Problem:
    return Problem(refusal.status, str(refusal.code), refusal.detail)
