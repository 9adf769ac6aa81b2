"""The public HTTP routes of SPEC section 4. Identity comes from the guard's one `auth.check`."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import asyncpg
from botocore.exceptions import BotoCoreError, ClientError
from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from nats.errors import Error as NatsError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api import domain, store
from services.api.objects import StorageUnavailable
from services.api.playback import PlaybackPolicy
from services.api.shown import VideoCreatedShown, VideoPage, VideoShown, video_answer
from services.api.videos import StatusesNotServed, Videos, encode_status, encode_statuses
from shared import db, tracing
from shared.authcheck import (
    AppCreated,
    CheckDecision,
    CreateApp,
    KeyList,
    KeyPair,
    ListKeys,
    MintUploadToken,
    RevokeKey,
    RotateKeys,
    UploadToken,
)
from shared.authclient import manage, manage_raw
from shared.messaging import RequestRefused, UnreadableReply
from shared.natsconn import PermissionRefused
from shared.problems import Problem, problem
from shared.routeclass import RouteClass, route_class
from shared.videos import GONE

log = logging.getLogger("weir.api")
PROBLEM = {"model": dict[str, Any], "content": {"application/problem+json": {}}, "description": "problem (RFC 9457)"}
ERRORS: dict[int | str, dict[str, Any]] = {
    s: PROBLEM for s in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}


# the video as `Videos.shape` writes it, documented without a response_model (which would filter what is served).
# Release 1.0.0's document called these answers "any object", so typing them is a finding of the contracts check
# against it (a new client reading that server), accepted on purpose in contracts/accepted.toml: that release wrote
# the same members (all but `playback`), which the mixed-version test verifies against this document
VIDEO = video_answer(200, VideoShown, "the video")
CREATED = video_answer(201, VideoCreatedShown, "the video, with an upload token for its upload")
PAGE = video_answer(200, VideoPage, "a page of the app's live videos, newest first")


# the playback policy at create is a query parameter, not a body field: release 1.0.0's api refuses a body member it
# does not know (400), which would break new clients behind a mixed deployment; a new client checks the answer's
# `playback.policy` (a 1.0.0 api shows none), as the JS SDK does
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", max_length=domain.IDEMPOTENCY_KEY_MAX,
    description="a key of your own for this create (a UUID): sent again with the same request within "
                "WEIR_IDEMPOTENCY_KEY_TTL_SECONDS (a day), it answers the video the first made instead of a second "
                "one; with another request, 422 `idempotency_key_reused`. The app's keys: its secret and publishable "
                "keys share them")]
REPLAYED = "Idempotent-Replayed"  # on an answer a key replayed

PolicyParam = Annotated[PlaybackPolicy, Query(description="`public` (default): anyone with the URLs plays it; "
                                                          "`signed`: only with a playback token")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def small_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    problem = domain.storable_text_problem(value)
    if problem:
        raise ValueError(problem)
    if domain.metadata_too_large(value):
        raise ValueError(f"metadata is at most {domain.METADATA_MAX_BYTES} bytes of JSON")
    return value


class CreateVideo(Strict):
    name: str = Field(min_length=1, max_length=500)
    metadata: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def storable_name(cls, value: str) -> str:
        problem = domain.storable_text_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("metadata")
    @classmethod
    def small_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return small_metadata(value)


class UpdateVideo(Strict):
    """PATCH: the fields given change; the others stay."""

    name: str | None = Field(None, min_length=1, max_length=500)
    metadata: dict[str, Any] | None = None
    playback_policy: PlaybackPolicy | None = None

    @field_validator("name")
    @classmethod
    def storable_name(cls, value: str | None) -> str | None:
        problem = domain.storable_text_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("metadata")
    @classmethod
    def small_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return small_metadata(value)


class ImportVideo(Strict):
    url: str = Field(min_length=1, max_length=8192, description="an http or https URL of the file (a presigned URL "
                     "of another storage will do); redirects are followed, each URL judged by the same rules")


class InitiateUpload(Strict):
    content_type: str = Field(min_length=1, max_length=200, pattern=r"^[\w.+-]+/[\w.+-]+$")
    size: int | None = Field(None, ge=0, description="the file's size in bytes, if known; larger than storage's "
                             "largest object (5 TiB) is refused (400)")

    @field_validator("size")
    @classmethod
    def storable_size(cls, value: int | None) -> int | None:
        # checked here, not as the schema's maximum: release 1.0.0's document set none, and a client of it that
        # sent more could never have completed such an upload anyway (its answer, 400, comes sooner now)
        if value is not None and value > domain.OBJECT_SIZE_MAX:
            raise ValueError(f"storage holds no file larger than {domain.OBJECT_SIZE_MAX} bytes (5 TiB)")
        return value


PartNumber = Annotated[int, Field(ge=1, le=domain.PART_NUMBER_MAX, strict=True)]


class PartUrlsRequest(Strict):
    part_numbers: list[PartNumber] = Field(min_length=1, max_length=domain.PART_NUMBER_MAX)


class CompletedPart(Strict):
    part_number: PartNumber
    etag: str = Field(min_length=1, max_length=200)


# the bodies of these two routes are held to more than the guard's default: 10,000 part numbers, and 10,000 parts
# with their ETags, fit in them
PART_URLS_BODY_LIMIT = 256 * 1024
COMPLETE_BODY_LIMIT = 2 * 1024 * 1024


class CompleteUpload(Strict):
    parts: list[CompletedPart] = Field(min_length=1, max_length=domain.PART_NUMBER_MAX)

    @field_validator("parts")
    @classmethod
    def distinct(cls, parts: list[CompletedPart]) -> list[CompletedPart]:
        if len({p.part_number for p in parts}) != len(parts):
            raise ValueError("each part number at most once")
        return parts


class StoredPart(BaseModel):
    part_number: int
    etag: str = Field(description="the part's ETag as storage gives it (quoted), for complete")
    size: int


class StoredParts(BaseModel):
    parts: list[StoredPart] = Field(description="the parts already stored, by part number")


ORIGIN_PATTERN = r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?$"


class CreateAppBody(Strict):
    name: str = Field(min_length=1, max_length=200)
    # an origin as browsers send it: scheme, ASCII host (IDNs in punycode) or [IPv6], optional port
    allowed_origins: list[Annotated[str, Field(min_length=1, max_length=300, pattern=ORIGIN_PATTERN)]] = Field(
        default_factory=list, max_length=50
    )

    @field_validator("name")
    @classmethod
    def storable_name(cls, value: str) -> str:
        problem = domain.storable_text_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def base(request: Request) -> str:
    """The request's base URL, which the absolute URLs the api shows start with."""
    return str(request.base_url)


