"""The playback routes (SPEC 14): players' playlists and files, thumbnails and storyboards, and the apps' playback
signing keys.

Players send no API key (a browser cannot keep one): their routes are of class `public`, so the guard still asks
auth.check for each, which counts them on the client address's budget (SPEC 3) and hands on the client address
(the viewer claim's) and, when a secret key was sent, its identity (the app's own server plays any of its videos).
Their answers carry `Access-Control-Allow-Origin: *`: players on any page read them (the URLs are the credential).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from services.api import captions, playback, store
from services.api.player import Player
from services.api.videos import Videos, artwork_of
from shared.authcheck import CheckDecision
from shared.problems import Problem, problem
from shared.routeclass import route_class
from shared.videos import VideoStatus

log = logging.getLogger("weir.api.playback")
PROBLEM = {"model": dict[str, Any], "content": {"application/problem+json": {}}, "description": "problem (RFC 9457)"}
PLAYER_ERRORS: dict[int | str, dict[str, Any]] = {s: PROBLEM for s in (400, 401, 403, 404, 409, 429, 503)}
OPEN = {"Access-Control-Allow-Origin": "*"}
NO_STORE = "no-store"
GROWING = "no-cache"  # a processing video's master playlist: stored, but asked again before each use
PLAYLIST: dict[int | str, dict[str, Any]] = {200: {"content": {playback.PLAYLIST_TYPE: {"schema": {"type": "string"}}},
                  "description": "an HLS playlist"}}
WEBVTT: dict[int | str, dict[str, Any]] = {200: {"content": {"text/vtt": {"schema": {"type": "string"}}},
                                                  "description": "WebVTT"}}
REDIRECT: dict[int | str, dict[str, Any]] = {302: {"description": "to a short-lived presigned storage URL of the file"}}

TokenParam = Annotated[str | None, Query(max_length=8192, description="a playback token (JWT), for a signed video")]
ExpParam = Annotated[int | None, Query(ge=0, description="a file URL's expiry (set by the api)")]
KidParam = Annotated[str | None, Query(max_length=100, description="a file URL's grant (set by the api)")]
SigParam = Annotated[str | None, Query(max_length=100, description="a file URL's signature (set by the api)")]
VersionParam = Annotated[str | None, Query(max_length=64, description="a caption file's version (set by the api: a "
                                           "replaced file gets a new URL)")]


class PlayerRoute(APIRoute):
    """A player's route: every answer, problems included, readable from any page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                response = await original(request)
            except Problem as p:
                response = p.response()
            except RequestValidationError as exc:
                errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
                response = problem(400, "validation_error", "the request is not valid", errors=errors[:20])
            response.headers.update(OPEN)
            return response

        return handler


# --------------------------------------------------------------------------------------------- models


class CreatePlaybackKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public_key: str | None = Field(None, max_length=16_384, description="a PEM public key of yours (EC P-256/P-384, "
                                   "RSA 2048+ or Ed25519); omitted: the api makes an ES256 pair and shows the private "
                                   "key once")


class PlaybackKeyShown(BaseModel):
    id: str = Field(description="the `kid` a playback token's header names")
    algorithm: Literal["ES256", "ES384", "RS256", "EdDSA"]
    fingerprint: str = Field(description="SHA256: and the base64 digest of the public key (DER)")
    public_key: str = Field(description="the public key (PEM)")
    created_at: datetime
    revoked_at: datetime | None


class PlaybackKeyCreated(PlaybackKeyShown):
    private_key: str | None = Field(None, description="the private key (PKCS#8 PEM) when the api made the pair: "
                                    "shown this once, never kept")


class PlaybackKeys(BaseModel):
    keys: list[PlaybackKeyShown]


def key_shown(key: playback.PlaybackKey) -> dict[str, Any]:
    return {"id": key.id, "algorithm": key.algorithm, "fingerprint": key.fingerprint,
            "public_key": key.public_key_pem, "created_at": key.created_at.isoformat(),
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None}


# --------------------------------------------------------------------------------------------- who asks


def _decision(request: Request) -> CheckDecision | None:
    decision: CheckDecision | None = request.scope.get("state", {}).get("auth")
    return decision


