"""A video's caption tracks (secret key): upload one per language (WebVTT, or SubRip turned into WebVTT), list,
show, delete. Players get them through the master playlist (services/api/playback_routes.py): each track is a
SUBTITLES rendition hls.js and Safari offer the viewer."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from services.api import captions, playback, store
from services.api.shown import Captions, CaptionShown
from services.api.videos import Videos, caption_shown
from shared import tracing
from shared.problems import Problem
from shared.routeclass import route_class
from shared.videos import GONE

log = logging.getLogger("weir.api.captions")
PROBLEM = {"model": dict[str, Any], "content": {"application/problem+json": {}}, "description": "problem (RFC 9457)"}
ERRORS: dict[int | str, dict[str, Any]] = {s: PROBLEM for s in (400, 401, 403, 404, 409, 413, 415, 429, 503)}
# the file is the request's body, as `curl --data-binary @en.vtt -H 'Content-Type: text/vtt'` sends it
CAPTION_BODY = {"required": True, "description": "the caption file: WebVTT (`text/vtt`) or SubRip (`application/"
                "x-subrip`, turned into WebVTT); UTF-8",
                "content": {t: {"schema": {"type": "string"}} for t in sorted(captions.MEDIA_TYPES)}}


def _language(raw: str) -> str:
    tag = captions.language_tag(raw)
    if tag is None:
        raise Problem(400, "validation_error", f"{raw[:40]!r} is not a BCP 47 language tag (e.g. en, pt-BR, es-419)")
    return tag


def caption_routes(videos: Videos, app_id_of: Callable[[Request], str]) -> APIRouter:
    r = APIRouter(prefix="/v1/videos/{video_id}/captions", tags=["captions"], responses=ERRORS)
    s = videos.settings

    def base(request: Request) -> str:
        return str(request.base_url)

    @r.put("/{language}", response_model=None,
           responses={200: {"model": CaptionShown, "description": "the track, its file replaced"},
                      201: {"model": CaptionShown, "description": "the track, added"}},
           openapi_extra={**route_class("secret", body_limit=s.captions_max_bytes)["openapi_extra"],
                          "requestBody": CAPTION_BODY})
    async def put_captions(
        request: Request, video_id: str, language: str,
        name: Annotated[str | None, Query(max_length=captions.NAME_MAX, description="what players show viewers; "
                                          "default: the language tag")] = None,
        closed_captions: Annotated[bool, Query(description="the track is for viewers who do not hear the sound "
                                               "(speech and the sounds)")] = False,
    ) -> JSONResponse:
        """Add the video's caption track of `language`, or replace its file (and name). Any video not retired or
        deleted takes tracks; they play with its HLS ladder."""
        tag = _language(language)
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type not in captions.MEDIA_TYPES:
            raise Problem(415, "unsupported_media_type", "send the caption file as the body, with Content-Type "
                          f"{' or '.join(sorted(captions.MEDIA_TYPES))}")
        shown_name = tag if name is None else name
        if (why := captions.name_problem(shown_name)) is not None:
            raise Problem(400, "validation_error", why)
        try:
            read = captions.read_captions(await request.body())
        except captions.CaptionsRefused as exc:
            raise Problem(400, "invalid_captions", str(exc)) from None
        tracing.tag_video(video_id)
        now = datetime.now(UTC).isoformat()
        async with videos.pool.acquire() as conn, conn.transaction():
            video = await videos.owned(video_id, app_id_of(request), conn=conn, lock=True)
            if video.status in GONE:
                raise Problem(409, "conflict", "the video was retired")
            track = captions.Track(tag, shown_name, closed_captions, captions.caption_key(video.id, tag, read.text),
                                   len(read.text.encode()), read.cues, now, now)
            outcome = captions.placed(video.captions, track, most=s.captions_max_tracks)
            if isinstance(outcome, str):
                raise Problem(409, "conflict", outcome)
            tracks, replaced = outcome
            # stored under the row lock, before the row names it: a delete of the video waits, then removes it
            await videos.objects.put(track.key, read.text.encode(), playback.VTT_TYPE)
            await store.set_captions(conn, video, tracks, language=tag, change="added" if replaced is None
                                     else "replaced", languages=[t.language for t in captions.tracks_of(tracks)])
        if replaced is not None and replaced.key != track.key:
            with contextlib.suppress(ClientError, BotoCoreError):  # left: removed with the video
                await videos.objects.delete(replaced.key)
        (kept,) = (t for t in captions.tracks_of(tracks) if t.language == tag)
        return JSONResponse(caption_shown(kept, video.id, base(request)), status_code=201 if replaced is None else 200)

    @r.get("", response_model=None, responses={200: {"model": Captions, "description": "the video's tracks"}},
           **route_class("secret"))
    async def list_captions(request: Request, video_id: str) -> dict[str, Any]:
        """The video's caption tracks, in the order they were first uploaded."""
        video = await videos.owned(video_id, app_id_of(request))
        return {"captions": [caption_shown(t, video.id, base(request)) for t in captions.tracks_of(video.captions)]}

    @r.get("/{language}", response_model=None, responses={200: {"model": CaptionShown, "description": "the track"}},
           **route_class("secret"))
    async def get_captions(request: Request, video_id: str, language: str) -> dict[str, Any]:
        """One track; its file is at its `url`."""
        tag = _language(language)
        video = await videos.owned(video_id, app_id_of(request))
        track = next((t for t in captions.tracks_of(video.captions) if t.language == tag), None)
        if track is None:
            raise Problem(404, "not_found", f"the video has no {tag} caption track")
        return caption_shown(track, video.id, base(request))

    @r.delete("/{language}", status_code=204, **route_class("secret"))
    async def delete_captions(request: Request, video_id: str, language: str) -> Response:
        """Remove the track: players stop offering it from their next master playlist."""
        tag = _language(language)
        tracing.tag_video(video_id)
        async with videos.pool.acquire() as conn, conn.transaction():
            video = await videos.owned(video_id, app_id_of(request), conn=conn, lock=True)
            outcome = captions.removed(video.captions, tag)
            if outcome is None:
                raise Problem(404, "not_found", f"the video has no {tag} caption track")
            tracks, gone = outcome
            await store.set_captions(conn, video, tracks, language=tag, change="deleted",
                                     languages=[t.language for t in captions.tracks_of(tracks)])
        with contextlib.suppress(ClientError, BotoCoreError):  # left: removed with the video
            await videos.objects.delete(gone.key)
        return Response(status_code=204)

    return r