def auth_of(request: Request) -> CheckDecision:
    reply: CheckDecision = request.scope["state"]["auth"]
    return reply


def app_id_of(request: Request) -> str:
    identity = auth_of(request).identity
    if identity is None or identity.app_id is None:
        raise Problem(401, "invalid_credential", "no app behind this credential")
    return identity.app_id


def key_id_of(request: Request) -> str:
    """The key behind the request: a secret or publishable key's own id, or the key that minted an upload token."""
    identity = auth_of(request).identity
    if identity is None or identity.key_id is None:
        raise Problem(401, "invalid_credential", "no key behind this credential")
    return identity.key_id


async def _storage_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: storage did not answer as expected: %r", request.method, request.url.path, exc)
    detail = "storage did not answer as expected; retry shortly"
    return problem(503, "unavailable", detail, headers={"Retry-After": "1"})


# the database away (shared/db.py), and any other socket error on the way to a dependency: 503, not 500
DATABASE_AWAY: tuple[type[Exception], ...] = (OSError, *db.DATABASE_AWAY)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: the database did not answer: %r", request.method, request.url.path, exc)
    return problem(503, "unavailable", "the database did not answer; retry shortly", headers={"Retry-After": "1"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def on_problem(request: Request, exc: Problem) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        return problem(400, "validation_error", "the request is not valid", errors=errors[:20])

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 400: "validation_error", 413: "payload_too_large"}
        return problem(exc.status_code, codes.get(exc.status_code, "validation_error"), str(exc.detail),
                       headers=dict(exc.headers or {}))  # a 405's Allow

    @app.exception_handler(RequestRefused)
    async def on_refused_request(request: Request, exc: RequestRefused) -> JSONResponse:  # auth's, webhooks' refusals
        return problem(exc.error.status, exc.error.code, exc.error.detail)

    @app.exception_handler(UnreadableReply)
    async def on_unreadable(request: Request, exc: UnreadableReply) -> JSONResponse:
        # logged where it was read (shared/messaging.read_reply): a peer of another release broke its contract
        return problem(503, "unavailable", "a dependency answered what this release cannot read; retry later",
                       headers={"Retry-After": "5"})

    @app.exception_handler(PermissionRefused)
    async def on_refused(request: Request, exc: PermissionRefused) -> JSONResponse:
        # the bus refused the api a subject it needs: a deployment's mistake, logged by the connection's watch
        return problem(503, "unavailable", "a dependency cannot be asked; retry later", headers={"Retry-After": "5"})

    @app.exception_handler(TimeoutError)
    async def on_timeout(request: Request, exc: TimeoutError) -> JSONResponse:
        return problem(503, "unavailable", "a dependency did not answer in time", headers={"Retry-After": "1"})

    @app.exception_handler(NatsError)
    async def on_bus(request: Request, exc: NatsError) -> JSONResponse:
        # no responders (auth died after the guard's check and is starting again), or no connection to ask on
        return problem(503, "unavailable", "a dependency cannot be asked; retry shortly", headers={"Retry-After": "1"})

    # storage that fails or cannot say is a dependency that cannot answer: 503, and nothing was changed on a guess
    for storage_error in (StorageUnavailable, BotoCoreError, ClientError):
        app.add_exception_handler(storage_error, _storage_unavailable)
    for database_error in DATABASE_AWAY:
        app.add_exception_handler(database_error, _database_unavailable)


LIST_PARAMS = frozenset({"limit", "cursor", "status"})  # GET /v1/videos's query parameters


def video_routes(videos: Videos, nc_of: Any) -> APIRouter:
    r = APIRouter(responses=ERRORS)

    async def mint(video: store.Video, request: Request) -> UploadToken:
        # the token names the key of the request that asked for it, not the video's creator: after a rotation
        # the new key mints working tokens for older videos
        return await manage(nc_of(), "token.mint",
                            MintUploadToken(video_id=video.id, app_id=video.app_id, key_id=key_id_of(request)),
                            UploadToken)

    async def create(request: Request, body: CreateVideo, policy: PlaybackPolicy, key: str | None) -> JSONResponse:
        identity = auth_of(request).identity
        assert identity is not None and identity.app_id and identity.account_id and identity.key_id
        app_id, account_id, key_id, replayed = identity.app_id, identity.account_id, identity.key_id, False

        async def made(conn: asyncpg.Connection) -> store.Video:
            return await store.create(conn, app_id=app_id, account_id=account_id, key_id=key_id, name=body.name,
                                      metadata=body.metadata, playback_policy=policy)

        async with videos.pool.acquire() as conn:
            if key is None:
                video = await made(conn)
            else:
                if (why := domain.idempotency_key_problem(key)) is not None:
                    raise Problem(400, "validation_error", why)
                fingerprint = domain.request_fingerprint(
                    {"name": body.name, "metadata": body.metadata, "playback_policy": str(policy)})
                async with conn.transaction():
                    held = await store.claim_idempotency_key(conn, app_id, key, fingerprint,
                                                             videos.settings.idempotency_key_ttl_seconds)
                    if held is None:
                        video = await made(conn)
                        await store.record_idempotent_video(conn, app_id, key, video.id)
                if held is not None:
                    if held["fingerprint"] != fingerprint:
                        raise Problem(422, "idempotency_key_reused", "this Idempotency-Key was sent with another "
                                      "request: a key names one request (send a new key for a new video)")
                    again = await store.get(conn, held["video_id"])
                    if again is None or again.status in GONE:
                        raise Problem(409, "conflict", f"the video this Idempotency-Key created ({held['video_id']})"
                                      " was deleted or retired")
                    video, replayed = again, True
        tracing.tag_video(video.id)
        token = await mint(video, request)
        shown = await videos.shape(video, base_url=base(request))
        return JSONResponse({**shown, **token.model_dump()}, status_code=201,
                            headers={REPLAYED: "true"} if replayed else None)

    @r.post("/v1/videos", status_code=201, tags=["videos"], response_model=None, responses=CREATED,
            **route_class("secret"))
    async def create_video(request: Request, body: CreateVideo,
                           playback_policy: PolicyParam = PlaybackPolicy.PUBLIC,
                           idempotency_key: IdempotencyKey = None) -> JSONResponse:
        """Create a video; returns it with an upload token for the browser. With an `Idempotency-Key`, sending the
        same create again (a retry after a lost answer) answers the video the first made, `Idempotent-Replayed:
        true`, with a fresh upload token."""
        return await create(request, body, playback_policy, idempotency_key)

    @r.post("/sdk/v1/videos", status_code=201, tags=["sdk"], response_model=None, responses=CREATED,
            **route_class("sdk"))
    async def create_video_sdk(request: Request, body: CreateVideo,
                               playback_policy: PolicyParam = PlaybackPolicy.PUBLIC,
                               idempotency_key: IdempotencyKey = None) -> JSONResponse:
        """Create a video from a browser with a publishable key (allowed origins per app)."""
        # a browser's page on an origin the app does not allow creates nothing (the CORS headers themselves, on
        # this answer and on every SDK route's, are the guard's: auth's reply names the origin, if allowed)
        origin = request.headers.get("origin")
        if origin is not None and auth_of(request).cors_origin != origin:
            raise Problem(403, "forbidden", "this origin is not allowed for the app")
        return await create(request, body, playback_policy, idempotency_key)

    @r.get("/v1/videos", tags=["videos"], response_model=None, responses=PAGE, **route_class("secret"))
    async def list_videos(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=domain.PAGE_MAX)] = 20,
        cursor: Annotated[str | None, Query(max_length=500)] = None,
        status: Annotated[list[domain.ListedStatus] | None, Query(
            description="only videos in these statuses (repeat it for several), as the api last recorded them: one "
                        "that encode took a moment ago may still be listed as `uploaded`")] = None,
    ) -> dict[str, Any]:
        """The app's live videos, newest first. A query parameter this route does not take is refused (400), so
        that a misspelt filter does not list everything."""
        if unknown := sorted(set(request.query_params) - LIST_PARAMS):
            raise Problem(400, "validation_error", f"unknown query parameter {', '.join(unknown)}: this route takes "
                          f"{', '.join(sorted(LIST_PARAMS))}")
        after = domain.decode_cursor(cursor) if cursor else None
        if cursor and after is None:
            raise Problem(400, "validation_error", "not a cursor from this api")
        async with videos.pool.acquire() as conn:
            page = await store.listing(conn, app_id_of(request), limit + 1, after,
                                       statuses=tuple(status) if status else None)
        more = len(page) > limit
        page = page[:limit]
        next_cursor = domain.encode_cursor(domain.Cursor(page[-1].created_at, page[-1].id)) if more else None
        try:  # encode's own state of the page's videos being processed: one encode.status.v2 request
            live = await encode_statuses(nc_of(), page, videos.settings.status_max_videos)
        except StatusesNotServed:
            # an encode of release 1.0.0 answers one video per request (v1): a page would cost up to a request per
            # video (each applying the stuck rule) on every listing; that release's api listed the projection, so
            # the listing shows it while such an encode runs, and GET one still asks v1
            live = {}
        shown = [await videos.shape(v, live.get(v.id), base_url=base(request)) for v in page]
        return {"videos": shown, "next_cursor": next_cursor}

    @r.get("/v1/videos/{video_id}", tags=["videos"], response_model=None, responses=VIDEO,
           **route_class("secret"))
    async def get_video(request: Request, video_id: str) -> dict[str, Any]:
        """One video with its status, renditions and processing details (encode's own, when it answers)."""
        video = await videos.owned(video_id, app_id_of(request))
        return await videos.shape(video, await encode_status(nc_of(), video), base_url=base(request))

    @r.get("/sdk/v1/videos/{video_id}", tags=["sdk"], response_model=None, responses=VIDEO, **route_class("sdk"))
    async def get_video_sdk(request: Request, video_id: str) -> dict[str, Any]:
        """The video its upload token was minted for, as `GET /v1/videos/{id}` shows it (status, renditions with
        presigned URLs): a page that uploaded a file watches it encode and plays what came out. A signed video's
        renditions are not listed here: a page plays it with a playback token, as any viewer."""
        video = await videos.owned(video_id, app_id_of(request))
        return await videos.shape(video, await encode_status(nc_of(), video), base_url=base(request), browser=True)

    @r.patch("/v1/videos/{video_id}", tags=["videos"], response_model=None, responses=VIDEO,
             **route_class("secret"))
    async def update_video(request: Request, video_id: str, body: UpdateVideo) -> dict[str, Any]:
        """Change the video's name, metadata (replaced whole) or playback policy; the fields left out stay. A
        video made signed stops playing its public URLs at once."""
        given = body.model_fields_set
        if not given:
            raise Problem(400, "validation_error", "give at least one of name, metadata, playback_policy")
        if "name" in given and body.name is None:
            raise Problem(400, "validation_error", "name cannot be null")
        if "playback_policy" in given and body.playback_policy is None:
            raise Problem(400, "validation_error", "playback_policy cannot be null")
        tracing.tag_video(video_id)
        async with videos.pool.acquire() as conn, conn.transaction():
            await videos.owned(video_id, app_id_of(request), conn=conn, lock=True)
            video = await store.update_video(conn, video_id, name=body.name, metadata=body.metadata,
                                             set_metadata="metadata" in given, playback_policy=body.playback_policy)
        if video is None:
            raise Problem(409, "conflict", "the video was retired or deleted")
        return await videos.shape(video, base_url=base(request))

    @r.delete("/v1/videos/{video_id}", status_code=204, tags=["videos"], **route_class("secret"))
    async def delete_video(request: Request, video_id: str) -> Response:
        """Delete the video and what storage holds of it."""
        tracing.tag_video(video_id)
        await videos.delete(video_id, app_id_of(request))
        return Response(status_code=204)

    @r.post("/v1/videos/{video_id}/import", status_code=202, tags=["videos"], response_model=None,
            responses=video_answer(202, VideoShown, "the video, its import queued (see `import`)"),
            **route_class("secret"))
    async def import_video(request: Request, video_id: str, body: ImportVideo) -> JSONResponse:
        """Have Weir read the video's file from a URL instead of uploading it: the import is queued at once and
        runs in the background (`import` shows it: `queued`, `fetching`, `completed`, `failed`); once stored, the
        file goes on as an upload completed (`upload.completed`, then encoding). A failure the network or the
        server causes (a timeout, a 5xx, a 429) is retried with backoff up to WEIR_IMPORT_MAX_ATTEMPTS; one the URL
        itself causes (a 404, a 403, a file too large, an address Weir does not connect to) fails the video
        (`failure.reason` `import_failed`, `video.failed`). Addresses are judged as for webhooks (SPEC 13): no
        loopback, private or link-local ones. A video takes an import or an upload, not both; the same URL sent
        again while its import runs answers the video as it is."""
        tracing.tag_video(video_id)
        video = await videos.start_import(video_id, app_id_of(request), body.url)
        return JSONResponse(await videos.shape(video, base_url=base(request)), status_code=202)

    @r.post("/v1/videos/{video_id}/upload-token", tags=["videos"], **route_class("secret"))
    async def new_upload_token(request: Request, video_id: str) -> dict[str, Any]:
        """A fresh upload token for the video."""
        tracing.tag_video(video_id)
        video = await videos.owned(video_id, app_id_of(request))
        return (await mint(video, request)).model_dump()

    uploads: tuple[tuple[str, str, RouteClass], ...] = (("/v1", "uploads", "secret"), ("/sdk/v1", "sdk uploads", "sdk"))
    for prefix, tag, credential in uploads:
        _upload_routes(r, videos, prefix, tag, credential)

    @r.get("/internal/v1/videos/{video_id}", tags=["internal"], response_model=None, responses=VIDEO,
           **route_class("internal"))
    async def internal_video(request: Request, video_id: str) -> dict[str, Any]:
        """Internal lookup used by edges and players (internal token only)."""
        return await videos.shape(await videos.owned(video_id, None), base_url=base(request))

    return r