def owner_app(request: Request) -> str | None:
    """The app of an accepted secret key sent with the request (the guard's one auth.check), else None."""
    decision = _decision(request)
    identity = decision.identity if decision is not None else None
    if identity is None or identity.key_type != "secret":
        return None
    return identity.app_id


def client_address(request: Request) -> str:
    """The client address auth decided (trusted proxies and all, SPEC 3): the viewer claim is compared with it."""
    decision = _decision(request)
    if decision is not None:
        return decision.client_address
    return request.client.host if request.client else "unknown"


def _cache(grant: playback.Grant, max_age: int) -> str:
    return f"public, max-age={max_age}" if grant.kid == playback.GRANT_PUBLIC else NO_STORE


def _redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=302, headers={"Cache-Control": NO_STORE})


# --------------------------------------------------------------------------------------------- routes


def _rewritten(video_id: str, what: str, rewrite: Callable[[], str]) -> str:
    """A stored playlist or storyboard with its URIs signed; one naming a URI it should not (not a plain file name
    of its own directory) is answered 503 and logged: the file in storage is wrong, not the request."""
    try:
        return rewrite()
    except playback.UnsafeUri as exc:
        log.warning("%s: the stored %s names %s", video_id, what, exc)
        raise Problem(503, "unavailable", f"the stored {what} cannot be served", headers={"Retry-After": "5"}
                      ) from None


