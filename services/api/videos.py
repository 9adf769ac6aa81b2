"""What the video and upload routes do: the row lock, storage, the outbox, in the order SPEC section 4 gives."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import asyncpg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from services.api import captions, domain, playback, store
from services.api.objects import Objects, PartsRefused
from services.api.settings import ApiSettings
from shared import db, natsconn
from shared.bus import VERSION_HEADER
from shared.media import content, probe
from shared.media.playback import Artwork, video_prefix
from shared.media.protocol import (
    STATUS_SUBJECT,
    STATUS_V2_SUBJECT,
    ProcessingStatus,
    ProcessingStatuses,
    StatusesRequest,
    StatusRequest,
)
from shared.messaging import UnreadableReply, error_in, read_reply
from shared.problems import Problem
from shared.ssrf import InvalidEndpointUrl, parse_endpoint_url
from shared.videos import GONE, ImportState, ProcessingState, VideoStatus

log = logging.getLogger("weir.api")

ENCODE_STATUS_TIMEOUT_S = 0.25  # a GET waits this long for encode's answer, then shows the projection
ASK_ENCODE = frozenset({VideoStatus.UPLOADED, VideoStatus.PROCESSING})
UNSUPPORTED_MESSAGE = "the file is not a video container Weir reads (MP4/MOV, Matroska/WebM, AVI, MPEG-TS)"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class StatusesNotServed(Exception):
    """No encode answers encode.status.v2: every one runs release 1.0.0, which serves only v1."""


async def encode_statuses(nc: NATS | None, videos: Sequence[store.Video], most: int) -> dict[str, ProcessingStatus]:
    """Encode's processing state of each video being processed among `videos`, by id (asking also applies the
    stuck-restart rule): one encode.status.v2 request per `most` of them. A video encode did not answer for (in time,
    or at all) is missing, and the caller shows its own projection of encode's events for it.

    Raises StatusesNotServed when no encode serves v2 (NATS answers "no responders" at once), or when the bus does not
    let the api ask it (a server configured by release 1.0.0): the caller decides what an old encode is asked."""
    asked = [v.id for v in videos if v.status in ASK_ENCODE]
    if nc is None or not asked:
        return {}
    pages = [asked[i:i + most] for i in range(0, len(asked), most)]
    answers = await asyncio.gather(*(_ask_statuses(nc, page) for page in pages), return_exceptions=True)
    shown: dict[str, ProcessingStatus] = {}
    for page, answer in zip(pages, answers, strict=True):
        if isinstance(answer, BaseException):
            raise answer
        if answer is not None:
            shown.update(read_statuses(answer.data, page, answer.headers))
    return shown


async def _ask_statuses(nc: NATS, video_ids: list[str]) -> Msg | None:
    """One encode.status.v2 request: the reply, or None when encode does not answer in time (sent once more, within
    the same time, when the connection it went out on drops: a read may be answered twice)."""
    request = StatusesRequest(video_ids=video_ids).model_dump_json().encode()
    try:
        reply = await natsconn.request(None, nc, STATUS_V2_SUBJECT, request, timeout=ENCODE_STATUS_TIMEOUT_S,
                                       headers=dict(VERSION_HEADER), resend_if_lost=True)
    except (NoRespondersError, natsconn.PermissionRefused):
        raise StatusesNotServed from None
    except (NatsError, TimeoutError):
        return None
    return reply


def read_statuses(data: bytes, asked: Sequence[str],
                  headers: Mapping[str, str] | None = None) -> dict[str, ProcessingStatus]:
    """An encode.status.v2 reply, read tolerantly: the videos encode knows among those asked, by id. A refusal or a
    reply this release cannot read (one log line, naming both releases: `headers` are the reply's) shows the
    projection of every video asked: empty."""
    refusal = error_in(data)
    if refusal is not None:
        log.warning("%s: refused for %d videos, showing the projection: %s %s", STATUS_V2_SUBJECT, len(asked),
                    refusal.error.code, refusal.error.detail[:300])
        return {}
    try:
        reply = read_reply(ProcessingStatuses, data, STATUS_V2_SUBJECT, headers,
                           outcome=f"showing the projection of {len(asked)} videos")
    except UnreadableReply:
        return {}
    wanted = set(asked)
    return {s.video_id: s for s in reply.videos if s.found and s.video_id in wanted}


async def encode_status(nc: NATS | None, video: store.Video) -> ProcessingStatus | None:
    """Encode's processing state of a video being processed (asking it also applies the stuck-restart rule);
    None when encode does not answer in time, so the caller shows its own projection of encode's events."""
    if nc is None or video.status not in ASK_ENCODE:
        return None
    try:
        return (await encode_statuses(nc, [video], 1)).get(video.id)
    except StatusesNotServed:  # an encode of release 1.0.0 answers only v1: asked below, as that release's api did
        pass
    request = StatusRequest(video_id=video.id).model_dump_json().encode()
    try:
        reply = await natsconn.request(None, nc, STATUS_SUBJECT, request, timeout=ENCODE_STATUS_TIMEOUT_S,
                                       headers=dict(VERSION_HEADER), resend_if_lost=True)
    except (NatsError, TimeoutError, natsconn.PermissionRefused):
        return None
    try:  # a refusal, or a reply this release cannot read (one log line, both releases): the projection is shown
        status = read_reply(ProcessingStatus, reply.data, STATUS_SUBJECT, reply.headers,
                            outcome=f"showing the projection of {video.id}")
    except UnreadableReply:
        return None
    return status if status.found else None


def artwork_of(video: store.Video) -> Artwork | None:
    """The video's poster and storyboard, when made (what this release cannot read is not shown)."""
    try:
        return Artwork.model_validate(video.artwork) if video.artwork else None
    except ValueError:
        return None


def playback_of(video: store.Video, base_url: str) -> dict[str, Any]:
    """The `playback` member of a video as the api shows it (SPEC 14)."""
    artwork = artwork_of(video)
    ready = video.status == VideoStatus.READY
    return playback.playback_shown(
        video.playback_policy, base_url, video.id, hls=bool(playback.playable(video.status, video.renditions)),
        thumbnail=artwork is not None or (ready and playback.best_source(video.renditions) is not None),
        storyboard=artwork is not None,
        mp4=video.status in playback.PLAYABLE and playback.mp4_pick("highest", video.renditions) is not None)


def caption_url(base_url: str, video_id: str, language: str) -> str:
    return f"{base_url.rstrip('/')}/v1/playback/{quote(video_id, safe='')}/captions/{language}.vtt"


def caption_shown(track: captions.Track, video_id: str, base_url: str) -> dict[str, Any]:
    return {"language": track.language, "name": track.name, "closed_captions": track.closed_captions,
            "size": track.size, "cues": track.cues, "created_at": track.created_at, "updated_at": track.updated_at,
            "url": caption_url(base_url, video_id, track.language)}


IMPORT_REFUSED = {
    domain.ImportRefusal.GONE: "the video was retired or deleted",
    domain.ImportRefusal.HAS_FILE: "the video already has its file, or failed: create another video",
    domain.ImportRefusal.UPLOADING: "the video has an open upload: complete or abort it first",
    domain.ImportRefusal.IMPORTING: "the video's file is being imported from another URL",
}


def importing(video: store.Video) -> None:
    """The upload routes refuse a video whose file is being imported (409): one writer of its object at a time."""
    job = video.import_job
    if domain.upload_blocked_by_import(job.state if job is not None else None):
        raise Problem(409, "conflict", "the video's file is being imported from a URL (see `import`)")


def import_shown(job: store.ImportJob | None) -> dict[str, Any] | None:
    """`import` of a video: its import from a URL, null when it has none."""
    if job is None:
        return None
    return {"url": domain.shown_import_url(job.url), "state": str(job.state), "attempts": job.attempts,
            "bytes": job.bytes, "error": job.error,
            "next_attempt_at": _iso(job.next_at) if job.state is ImportState.QUEUED else None,
            "started_at": _iso(job.started_at), "finished_at": _iso(job.finished_at)}


def not_found() -> Problem:
    return Problem(404, "not_found", "no such video")


def conflict(refusal: domain.UploadRefusal) -> Problem:
    detail = {
        domain.UploadRefusal.GONE: "the video was retired or deleted",
        domain.UploadRefusal.HAS_FILE: "the video already has its file",
        domain.UploadRefusal.NOT_OPEN: "the video has no open upload; initiate one first",
    }[refusal]
    return Problem(409, "conflict", detail)


@dataclass
class Videos:
    pool: asyncpg.Pool
    objects: Objects
    settings: ApiSettings

    async def owned(self, video_id: str, app_id: str | None, *, conn: asyncpg.Connection | None = None,
                    lock: bool = False, deleted: bool = False) -> store.Video:
        """The video if it belongs to the app (any app for internal lookups); 404 otherwise, never a hint.

        A deleted video is not found, except with `deleted=True`: the upload routes answer it 409 (SPEC 4)."""
        async with self._conn(conn) as c:
            video = await store.get(c, video_id, lock=lock)
        if video is None or (app_id is not None and video.app_id != app_id):
            raise not_found()
        if video.status == VideoStatus.DELETED and not deleted:
            raise not_found()
        return video

    @contextlib.asynccontextmanager
    async def _conn(self, conn: asyncpg.Connection | None) -> AsyncIterator[asyncpg.Connection]:
        if conn is not None:
            yield conn
            return
        async with self.pool.acquire() as c:
            yield c

    # ------------------------------------------------------------------------------------- uploads

    async def initiate(self, video_id: str, app_id: str, content_type: str, *, by_import: bool = False
                       ) -> dict[str, Any]:
        async with self.pool.acquire() as conn, conn.transaction():
            # the storage upload is opened under the row lock and recorded in the same transaction: a sweep that
            # holds the lock first retires the video before any upload exists; one that comes after sees the upload
            video = await self.owned(video_id, app_id, conn=conn, lock=True, deleted=True)
            refusal = domain.initiate_refusal(video.status, video.file_recorded_at is not None)
            if refusal is not None:
                raise conflict(refusal)
            if not by_import:
                importing(video)
            upload_id = video.upload_id
            if upload_id is None:
                upload_id = await self.objects.open_upload(video.object_key, content_type)
                await store.record_upload(conn, video.id, upload_id)
        return {"upload_id": upload_id, "part_size_min": domain.PART_SIZE_MIN,
                "part_number_max": domain.PART_NUMBER_MAX}

    async def part_urls(self, video_id: str, app_id: str, part_numbers: list[int]) -> dict[str, Any]:
        video = await self.owned(video_id, app_id, deleted=True)
        refusal = domain.upload_refusal(video.status, video.upload_id)
        if refusal is not None:
            raise conflict(refusal)
        importing(video)
        assert video.upload_id is not None
        # signing needs no storage, but URLs for an upload storage no longer holds, or cannot speak of, would only
        # fail when used: storage is asked first (not open: 409; not answering: 503, the route's error handler)
        if not await self.objects.upload_is_open(video.object_key, video.upload_id):
            raise conflict(domain.UploadRefusal.NOT_OPEN)
        ttl = self.settings.part_url_ttl_seconds
        expires = (datetime.now(UTC) + timedelta(seconds=ttl)).isoformat()
        parts = [
            {"part_number": n, "url": await self.objects.part_url(video.object_key, video.upload_id, n, ttl),
             "expires_at": expires}
            for n in sorted(set(part_numbers))
        ]
        return {"parts": parts}

    async def stored_parts(self, video_id: str, app_id: str) -> dict[str, Any]:
        """The parts storage holds of the video's open upload, to resume it."""
        video = await self.owned(video_id, app_id, deleted=True)
        refusal = domain.upload_refusal(video.status, video.upload_id)
        if refusal is None and video.file_recorded_at is not None:
            refusal = domain.UploadRefusal.HAS_FILE
        if refusal is not None:
            raise conflict(refusal)
        importing(video)
        assert video.upload_id is not None
        parts = await self.objects.list_parts(video.object_key, video.upload_id)
        if parts is None:  # completed or aborted in storage meanwhile
            raise conflict(domain.UploadRefusal.NOT_OPEN)
        return {"parts": [{"part_number": p.part_number, "etag": p.etag, "size": p.size} for p in parts]}

    async def complete(self, video_id: str, app_id: str, parts: list[tuple[int, str]], *, key_id: str,
                       by_import: bool = False) -> store.Video:
        if not by_import:
            importing(await self.owned(video_id, app_id, deleted=True))
        async with db.session(self.pool) as conn:
            # one completion of a video at a time; a second one waits here, then finds the first one's result
            await conn.execute("SELECT pg_advisory_lock(hashtext($1))", f"complete:{video_id}")
            try:
                return await self._complete(conn, video_id, app_id, parts, key_id)
            finally:
                await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", f"complete:{video_id}")

    async def _complete(
        self, conn: asyncpg.Connection, video_id: str, app_id: str, parts: list[tuple[int, str]], key_id: str
    ) -> store.Video:
        video = await self.owned(video_id, app_id, conn=conn, deleted=True)
        if video.status == VideoStatus.DELETED:
            raise conflict(domain.UploadRefusal.GONE)
        if video.file_recorded_at is not None:
            return video  # completing twice returns the first result and publishes nothing new
        if video.failure_reason == "unsupported_file" and video.upload_id is None:
            raise Problem(422, "unsupported_file", UNSUPPORTED_MESSAGE)  # so was the first result
        refusal = domain.upload_refusal(video.status, video.upload_id)
        if refusal is not None:
            raise conflict(refusal)
        assert video.upload_id is not None
        async with conn.transaction():
            locked = await self.owned(video_id, app_id, conn=conn, lock=True, deleted=True)
            if locked.upload_id != video.upload_id or locked.status in GONE:
                raise conflict(domain.UploadRefusal.GONE if locked.status in GONE
                               else domain.UploadRefusal.NOT_OPEN)
            # the claim is committed before assembling, so a sweep sees that a completion is under way
            await store.claim_completion(conn, video.id)
        # assemble only an upload that is still open: storage's own answer to a completed one cannot be trusted
        if await self.objects.upload_is_open(video.object_key, video.upload_id):
            stored = await self.objects.list_parts(video.object_key, video.upload_id) or []
            unlisted = domain.unlisted_parts((p.part_number for p in stored), (n for n, _ in parts))
            try:
                if unlisted:  # storage would assemble what is listed and drop the rest: the file would be cut
                    raise PartsRefused(
                        f"parts {', '.join(map(str, unlisted[:10]))}{' ...' if len(unlisted) > 10 else ''} are stored"
                        " but not listed: list every stored part (GET .../upload/parts lists them), or abort the"
                        " upload and start again")
                await self.objects.complete(video.object_key, video.upload_id, parts)
            except PartsRefused as refused:
                async with conn.transaction():  # nothing is being assembled: the sweep need not wait for it
                    await store.release_claim(conn, video.id)
                raise Problem(400, "validation_error", str(refused)) from None
        elif await self.objects.head(video.object_key) is None:
            async with conn.transaction():
                await store.clear_upload(conn, video.id)
            raise conflict(domain.UploadRefusal.NOT_OPEN)
        # else: a completion that died after assembling; the file is there, record it now
        head = await self.objects.head(video.object_key)
        if head is None:
            raise Problem(503, "unavailable", "storage did not show the assembled file; retry",
                          headers={"Retry-After": "1"})
        size, content_type = head
        sniffed = await self._sniff(video.object_key, size)
        if sniffed.container is None:
            await self.objects.delete(video.object_key)
            async with conn.transaction():
                await store.mark_failed(conn, video, "unsupported_file", UNSUPPORTED_MESSAGE)
            raise Problem(422, "unsupported_file", UNSUPPORTED_MESSAGE)
        # the height, when ffmpeg can read it cheaply (through any ID3 tags); none is no refusal: encode decides
        info = await probe.probe(await self.objects.get_url(video.object_key, 300),
                                 skip=sniffed.id3_bytes_skipped, container=sniffed.container)
        height, width = (info.display_height, info.display_width) if info is not None else (None, None)
        async with conn.transaction():
            current = await store.get(conn, video.id, lock=True)
            if current is None or current.status in GONE:
                raise conflict(domain.UploadRefusal.GONE)
            return await store.record_file(conn, current, size=size, content_type=content_type, source_height=height,
                                           key_id=key_id, source_width=width)

    async def _sniff(self, key: str, size: int) -> content.SniffResult:
        async def read(offset: int, length: int) -> bytes:
            return await self.objects.read_range(key, offset, length)

        # past any ID3v2 tags (ranged reads beyond long ones), then the container's magic
        return await content.sniff_object(read, size=size)

    async def abort(self, video_id: str, app_id: str) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            video = await self.owned(video_id, app_id, conn=conn, lock=True, deleted=True)
            if video.status in GONE:
                raise conflict(domain.UploadRefusal.GONE)
            importing(video)
            if video.upload_id is not None:
                await self.objects.abort(video.object_key, video.upload_id)
                await store.clear_upload(conn, video.id)

    async def delete(self, video_id: str, app_id: str) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            video = await self.owned(video_id, app_id, conn=conn, lock=True)
            if video.upload_id is not None:
                await self.objects.abort(video.object_key, video.upload_id)
            keys = [video.object_key] + [r["object_key"] for r in video.renditions if r.get("object_key")]
            await self.objects.delete(*keys)
            # and everything else made of it: HLS files, artwork, the thumbnails made here on demand
            await self.objects.delete_prefix(video_prefix(video.id))
            await store.mark_deleted(conn, video)
            await store.cancel_import(conn, video.id)

    # ------------------------------------------------------------------------------------- imports

    def check_import_url(self, url: str) -> None:
        """400 `invalid_url` for a URL no import would read (an IP literal judged now; a name when it is resolved)."""
        try:
            parse_endpoint_url(url, allow_private=self.settings.import_allow_private, https_only=False)
        except InvalidEndpointUrl as exc:
            raise Problem(400, "invalid_url", f"the URL is refused ({exc.reason}): {exc}") from None

    async def start_import(self, video_id: str, app_id: str, url: str) -> store.Video:
        """The video's file to be read from `url` (services/api/imports.py does it): the URL checked as a webhook
        endpoint's is (http too), the import queued under the row lock. The same URL asked again while its import
        runs answers the video as it is (a retry after a lost answer); anything else in the way is 409."""
        self.check_import_url(url)
        async with self.pool.acquire() as conn, conn.transaction():
            video = await self.owned(video_id, app_id, conn=conn, lock=True, deleted=True)
            job = video.import_job
            state = job.state if job is not None else None
            refusal = domain.import_refusal(video.status, video.file_recorded_at is not None, video.upload_id, state)
            if refusal is domain.ImportRefusal.IMPORTING and job is not None and job.url == url:
                return video
            if refusal is not None:
                raise Problem(409, "conflict", IMPORT_REFUSED[refusal])
            return await store.start_import(conn, video.id, url)

    # ------------------------------------------------------------------------------------- showing

    async def shape(self, video: store.Video, live: ProcessingStatus | None = None, *, base_url: str,
                    browser: bool = False) -> dict[str, Any]:
        """The video as the API shows it; `live` is encode's own processing state, when it answered; `base_url` the
        request's, which playback's absolute URLs start with. `browser`: shown to an SDK credential (a page's), which
        gets a signed video's MP4 URLs no more than its playlists: those play only with a playback token."""
        ttl = self.settings.part_url_ttl_seconds
        hidden = browser and video.playback_policy == playback.PlaybackPolicy.SIGNED
        renditions = [] if hidden else [
            {"height": r["height"], "url": await self.objects.get_url(r["object_key"], ttl), "size": r.get("size")}
            for r in video.renditions if r.get("object_key")
        ]
        failure = None
        if video.failure_reason:
            failure = {"reason": video.failure_reason, "message": video.failure_message or ""}
        file = None
        if video.file_recorded_at is not None:
            file = {"size": video.file_size, "content_type": video.file_content_type}
        status, processing = str(video.status), domain.shown_processing(video.processing)
        if live is not None:
            processing = {
                "deadline_at": _iso(live.deadline_at), "busy_at": _iso(live.busy_at),
                "outputs": [{"height": o.height, "state": o.state, "worker": o.worker, "started_at": _iso(o.started_at)}
                            for o in live.outputs],
            }
            if video.status == VideoStatus.UPLOADED and live.status is ProcessingState.PROCESSING:
                status = str(VideoStatus.PROCESSING)  # waiting for the farm is processing too
        return {
            "id": video.id,
            "status": status,
            "name": video.name,
            "metadata": video.metadata,
            "created_at": video.created_at.isoformat(),
            "file": file,
            "renditions": renditions,
            "processing": processing,
            "failure": failure,
            "playback": playback_of(video, base_url),
            "captions": [caption_shown(t, video.id, base_url) for t in captions.tracks_of(video.captions)],
            "import": import_shown(video.import_job),
        }