def _upload_routes(r: APIRouter, videos: Videos, prefix: str, tag: str, credential: RouteClass) -> None:
    name = prefix.strip("/").replace("/", "_")

    @r.post(f"{prefix}/videos/{{video_id}}/upload", tags=[tag], name=f"{name}_initiate", **route_class(credential))
    async def initiate(request: Request, video_id: str, body: InitiateUpload) -> dict[str, Any]:
        """Open the multipart upload (a second call returns the open one)."""
        tracing.tag_video(video_id)
        return await videos.initiate(video_id, app_id_of(request), body.content_type)

    @r.post(f"{prefix}/videos/{{video_id}}/upload/parts", tags=[tag], name=f"{name}_parts",
            **route_class(credential, body_limit=PART_URLS_BODY_LIMIT))
    async def parts(request: Request, video_id: str, body: PartUrlsRequest) -> dict[str, Any]:
        """Presigned PUT URLs for part numbers 1 to 10,000."""
        tracing.tag_video(video_id)
        return await videos.part_urls(video_id, app_id_of(request), body.part_numbers)

    @r.get(f"{prefix}/videos/{{video_id}}/upload/parts", tags=[tag], name=f"{name}_stored_parts",
           response_model=StoredParts, **route_class(credential))
    async def stored_parts(request: Request, video_id: str) -> dict[str, Any]:
        """The parts already stored of the open upload (part number, ETag, size), to resume it."""
        return await videos.stored_parts(video_id, app_id_of(request))

    @r.post(f"{prefix}/videos/{{video_id}}/upload/complete", tags=[tag], name=f"{name}_complete",
            response_model=None, responses=VIDEO,
            **route_class(credential, body_limit=COMPLETE_BODY_LIMIT, priority="completion"))
    async def complete(request: Request, video_id: str, body: CompleteUpload) -> dict[str, Any]:
        """Assemble the parts; the video then has its file (completing twice returns the first result). List every
        stored part: one left out is refused (400, naming it), and the upload stays open."""
        tracing.tag_video(video_id)
        video = await videos.complete(video_id, app_id_of(request), [(p.part_number, p.etag) for p in body.parts],
                                      key_id=key_id_of(request))
        return await videos.shape(video, base_url=base(request), browser=credential == "sdk")

    @r.delete(f"{prefix}/videos/{{video_id}}/upload", status_code=204, tags=[tag], name=f"{name}_abort",
              **route_class(credential))
    async def abort(request: Request, video_id: str) -> Response:
        """Abort the open upload."""
        tracing.tag_video(video_id)
        await videos.abort(video_id, app_id_of(request))
        return Response(status_code=204)