def playback_routes(videos: Videos, player: Player) -> APIRouter:
    r = APIRouter(tags=["playback"], responses=PLAYER_ERRORS, route_class=PlayerRoute)
    s = videos.settings

    async def grant_of(request: Request, video: store.Video, token: str | None, file: str,
                       exp: int | None, kid: str | None, sig: str | None) -> playback.Grant:
        """A signed file URL's own grant when it carries one, else the request's (public, owner or token)."""
        if sig is not None or exp is not None or kid is not None:
            if sig is None or exp is None or kid is None:
                raise Problem(403, str(playback.PlaybackCode.URL_INVALID), "a file URL needs exp, kid and sig")
            await player.check_file_url(video, file, exp, kid, sig)
            return playback.Grant(kid, exp)
        return await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                                  client_address=client_address(request))

    @r.get("/v1/playback/{video_id}/master.m3u8", response_class=Response, responses=PLAYLIST,
           **route_class("public"))
    async def master_playlist(request: Request, video_id: str, token: TokenParam = None) -> Response:
        """The HLS master playlist: every rendition with HLS, by bandwidth; while the video is processing, those done
        so far (it grows as each is added: not cached then). A signed video needs `?token=`; its media playlists are
        listed with URLs signed for the token's lifetime."""
        video = await videos.owned(video_id, None)
        grant = await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                                   client_address=client_address(request))
        entries = playback.playable(video.status, video.renditions)
        if not entries:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has nothing to play yet")
        listed = [(f"{h}/index.m3u8?{player.file_query(video.id, f'{h}/index.m3u8', grant)}", hls)
                  for h, hls in entries]
        tracks = [(t, f"captions/{t.language}.m3u8?v={t.version}&"
                      f"{player.file_query(video.id, f'captions/{t.language}.m3u8', grant)}")
                  for t in captions.tracks_of(video.captions)]
        # while processing a rendition may be added: players and caches ask again
        cache = _cache(grant, s.playback_public_max_age_seconds) if video.status is VideoStatus.READY else GROWING
        body = playback.master_playlist(listed, captions.media_lines(tracks), captions.GROUP)
        return Response(body, media_type=playback.PLAYLIST_TYPE, headers={"Cache-Control": cache})

    def track_of(video: store.Video, language: str) -> captions.Track:
        tag = captions.language_tag(language)
        track = next((t for t in captions.tracks_of(video.captions) if t.language == tag), None)
        if track is None:
            raise Problem(404, "not_found", "the video has no caption track of that language")
        return track

    @r.get("/v1/playback/{video_id}/{name}.mp4", status_code=302, response_class=RedirectResponse,
           responses=REDIRECT, **route_class("public"))
    async def mp4_file(request: Request, video_id: str, name: str, token: TokenParam = None,
                       download: Annotated[bool, Query(description="answered as a download (Content-Disposition: "
                                                       "attachment, named after the video)")] = False,
                       ) -> RedirectResponse:
        """A stable URL of an MP4 rendition: `highest`, `lowest` or a rendition's p (`720p`); a redirect to storage,
        whose URL lasts as long as the grant (a player reads its ranges from it for the whole viewing). Callers as
        the master playlist."""
        video = await videos.owned(video_id, None)
        grant = await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                                   client_address=client_address(request))
        picked = playback.mp4_pick(name, video.renditions) if video.status in playback.PLAYABLE else None
        if picked is None:
            raise Problem(404, "not_found", "no such MP4 of this video: highest, lowest or a stored rendition's p "
                          "(e.g. 720p)")
        ttl = max(s.playback_storage_url_ttl_seconds, grant.expires - int(time.time()))
        disposition = playback.attachment(video.name, int(picked["height"])) if download else None
        return _redirect(await videos.objects.get_url(str(picked["object_key"]), ttl, disposition=disposition))

    # before the renditions' routes, whose `{height}/{file}` would take these paths too
    @r.get("/v1/playback/{video_id}/captions/{language}.m3u8", response_class=Response, responses=PLAYLIST,
           **route_class("public"))
    async def subtitle_playlist(request: Request, video_id: str, language: str, token: TokenParam = None,
                                exp: ExpParam = None, kid: KidParam = None, sig: SigParam = None,
                                v: VersionParam = None) -> Response:
        """A caption track's media playlist (its WebVTT file as one segment), as the master playlist lists it."""
        video = await videos.owned(video_id, None)
        track = track_of(video, language)
        grant = await grant_of(request, video, token, f"captions/{track.language}.m3u8", exp, kid, sig)
        duration = playback.duration_of(video.renditions, artwork_of(video))
        if not playback.playable(video.status, video.renditions) or duration is None:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has nothing to play yet")
        file = f"captions/{track.language}.vtt"
        uri = f"{track.language}.vtt?v={track.version}&{player.file_query(video.id, file, grant)}"
        return Response(captions.subtitle_playlist(uri, duration), media_type=playback.PLAYLIST_TYPE,
                        headers={"Cache-Control": _cache(grant, s.playback_public_max_age_seconds)})

    @r.get("/v1/playback/{video_id}/captions/{language}.vtt", response_class=Response, responses=WEBVTT,
           **route_class("public"))
    async def caption_file(request: Request, video_id: str, language: str, token: TokenParam = None,
                           exp: ExpParam = None, kid: KidParam = None, sig: SigParam = None,
                           v: VersionParam = None) -> Response:
        """A caption track's WebVTT file. Callers: the app's secret key, anyone for a public video, a playback token
        (`?token=`) or the signed URL a subtitle playlist lists for a signed one."""
        video = await videos.owned(video_id, None)
        track = track_of(video, language)
        grant = await grant_of(request, video, token, f"captions/{track.language}.vtt", exp, kid, sig)
        return Response(await player.stored_text(track.key), media_type=playback.VTT_TYPE,
                        headers={"Cache-Control": _cache(grant, s.playback_public_max_age_seconds)})

    @r.get("/v1/playback/{video_id}/{height}/index.m3u8", response_class=Response, responses=PLAYLIST,
           **route_class("public"))
    async def media_playlist(request: Request, video_id: str, height: int, token: TokenParam = None,
                             exp: ExpParam = None, kid: KidParam = None, sig: SigParam = None) -> Response:
        """One rendition's media playlist, every segment URL signed (for the token's lifetime on a signed video)."""
        video = await videos.owned(video_id, None)
        file = f"{height}/index.m3u8"
        grant = await grant_of(request, video, token, file, exp, kid, sig)
        hls = dict(playback.playable(video.status, video.renditions)).get(height)
        if hls is None:
            raise Problem(404, "not_found", "no such rendition to play")
        text = await player.stored_text(hls.playlist_key)
        body = _rewritten(video.id, f"media playlist of {height}p", lambda: playback.rewrite_media_playlist(
            text, lambda name: f"{name}?{player.file_query(video.id, f'{height}/{name}', grant)}"))
        return Response(body, media_type=playback.PLAYLIST_TYPE,
                        headers={"Cache-Control": _cache(grant, s.playback_public_max_age_seconds)})

    @r.get("/v1/playback/{video_id}/{height}/{file}", status_code=302, response_class=RedirectResponse,
           responses=REDIRECT, **route_class("public"))
    async def media_file(video_id: str, height: int, file: str, exp: ExpParam = None, kid: KidParam = None,
                         sig: SigParam = None) -> RedirectResponse:
        """A segment or init file, by a URL a media playlist listed: a redirect to storage once its signature,
        expiry and grant (a revoked key's URLs stop) are checked."""
        if sig is None or exp is None or kid is None:
            raise Problem(403, str(playback.PlaybackCode.URL_INVALID), "a file URL needs exp, kid and sig")
        video = await videos.owned(video_id, None)
        await player.check_file_url(video, f"{height}/{file}", exp, kid, sig)
        hls = dict(playback.playable(video.status, video.renditions)).get(height)
        if hls is None or not playback.FILE_NAME.match(file):
            raise Problem(404, "not_found", "no such file")
        directory = hls.playlist_key.rsplit("/", 1)[0]
        return _redirect(await player.redirect_url(f"{directory}/{file}"))

    @r.get("/v1/videos/{video_id}/thumbnail.jpg", status_code=302, response_class=RedirectResponse,
           responses=REDIRECT, **route_class("public"))
    async def thumbnail(request: Request, video_id: str, token: TokenParam = None,
                        time: Annotated[float | None, Query(ge=0, allow_inf_nan=False,
                                                            description="seconds into the video")] = None,
                        width: Annotated[int | None, Query(ge=1, description="pixels; the height follows")] = None,
                        ) -> RedirectResponse:
        """The poster; with `time` and/or `width` a frame made on demand (then cached). Callers: the app's secret
        key, anyone for a public video, a playback token (`?token=`) for a signed one."""
        video = await videos.owned(video_id, None)
        await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                           client_address=client_address(request))
        artwork = artwork_of(video)
        if time is None and width is None and artwork is not None:
            return _redirect(await player.redirect_url(artwork.poster_key))
        source = playback.best_source(video.renditions) if video.status == "ready" else None
        if source is None:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has no rendition to take a frame of")
        hls = source.get("hls") or {}
        thumb = playback.thumbnail_request(
            video.id, time=time, width=width, duration=playback.duration_of(video.renditions, artwork),
            source_width=int(hls.get("width") or s.thumbnail_max_width), artwork=artwork,
            min_width=s.thumbnail_min_width, max_width=s.thumbnail_max_width, step=s.thumbnail_time_step_seconds)
        if isinstance(thumb, str):
            raise Problem(400, "validation_error", thumb)
        await player.thumbnail(str(source["object_key"]), thumb)
        return _redirect(await player.redirect_url(thumb.key))

    @r.get("/v1/videos/{video_id}/animated.gif", status_code=302, response_class=RedirectResponse,
           responses=REDIRECT, **route_class("public"))
    async def animated(request: Request, video_id: str, token: TokenParam = None,
                       start: Annotated[float | None, Query(ge=0, allow_inf_nan=False, description="seconds into the "
                                                            "video (default 0)")] = None,
                       end: Annotated[float | None, Query(ge=0, allow_inf_nan=False, description="seconds into the "
                                                          "video (default: start + 5)")] = None,
                       width: Annotated[int | None, Query(ge=1, description="pixels (default 320); the height "
                                                          "follows")] = None,
                       fps: Annotated[int | None, Query(ge=1, description="frames per second (default 10)")] = None,
                       ) -> RedirectResponse:
        """An animated GIF of a stretch of the video (a preview on hover, a social card), made on demand from the
        smallest MP4 wide enough, then cached. Callers as the thumbnail."""
        video = await videos.owned(video_id, None)
        await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                           client_address=client_address(request))
        widest = playback.best_source(video.renditions) if video.status == "ready" else None
        if widest is None:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has no rendition to animate yet")
        anim = playback.animation_request(
            video.id, start=start, end=end, width=width, fps=fps,
            duration=playback.duration_of(video.renditions, artwork_of(video)),
            source_width=int((widest.get("hls") or {}).get("width") or s.animation_max_width),
            limits=playback.AnimationLimits(
                default_seconds=s.animation_default_seconds, max_seconds=s.animation_max_seconds,
                default_width=s.animation_default_width, max_width=s.animation_max_width,
                default_fps=s.animation_default_fps, max_fps=s.animation_max_fps, step=s.thumbnail_time_step_seconds))
        if isinstance(anim, str):
            raise Problem(400, "validation_error", anim)
        source = playback.animation_source(video.renditions, anim.width)
        assert source is not None  # a best source exists
        await player.animation(str(source["object_key"]), anim)
        return _redirect(await player.redirect_url(anim.key))

    @r.get("/v1/videos/{video_id}/storyboard.vtt", response_class=Response, responses=WEBVTT,
           **route_class("public"))
    async def storyboard(request: Request, video_id: str, token: TokenParam = None) -> Response:
        """The storyboard: WebVTT cues of times, each pointing at a tile (`#xywh=`) of one sprite image by a signed
        URL. Callers as for the thumbnail."""
        video = await videos.owned(video_id, None)
        grant = await player.grant(video, owner=owner_app(request) == video.app_id, token=token,
                                   client_address=client_address(request))
        artwork = artwork_of(video)
        if artwork is None:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has no storyboard yet")
        sprite = (f"{str(request.base_url).rstrip('/')}/v1/videos/{video.id}/storyboard.jpg?"
                  f"{player.file_query(video.id, 'storyboard.jpg', grant)}")
        text = await player.stored_text(artwork.storyboard_key)
        body = _rewritten(video.id, "storyboard", lambda: playback.rewrite_storyboard(text, sprite))
        return Response(body, media_type=playback.VTT_TYPE,
                        headers={"Cache-Control": _cache(grant, s.playback_public_max_age_seconds)})

    @r.get("/v1/videos/{video_id}/storyboard.jpg", status_code=302, response_class=RedirectResponse,
           responses=REDIRECT, **route_class("public"))
    async def storyboard_sprite(request: Request, video_id: str, token: TokenParam = None, exp: ExpParam = None,
                                kid: KidParam = None, sig: SigParam = None) -> RedirectResponse:
        """The storyboard's sprite, by the signed URL its WebVTT lists (or as the thumbnail's callers)."""
        video = await videos.owned(video_id, None)
        await grant_of(request, video, token, "storyboard.jpg", exp, kid, sig)
        artwork = artwork_of(video)
        if artwork is None:
            raise Problem(409, str(playback.PlaybackCode.NOT_READY), "the video has no storyboard yet")
        return _redirect(await player.redirect_url(artwork.sprite_key))

    return r


