"""Wiring of the `api` service: the public HTTP API, its guard, and the status projection from `encode.*`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import asyncpg
from fastapi import FastAPI

from services.api import domain, store
from services.api.caption_routes import caption_routes
from services.api.demo import page_routes
from services.api.guard import CORS_EXPOSE, Guard, RouteTable
from services.api.imports import Importer
from services.api.limitsdoc import LimitsDocument
from services.api.objects import Objects
from services.api.playback_routes import playback_key_routes, playback_routes
from services.api.player import Player
from services.api.routes import account_routes, app_id_of, install_error_handlers, video_routes
from services.api.settings import ApiSettings
from services.api.videos import Videos
from services.api.webhooks import webhook_routes
from shared.authcheck import LIMITS_LIST, LimitList, ListLimits
from shared.authclient import declare_auth_requests, manage
from shared.consumer import ConsumerSpec
from shared.media.protocol import STATUS_SUBJECT, STATUS_V2_SUBJECT, StatusesRequest, StatusRequest
from shared.metrics import Metrics
from shared.overload.edge import Shedder, shed_config
from shared.runtime import Runtime, ServiceDefinition, build_http
from shared.storage import s3_client
from shared.webhookcalls import declare_webhook_requests

log = logging.getLogger("weir.api")


async def project_encode_event(conn: asyncpg.Connection, event: domain.EncodeEvent) -> None:
    """Keep what GET /v1/videos/{id} shows from encode's events (inbox and effect in one transaction)."""
    video = await store.get(conn, event.data.video_id, lock=True)
    if video is None:
        return
    projected = domain.project(video.projection, event)
    if projected != video.projection:
        await store.save_projection(conn, video.id, projected)
        announced = domain.outcome(video.id, video.app_id, video.account_id, video.projection, projected)
        if announced is not None:  # video.ready / video.failed, with the projection (the outbox)
            await store.announce(conn, video, announced)


def consumers(rt: Runtime) -> list[ConsumerSpec]:
    return [ConsumerSpec(name="api_status", handler=project_encode_event)]


def routes(app: FastAPI, rt: Runtime) -> None:
    settings = rt.settings
    assert isinstance(settings, ApiSettings)
    handlers(app, rt)
    rt.parts = LimitsDocument(app)  # the api's own object: /openapi.json with auth's limits (`refresh_limits`)
    # the guard's table from what every route declares; a route that declares nothing stops the api here
    app.add_middleware(Guard, table=RouteTable.of(app), nc=lambda: rt.nc, timeout=settings.auth_timeout_ms / 1000,
                       metrics=rt.metrics, watch=lambda: rt.watch)


async def start(rt: Runtime) -> None:
    """What the api asks auth (`auth.check` per request, `auth.manage.<op>`) and encode (`encode.status`, v2 and,
    from an encode of release 1.0.0, v1), declared for its /asyncapi.json."""
    assert rt.broker is not None
    declare_auth_requests(rt.broker)
    declare_webhook_requests(rt.broker)
    rt.broker.publisher(STATUS_V2_SUBJECT, title=f"{STATUS_V2_SUBJECT}:request", schema=StatusesRequest,
                        description="request/reply (GET /v1/videos: the page's videos being processed, in one "
                        "request; GET /v1/videos/{id}): answered with ProcessingStatuses; no answer within 250 ms "
                        "shows the api's own projection; no responder (an encode of release 1.0.0) makes GET one "
                        "ask encode.status (v1)")
    rt.broker.publisher(STATUS_SUBJECT, title=f"{STATUS_SUBJECT}:request", schema=StatusRequest,
                        description="request/reply, v1 (GET /v1/videos/{id} of a video being processed, when no "
                        "encode answers encode.status.v2): answered with ProcessingStatus; no answer within 250 ms "
                        "shows the api's own projection")


async def refresh_limits(rt: Runtime, stop: asyncio.Event) -> None:
    """Ask auth for its request limits at start and every WEIR_LIMITS_REFRESH_SECONDS (sooner again while it does not
    answer), for /openapi.json; the last answer stays until another comes."""
    settings = rt.settings
    assert isinstance(settings, ApiSettings)
    # none where no HTTP app was built (a runtime started without serving)
    document = rt.parts if isinstance(rt.parts, LimitsDocument) else None
    answered = True  # whether the last ask was answered: a log line when that changes, not one per ask
    while document is not None and rt.nc is not None and not stop.is_set():
        try:
            document.learn(await manage(rt.nc, LIMITS_LIST, ListLimits(), LimitList,
                                        timeout=settings.auth_timeout_ms / 1000))
            wait, answered = settings.limits_refresh_seconds, True
        except Exception as exc:  # an older auth serves no limits.list, or auth is away: the document says so
            if answered:
                log.info("auth does not tell its request limits (%s): asking every %s s", type(exc).__name__,
                         settings.limits_retry_seconds)
            wait, answered = settings.limits_retry_seconds, False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)


async def import_files(rt: Runtime, stop: asyncio.Event) -> None:
    """Imports from a URL (services/api/imports.py), taken from the videos table by every api instance."""
    settings = rt.settings
    assert isinstance(settings, ApiSettings)
    _, _, pool = rt.require()
    if settings.import_concurrency == 0:
        return
    async with s3_client(settings, timeout=settings.import_read_timeout_seconds, unsigned_payload=True) as s3:
        objects = Objects(s3, settings.s3_bucket)
        await Importer(Videos(pool=pool, objects=objects, settings=settings), settings, rt.metrics).run(stop)


def shedder(app: FastAPI, rt: Runtime) -> Shedder:
    """The api's shedder in front of everything (SPEC 15), classifying by what the routes declare."""
    settings = rt.settings
    assert isinstance(settings, ApiSettings)
    table = RouteTable.of(app)
    return Shedder(app, config=shed_config(settings), classify=table.shed_priority, passing=table.operations_paths,
                   any_origin=table.any_origin, cors_expose=CORS_EXPOSE,
                   internal_token=settings.internal_token.get_secret_value(), metrics=rt.metrics)


def handlers(app: FastAPI, rt: Runtime) -> None:
    """The routes and their error handlers, without the guard in front (benchmarks put their own there)."""
    settings = rt.settings
    assert isinstance(settings, ApiSettings)
    _, _, pool = rt.require()
    objects = Objects(rt.s3, settings.s3_bucket)
    videos = Videos(pool=pool, objects=objects, settings=settings)
    player = Player(pool=pool, objects=objects, settings=settings, metrics=rt.metrics)
    install_error_handlers(app)
    app.include_router(video_routes(videos, lambda: rt.nc))
    app.include_router(playback_routes(videos, player))
    app.include_router(playback_key_routes(player, app_id_of))
    app.include_router(caption_routes(videos, app_id_of))
    app.include_router(account_routes(lambda: rt.nc))
    app.include_router(webhook_routes(lambda: rt.nc))
    app.include_router(page_routes(settings))


SERVICE = ServiceDefinition(
    name="api",
    settings_cls=ApiSettings,
    consumers=consumers,
    routes=routes,
    on_start=start,
    background=(refresh_limits, import_files),
    edge=shedder,
    description="the public HTTP API; video rows and their upload state",
)


def offline_app(definition: ServiceDefinition = SERVICE) -> FastAPI:
    """The app as `build_http` makes it at start, without servers (for its OpenAPI document, its route table, the
    edge's config): nothing is connected, the routes keep placeholders they only use when a request comes."""
    unused: Any = object()
    rt = Runtime(definition=definition, settings=ApiSettings(), metrics=Metrics(definition.name), nc=unused,
                 js=unused, pool=unused)
    return build_http(rt)