def account_routes(nc_of: Any) -> APIRouter:
    r = APIRouter(prefix="/v1/account", tags=["account"], responses=ERRORS)

    def who(request: Request) -> tuple[str, str]:
        identity = auth_of(request).identity
        assert identity is not None and identity.user_id and identity.account_id
        return identity.user_id, identity.account_id

    @r.post("/apps", status_code=201, **route_class("management", operation="app_create"))
    async def create_app(request: Request, body: CreateAppBody) -> JSONResponse:
        """Create an app with a secret and a publishable key (shown once)."""
        user, account = who(request)
        created = await manage(nc_of(), "app.create", CreateApp(user_id=user, account_id=account, name=body.name,
                                                                allowed_origins=tuple(body.allowed_origins)),
                               AppCreated)
        return JSONResponse(created.model_dump(), status_code=201)

    @r.get("/apps/{app_id}/keys", **route_class("management"))
    async def list_keys(request: Request, app_id: str) -> dict[str, Any]:
        """The app's keys (prefixes only)."""
        _, account = who(request)
        return (await manage(nc_of(), "keys.list", ListKeys(account_id=account, app_id=app_id), KeyList)).model_dump()

    @r.post("/apps/{app_id}/keys/rotate", **route_class("management", operation="key_rotate"))
    async def rotate(request: Request, app_id: str) -> dict[str, Any]:
        """A new key pair; the old one is revoked."""
        user, account = who(request)
        pair = await manage(nc_of(), "keys.rotate", RotateKeys(user_id=user, account_id=account, app_id=app_id),
                            KeyPair)
        return pair.model_dump()

    @r.delete("/keys/{key_id}", status_code=204, **route_class("management"))
    async def revoke(request: Request, key_id: str) -> Response:
        """Revoke a key: refused everywhere within a second."""
        user, account = who(request)
        await manage_raw(nc_of(), "key.revoke", RevokeKey(user_id=user, account_id=account, key_id=key_id))
        return Response(status_code=204)

    return r