def playback_key_routes(player: Player, app_id_of: Callable[[Request], str]) -> APIRouter:
    r = APIRouter(prefix="/v1/playback-keys", tags=["playback keys"], responses=PLAYER_ERRORS)

    @r.post("", status_code=201, response_model=PlaybackKeyCreated, **route_class("secret"))
    async def create_key(request: Request, body: CreatePlaybackKey) -> JSONResponse:
        """A playback signing key: the api makes an ES256 pair (the private key shown once, never kept), or keeps the
        public key you upload. Sign playback tokens with it, `kid` = its id."""
        private_pem = None
        try:
            if body.public_key is None:
                private_pem, public = playback.generate_key_pair()
            else:
                public = playback.read_public_key(body.public_key)
        except playback.KeyRefused as exc:
            raise Problem(400, "validation_error", str(exc)) from None
        async with player.pool.acquire() as conn:
            key = await store.create_playback_key(conn, app_id_of(request), public)
        return JSONResponse({**key_shown(key), "private_key": private_pem}, status_code=201)

    @r.get("", response_model=PlaybackKeys, **route_class("secret"))
    async def list_keys(request: Request) -> dict[str, Any]:
        """The app's playback keys, newest first, revoked ones too (public halves only)."""
        async with player.pool.acquire() as conn:
            keys = await store.playback_keys(conn, app_id_of(request))
        return {"keys": [key_shown(k) for k in keys]}

    @r.delete("/{key_id}", status_code=204, **route_class("secret"))
    async def revoke_key(request: Request, key_id: str) -> Response:
        """Revoke: its tokens, and the file URLs listed for them, stop on every api instance within a second."""
        async with player.pool.acquire() as conn:
            if not await store.revoke_playback_key(conn, app_id_of(request), key_id):
                raise Problem(404, "not_found", "no such playback key")
        return Response(status_code=204)

    return r
