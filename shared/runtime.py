"""What every Weir service process does the same way: connect, migrate, relay, consume, serve, stop.

A service describes itself with a `ServiceDefinition`; `serve` wires it to NATS (its FastStream broker: the
consumers and publishers shared/contracts.py declares, and its own), PostgreSQL and S3, serves `/healthz`, `/readyz`,
`/version`, `/metrics` and `/asyncapi.json` beside its routes, sets up logs and traces, and on SIGTERM stops taking
work, drains what is in flight, and closes its pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hmac
import logging
import random
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import prometheus_client
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from faststream.nats import NatsBroker
from faststream.specification import Specification
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from pydantic import BaseModel, SecretStr
from starlette.routing import Match

from shared import contracts, db, logs, natsconn, outbox, tracing, walrelay
from shared.bus import subscriptions_in_place, wait_any
from shared.consumer import ConsumerSpec, EventConsumer
from shared.messaging import asyncapi_document, asyncapi_specification, make_broker
from shared.metrics import CONTENT_TYPE, LAG_BUCKETS, Metrics
from shared.natsconn import BusConfigError, ConnectionRefused, ConnectionWatch
from shared.outbox import OutboxRelay
from shared.problems import problem
from shared.publishers import EventPublishers
from shared.release import VERSION, VersionInfo, version_info
from shared.routeclass import OPERATIONS_ROUTE
from shared.settings import CommonSettings, redact
from shared.storage import s3_client
from shared.webpages import install_docs_pages

log = logging.getLogger("weir.runtime")

Background = Callable[["Runtime", asyncio.Event], Coroutine[Any, Any, None]]
Refresher = Callable[[], Awaitable[None]]  # sets gauges from what it reads (a query, a registry, consumer info)
P = TypeVar("P")


class NotStarted(RuntimeError):
    """A service's own objects asked for before its start made them (a route answered before the start finished)."""


@dataclass
class ServiceDefinition:
    name: str
    settings_cls: type[CommonSettings]
    consumers: Callable[[Runtime], list[ConsumerSpec]] = lambda rt: []  # each as shared/contracts.py declares it
    routes: Callable[[FastAPI, Runtime], None] | None = None
    background: tuple[Background, ...] = ()  # started once on_start returned: the parts it made are there
    on_start: Callable[[Runtime], Awaitable[None]] | None = None
    on_stop: Callable[[Runtime], Awaitable[None]] | None = None
    # subjects the service serves without a FastStream subscriber (auth.check), declared for `/asyncapi.json` on a
    # broker of their own that never connects
    served_outside_broker: Callable[[NatsBroker], None] | None = None
    # what answers before the app's own stack, given the app and the runtime (the api's shedder)
    edge: Callable[[FastAPI, Runtime], ASGIApp] | None = None
    description: str = ""

    @property
    def schema(self) -> str:
        return db.SCHEMAS[self.name]

    @property
    def publishes(self) -> tuple[str, ...]:
        """The event types the service publishes (shared/contracts.py)."""
        return contracts.published_by(self.name)


@dataclass
class Runtime:
    definition: ServiceDefinition
    settings: CommonSettings
    metrics: Metrics
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    broker: NatsBroker | None = None  # every subscriber and publisher of the service; owns `nc`
    nc: NATS | None = None
    js: JetStreamContext | None = None
    pool: asyncpg.Pool | None = None
    s3: Any = None
    consumers: list[EventConsumer] = field(default_factory=list)
    publishers: EventPublishers | None = None
    relay: OutboxRelay | None = None
    wal_relay: walrelay.WalRelay | None = None  # with WEIR_OUTBOX_TRANSPORT=wal: it runs `relay` beside it
    watch: ConnectionWatch | None = None  # the connection's refusals and reconnects (shared/natsconn.py)
    subscriptions: list[Subscription] = field(default_factory=list)  # plain nats-py ones, stopped with the broker's
    outside_broker_document: NatsBroker | None = None  # `served_outside_broker`'s declarations, for /asyncapi.json
    # the service's own objects (auth's checker, encode's processing, ...), one value its start makes, read typed
    # through `parts_of`
    parts: object = None
    refreshers: list[Refresher] = field(default_factory=list)  # the service's own gauges, refreshed periodically

    @property
    def name(self) -> str:
        return self.definition.name

    def parts_of(self, kind: type[P]) -> P:
        """The service's own objects, as its start made them: NotStarted before that."""
        if not isinstance(self.parts, kind):
            raise NotStarted(f"{self.definition.name if self.definition else 'the service'} has not made its "
                             f"{kind.__name__} yet")
        return self.parts

    def require(self) -> tuple[NATS, JetStreamContext, asyncpg.Pool]:
        assert self.nc is not None and self.js is not None and self.pool is not None, "runtime not started"
        return self.nc, self.js, self.pool

    async def readiness(self, timeout: float = 2.0) -> dict[str, str]:
        """Each dependency really answering, not merely configured."""
        checks: dict[str, str] = {}

        async def nats_ok() -> None:
            assert self.js is not None and self.nc is not None and self.nc.is_connected
            await self.js.account_info()

        async def db_ok() -> None:
            assert self.pool is not None
            async with self.pool.acquire(timeout=timeout) as conn:
                await conn.fetchval("SELECT 1")

        async def s3_ok() -> None:
            await self.s3.head_bucket(Bucket=self.settings.s3_bucket)

        for name, check in (("nats", nats_ok), ("database", db_ok), ("storage", s3_ok)):
            try:
                await asyncio.wait_for(check(), timeout)
                checks[name] = "ok"
            except Exception as exc:
                checks[name] = f"unavailable: {type(exc).__name__}"
        return checks


NO_FASTAPI_TELEMETRY: Any = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


class Health(BaseModel):
    """`/healthz`: the process is alive, and which release it runs (the same object as `/version`)."""

    status: str = "alive"
    service: str
    version: VersionInfo


# what an operators' route answers a request without Weir's internal token (`operators_only`), for its OpenAPI entry
OPERATORS_ONLY_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "the internal token is missing or wrong (problem, RFC 9457)",
          "content": {"application/problem+json": {}}},
    404: {"description": "no internal token is configured, so nobody may read this",
          "content": {"application/problem+json": {}}}}


def operators_only(settings: CommonSettings, request: Request) -> JSONResponse | None:
    """The refusal of an operators' route (/settings, auth's /throttled) to a request without Weir's internal token
    (compared in constant time); None lets it through. With no token configured the route is not served (404)."""
    expected = settings.internal_token.get_secret_value()
    if not expected:
        return problem(404, "not_found", "not served: no internal token is configured")
    given = request.headers.get("x-weir-internal-token", "")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return problem(401, "invalid_credential", "the internal token is needed here")
    return None


def build_http(rt: Runtime) -> FastAPI:
    d = rt.definition
    release = version_info(d.name)  # fixed for the life of the process: read once
    # docs_url/redoc_url None: FastAPI's pages load a CDN's scripts; shared/webpages.py serves /docs from local files
    # FastAPI's own telemetry (0.16x: spans, metrics and logs whenever a tracer provider is set) stays off: the server
    # span is HTTPMetrics' (its three spans a request and its route walk cost more than the request's own work)
    # version: the OpenAPI document's info.version is the release
    app = FastAPI(title=f"weir {d.name}", description=d.description, version=VERSION, docs_url=None,
                  redoc_url=None, telemetry=NO_FASTAPI_TELEMETRY)

    @app.get("/healthz", tags=["operations"], **OPERATIONS_ROUTE)
    async def healthz() -> Health:
        return Health(service=d.name, version=release)

    @app.get("/version", tags=["operations"], **OPERATIONS_ROUTE)
    async def version() -> VersionInfo:
        """The release this instance runs: its version, the commit it was built from and the contract versions it
        speaks (SPEC 11)."""
        return release

    @app.get("/readyz", tags=["operations"], **OPERATIONS_ROUTE)
    async def readyz() -> JSONResponse:
        checks = await rt.readiness()
        ready = all(v == "ok" for v in checks.values()) and not rt.stop.is_set()
        if ready:
            return JSONResponse({"status": "ready", "checks": checks})
        return problem(503, "unavailable", "a dependency does not answer", headers={"Retry-After": "1"},
                       checks=checks)

    @app.get("/metrics", tags=["operations"], response_class=Response, **OPERATIONS_ROUTE,
             responses={200: {"description": "the Prometheus text format", "content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/settings", tags=["operations"], response_model=None, **OPERATIONS_ROUTE,
             responses=OPERATORS_ONLY_RESPONSES)
    async def current_settings(request: Request) -> dict[str, Any] | JSONResponse:
        """What this instance runs with (secrets as set/unset, URL passwords masked), for operators only: the
        request must carry Weir's internal token; with none configured the route is not served."""
        refused = operators_only(rt.settings, request)
        if refused is not None:
            return refused
        return {f"WEIR_{name.upper()}": redact(value) for name, value in rt.settings}

    @app.get("/asyncapi.json", tags=["operations"], **OPERATIONS_ROUTE)
    async def asyncapi() -> dict[str, Any]:
        """The service's AsyncAPI document, as FastStream generates it from the broker's handlers."""
        assert rt.broker is not None
        return asyncapi_document(*document_brokers(rt), service=d.name, description=d.description)

    def specification() -> Specification:  # the same document as /asyncapi.json, for the /asyncapi page
        assert rt.broker is not None
        return asyncapi_specification(*document_brokers(rt), service=d.name, description=d.description)

    install_docs_pages(app, title=app.title, asyncapi=specification, assets_dir=rt.settings.web_assets_dir)
    if d.routes is not None:
        d.routes(app, rt)
    # added last, so outermost: a service's own middleware (the api's guard) answers inside it and is timed too
    app.add_middleware(HTTPMetrics, metrics=rt.metrics, routes=app.router.routes, traced=tracing.enabled())
    return app


LOOP_LAG_SAMPLE_SECONDS = 0.02  # event_loop_lag_seconds' sampling: 50 timers a second cost nothing that shows
# the operations routes are polled (probes, scrapes) or static (pages): no span of theirs
UNTRACED_PATHS = ("/healthz", "/readyz", "/version", "/metrics", "/settings", "/throttled", "/docs", "/asyncapi",
                  "/openapi.json", "/static/", "/favicon.ico")


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"  # no route has the path: a label of its own, never the raw path (unbounded label values)
_TEMPLATES_KEPT = 1024


class HTTPMetrics:
    """Times each HTTP answer into `weir_http_request_duration_seconds` by route template, method and status, and
    with tracing on makes the request's server span named by that template. The outermost middleware, so answers the
    guard gives before any route runs count too (matched against the routes here, remembered per path). One span with
    four attributes: OpenTelemetry's FastAPI instrumentation walks every route to name its spans (bench/RESULTS.md)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, routes: Sequence[Any], traced: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.traced = traced
        self._table: list[tuple[Any, str]] | None = None  # (a route's matcher, its whole template), made once
        self._full: dict[int, str] = {}  # id of a route as the router puts it in the scope -> its whole template
        self._templates: dict[tuple[str, str], str] = {}

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers when the app raises before its answer starts
        scope_token = logs.HTTP_SCOPE.set(scope)  # log lines name the request (a request id, made if one is needed)
        span = None
        if self.traced and not scope["path"].startswith(UNTRACED_PATHS):
            span, span_token = tracing.start_server_span(scope)

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            logs.HTTP_SCOPE.reset(scope_token)
            method = scope["method"]
            template = self.template(scope)
            self.metrics.observe("http_request_duration_seconds", time.perf_counter() - started,
                                 route=template, method=method if method in METHODS else "other", status=str(status))
            if span is not None:
                tracing.end_server_span(span, span_token, method=method, route=template, status=status)

    def template(self, scope: Scope) -> str:
        if self._table is None:
            self._table = _route_table(self.routes)
            self._full = {id(getattr(matcher, "original_route", matcher)): path for matcher, path in self._table}
        route = scope.get("route")
        if route is not None:
            return self._full.get(id(route)) or str(getattr(route, "path", UNMATCHED))
        key = (scope["method"], scope["path"])
        template = self._templates.get(key)
        if template is None:
            template = self._match(scope, self._table)
            if len(self._templates) >= _TEMPLATES_KEPT:  # paths carry ids: keep the cache bounded
                self._templates.clear()
            self._templates[key] = template
        return template

    @staticmethod
    def _match(scope: Scope, table: list[tuple[Any, str]]) -> str:
        partial = UNMATCHED
        for matcher, path in table:
            match, _ = matcher.matches(scope)
            if match is Match.FULL:
                return path
            if match is Match.PARTIAL and partial == UNMATCHED:
                partial = path  # the path is a route's, the method another's (405)
        return partial


def _route_table(routes: Sequence[Any]) -> list[tuple[Any, str]]:
    """Every route with its whole template: FastAPI (0.16x) keeps an included router as one entry, whose routes
    `iter_route_contexts` lists with the prefixes they are served under; older versions copy them in, prefixed."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return [(r, str(r.path)) for r in routes if getattr(r, "path", None)]
    return [(c, str(c.path)) for c in iter_route_contexts(routes) if c.path]


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # the runtime owns SIGTERM/SIGINT: it drains consumers before the HTTP server stops
        yield


def http_config(app: ASGIApp, settings: CommonSettings) -> uvicorn.Config:
    """The HTTP server of every service. Proxy headers off: uvicorn would otherwise rewrite the client address
    from X-Forwarded-For (trusting 127.0.0.1 or FORWARDED_ALLOW_IPS) before Weir sees it; only auth's
    WEIR_TRUSTED_PROXIES decides whose X-Forwarded-For is read (SPEC 3), so the app must get the real TCP peer."""
    # log_config None: uvicorn's lines go through the service's own handler (its format, its redaction)
    return uvicorn.Config(app, host=settings.http_host, port=settings.http_port, log_level="warning", log_config=None,
                          lifespan="off", proxy_headers=False, forwarded_allow_ips=None, server_header=False,
                          timeout_keep_alive=settings.http_keep_alive_seconds)


def listening_sockets(settings: CommonSettings) -> tuple[socket.socket, socket.socket | None]:
    """The instance's sockets, made here so that the port is shared: SO_REUSEPORT lets a new instance of the service
    listen while the old one still serves (a rollout), the kernel spreading new connections over both. Beside it,
    when set, a Unix socket of this instance alone (`http_unix_socket`)."""
    family = socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET
    shared = socket.socket(family, socket.SOCK_STREAM)
    try:
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind((settings.http_host, settings.http_port))
    except OSError:
        shared.close()
        raise
    if not settings.http_unix_socket:
        return shared, None
    path = Path(settings.http_unix_socket)
    path.unlink(missing_ok=True)  # left by a process of the same name that was killed
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(str(path))
    return shared, own


class ClosingWhenDraining:
    """Once draining, answers say `Connection: close`: the client's next request opens a new connection, which the
    shared port gives to an instance that still listens, instead of finding this one gone.

    Each connection closes after its first answer once a delay of its own, drawn evenly within `spread_seconds` of
    the drain's start, has passed: the clients reconnect to the new instance a few at a time instead of all in the
    same instant to a process that has answered nothing yet."""

    def __init__(self, app: ASGIApp, spread_seconds: float = 0.0) -> None:
        self.app = app
        self.spread_seconds = spread_seconds
        self.draining_since: float | None = None
        self.close_at: dict[tuple[Any, ...], float] = {}  # per client address (one TCP connection)

    def drain(self) -> None:
        self.draining_since = time.monotonic()

    def closes(self, client: Any) -> bool:
        """Whether the answer now going out on the connection from `client` closes it."""
        since = self.draining_since
        if since is None:
            return False
        if self.spread_seconds <= 0 or not client:  # a Unix socket's client has no address: at once
            return True
        key = tuple(client)
        at = self.close_at.get(key)
        if at is None:
            at = self.close_at[key] = since + random.uniform(0.0, self.spread_seconds)
        return time.monotonic() >= at

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and self.closes(client):
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing_send)


def declare_messaging(rt: Runtime, *, running: bool = False) -> None:
    """The service's event publishers and consumers, declared on its broker (connected or not, not yet started).
    `running`: the service runs them, and each consumer's subscribers join once its durables exist."""
    assert rt.broker is not None
    d = rt.definition
    rt.publishers = EventPublishers(rt.broker, d.publishes, timeout=rt.settings.bus_publish_timeout_seconds,
                                    watch=rt.watch)
    rt.consumers = [
        EventConsumer(declared_consumer(d.name, spec), pool=rt.pool, settings=rt.settings, metrics=rt.metrics)
        for spec in d.consumers(rt)
    ]
    for consumer in rt.consumers:  # running: nats-py pulls on the broker's connection, declared on the document's
        consumer.register(rt.broker, inbox=natsconn.inbox_prefix(natsconn.identity(rt.settings, d.name)),
                          document_only=not running, document=outside_document(rt) if running else None)


def declared_consumer(service: str, spec: ConsumerSpec) -> ConsumerSpec:
    """The service's consumer as shared/contracts.py declares it (its description from there); raises ContractError
    when its handler reads other event types, or the consumer is not declared as the service's."""
    declared = contracts.check_consumer(service, spec.name, spec.types)
    return spec if spec.description else dataclasses.replace(spec, description=declared.description)


def document_brokers(rt: Runtime) -> tuple[NatsBroker, ...]:
    """What `/asyncapi.json` documents: the running broker, and what the service serves outside it (its durable
    consumers, `served_outside_broker`) on a broker of its own."""
    assert rt.broker is not None
    if rt.definition.served_outside_broker is None and rt.outside_broker_document is None:
        return (rt.broker,)
    return rt.broker, outside_document(rt)


def outside_document(rt: Runtime) -> NatsBroker:
    """The broker that declares what the service serves without FastStream (never connects)."""
    if rt.outside_broker_document is None:
        rt.outside_broker_document = make_broker(rt.settings, name=rt.name)
        if rt.definition.served_outside_broker is not None:
            rt.definition.served_outside_broker(rt.outside_broker_document)
    return rt.outside_broker_document


def messaging_document(definition: ServiceDefinition, settings: CommonSettings | None = None) -> dict[str, Any]:
    """The AsyncAPI document of the service's events (what it publishes and consumes), built as the running service
    builds it, without connecting to anything. The running service's `/asyncapi.json` adds its request/reply
    subjects (declared in `on_start`)."""
    settings = settings or definition.settings_cls()
    rt = Runtime(definition=definition, settings=settings, metrics=Metrics(definition.name))
    rt.broker = make_broker(settings, name=definition.name)
    declare_messaging(rt)
    return asyncapi_document(rt.broker, service=definition.name, description=definition.description)


@contextlib.asynccontextmanager
async def started(definition: ServiceDefinition, settings: CommonSettings | None = None,
                  before_work: Callable[[Runtime], Awaitable[None]] | None = None) -> AsyncIterator[Runtime]:
    """Connect, migrate and start relay, consumers and background loops; stop them all on exit. `before_work`:
    what the caller makes once connected and before any work is taken (before the start gate)."""
    settings = settings or definition.settings_cls()
    rt = Runtime(definition=definition, settings=settings, metrics=Metrics(definition.name))
    tasks: list[asyncio.Task[None]] = []
    async with contextlib.AsyncExitStack() as stack:
        # one nats-py connection, the broker's: subscribers, publishers, requests and JetStream all go over it
        rt.watch = ConnectionWatch(natsconn.identity(settings, definition.name), rt.metrics)
        rt.broker = make_broker(settings, name=definition.name, watch=rt.watch,
                                reconnected_cb=rt.watch.reconnected_cb)  # FastStream's wrapper logs it, then calls it
        rt.nc = await rt.watch.connected(rt.broker.connect())  # ConnectionRefused: the identity was refused
        stack.push_async_callback(_stop_broker, rt.broker)
        natsconn.require_tls(settings, rt.nc)
        rt.js = rt.nc.jetstream()
        rt.pool = await db.create_pool(settings.database_url, schema=definition.schema, max_size=settings.db_pool_max)
        stack.push_async_callback(rt.pool.close)
        async with rt.pool.acquire() as conn:
            for applied in await db.migrate(conn, definition.name):
                log.info("migration applied: %s", applied)
            if settings.outbox_transport == "wal":  # its slot exists before the first write puts an event there
                await walrelay.ensure_slot(conn, definition.schema)
        outbox.use_transport(settings.outbox_transport)
        rt.s3 = await stack.enter_async_context(s3_client(settings))
        declare_messaging(rt, running=True)
        assert rt.publishers is not None
        rt.relay = OutboxRelay(
            pool=rt.pool, publishers=rt.publishers, dsn=settings.database_url, schema=definition.schema,
            batch_size=settings.outbox_batch_size, poll_seconds=settings.outbox_poll_seconds,
            linger_seconds=settings.outbox_linger_ms / 1000, recheck_seconds=settings.outbox_recheck_ms / 1000,
            keep_sent_seconds=settings.outbox_keep_sent_seconds, metrics=rt.metrics,
            legacy_copies=settings.events_legacy_subjects,
        )
        if settings.outbox_transport == "wal":  # reads the slot; the table relay drains earlier releases' rows
            rt.wal_relay = walrelay.WalRelay(
                dsn=settings.database_url, schema=definition.schema, table=rt.relay,
                batch_size=settings.outbox_batch_size, recheck_seconds=settings.outbox_recheck_ms / 1000,
                standby_seconds=settings.outbox_poll_seconds)
        for consumer in rt.consumers:  # the durables (main and replay) exist before their pulls begin
            await consumer.ensure_if_possible(rt.js)
        # what start-up made (modules, models, pools) lives as long as the process: kept out of every later
        # collection (pauses of ~90 ms become ~ms), collected here while a rollout still caps this start's CPU
        if before_work is not None:
            await before_work(rt)
        gc.collect()
        gc.freeze()
        await pass_start_gate(settings.start_gate, settings.start_gate_timeout_seconds)  # then it takes work
        if definition.on_start:
            await definition.on_start(rt)  # registers the service's subscribers on the broker
        await rt.broker.start()
        for consumer in rt.consumers:  # their pulls, once on_start made what their handlers use
            consumer.start()
        await subscriptions_in_place(rt.nc)  # the server has every subscription before the service says it started
        # consumers and loops stop first (stop event), the relay last, so what they wrote still goes out
        relay_stop = asyncio.Event()
        relay_task = asyncio.create_task((rt.wal_relay or rt.relay).run(relay_stop), name="outbox-relay")
        for loop_fn in definition.background:
            tasks.append(asyncio.create_task(loop_fn(rt, rt.stop), name=f"background-{loop_fn.__name__}"))
        tasks.append(asyncio.create_task(refresh_metrics(rt, rt.stop, rt.settings.metrics_refresh_seconds),
                                         name="metrics-refresh"))
        tasks.append(asyncio.create_task(sample_loop_lag(rt.metrics, rt.stop), name="loop-lag"))
        try:
            yield rt
        finally:
            rt.stop.set()
            await _stop_subscribers(rt)  # take no new work; what is in flight finishes
            await asyncio.gather(*(c.drain() for c in rt.consumers))  # lanes commit and ack what they took
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=settings.shutdown_grace_seconds)
                for t in pending:
                    t.cancel()
            if definition.on_stop:
                await definition.on_stop(rt)
            try:
                await asyncio.wait_for(rt.relay.drain_once(), timeout=2.0)
            except Exception as exc:  # the rows stay in the outbox for the next start
                log.warning("the last outbox drain did not finish: %r", exc)
            relay_stop.set()
            try:
                await asyncio.wait_for(relay_task, timeout=5.0)
            except Exception as exc:
                log.warning("the outbox relay did not stop cleanly: %r", exc)


async def pass_start_gate(path: str, timeout: float) -> None:
    """Under `weir rollout` (WEIR_START_GATE): say "started" by connecting to the gate and wait for its byte, so
    that the supervisor lifts the cap on this start's CPU before the instance takes work. A gate that is not
    there, closes, or says nothing within `timeout` lets the instance go on."""
    if not path:
        return
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            await asyncio.wait_for(reader.read(1), timeout)
        finally:
            writer.close()
    except (OSError, TimeoutError) as exc:
        log.warning("start gate %s: %r; going on", path, exc)


def runtime_refreshers(rt: Runtime) -> list[Refresher]:
    """The gauges every service has: its outbox backlog, and each consumer's pending messages."""
    assert rt.relay is not None and rt.js is not None
    js = rt.js
    return [(rt.wal_relay or rt.relay).refresh_metrics,
            *(functools.partial(c.refresh_metrics, js) for c in rt.consumers)]


async def refresh_metrics(rt: Runtime, stop: asyncio.Event, interval: float) -> None:
    """Every `interval` (the first at once), all refreshers side by side; a failing one is logged when its reason
    changes (not every few seconds while the database or the bus is away), and when it works again."""
    refreshers = [*runtime_refreshers(rt), *rt.refreshers]
    failing: dict[int, str] = {}
    while not stop.is_set():
        results = await asyncio.gather(*(asyncio.wait_for(r(), interval) for r in refreshers), return_exceptions=True)
        for i, result in enumerate(results):
            reason = repr(result) if isinstance(result, BaseException) else ""
            if reason and failing.get(i) != reason:
                log.warning("metrics: %s failed: %s", _described(refreshers[i]), reason)
            elif not reason and failing.get(i):
                log.info("metrics: %s works again", _described(refreshers[i]))
            failing[i] = reason
        await wait_any(stop, None, interval)


async def sample_loop_lag(metrics: Metrics, stop: asyncio.Event, every: float = LOOP_LAG_SAMPLE_SECONDS) -> None:
    """How late a timer runs on this event loop, every `every` s: the wait that any ready work meets here (a request
    read off its socket, a refusal, a reply), whatever the process was busy with meanwhile."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + every
        await asyncio.sleep(every)
        metrics.observe("event_loop_lag_seconds", max(0.0, loop.time() - due), buckets=LAG_BUCKETS)


def _described(refresher: Refresher) -> str:
    target = refresher.func if isinstance(refresher, functools.partial) else refresher
    return str(getattr(target, "__qualname__", repr(target)))


async def _stop_subscribers(rt: Runtime) -> None:
    """The broker's subscribers and the service's own subscriptions (each handles what it already received)."""
    assert rt.broker is not None
    drains: list[Callable[[], Awaitable[None]]] = [sub.drain for sub in rt.subscriptions]  # nats-py: untyped
    results = await asyncio.gather(*(sub.stop() for sub in rt.broker.subscribers), *(drain() for drain in drains),
                                   return_exceptions=True)
    for failed in (r for r in results if isinstance(r, BaseException)):
        log.warning("a subscriber did not stop cleanly: %r", failed)


async def _stop_broker(broker: NatsBroker) -> None:
    """Subscribers stopped (in-flight handlers finish within the grace), then the connection drained."""
    try:
        await asyncio.wait_for(broker.stop(), timeout=10.0)
    except Exception as exc:
        log.warning("the broker did not stop cleanly: %r", exc)


def configure_logging(service: str, settings: CommonSettings) -> None:
    """stderr, as text or JSON lines (WEIR_LOG_FORMAT), never showing the process's secret settings (shared/logs.py)."""
    secrets = [value.get_secret_value() for _, value in settings if isinstance(value, SecretStr)]
    logs.configure(service, settings.log_level, settings.log_format, secrets=secrets)


async def serve(definition: ServiceDefinition, settings: CommonSettings | None = None) -> None:
    settings = settings or definition.settings_cls()
    configure_logging(definition.name, settings)
    # before the broker is made: its telemetry middleware and the HTTP instrumentation come only with tracing on
    tracing.setup(definition.name, settings.traces_dir, reads_per_second=settings.trace_reads_per_second,
                  read_ratio=settings.trace_read_ratio)
    try:
        await _serve(definition, settings)
    finally:
        tracing.shutdown()  # what is queued is written before the process ends


async def _serve(definition: ServiceDefinition, settings: CommonSettings) -> None:
    loop = asyncio.get_running_loop()
    shared, own = listening_sockets(settings)  # before connecting: a port that cannot be bound fails at once
    made: list[tuple[ClosingWhenDraining, list[uvicorn.Config]]] = []

    async def http_made(rt: Runtime) -> None:
        # the app and its servers' configurations (loading one imports uvicorn's protocols) made before the start
        # gate, while a rollout still caps this start's CPU: after it, little is left to do at full speed
        built = build_http(rt)
        edge = built if definition.edge is None else definition.edge(built, rt)
        app = ClosingWhenDraining(edge, min(settings.http_close_spread_seconds, settings.http_drain_seconds))
        configs = [http_config(app, settings) for _ in range(1 if own is None else 2)]
        for config in configs:
            config.load()
        made.append((app, configs))

    try:
        async with started(definition, settings, before_work=http_made) as rt:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, rt.stop.set)
            app, configs = made[0]
            servers = []
            if not settings.http_listen_when_ready or await _until_ready(rt, settings.http_ready_poll_seconds):
                servers.append(await _http_server(configs[0], shared))
                log.info("%s ready: http://%s:%d", definition.name, settings.http_host, shared.getsockname()[1])
                if own is not None:  # after the shared port: what answers here takes the port's connections too
                    servers.append(await _http_server(configs[1], own))
            # and what the start made since (routes, subscribers, servers): a short collection, most is frozen
            gc.collect()
            gc.freeze()
            await rt.stop.wait()
            log.info("%s stopping: draining in-flight work", definition.name)
            await _drain_http([server for server, _ in servers], app, settings.http_drain_seconds)
            for server, _ in servers:
                server.should_exit = True  # the connections left are idle ones: closed; requests in flight finish
            await asyncio.gather(*(task for _, task in servers))
    finally:
        shared.close()
        if own is not None:
            own.close()
            _remove(settings.http_unix_socket)
    log.info("%s stopped", definition.name)


def _remove(path: str) -> None:
    Path(path).unlink(missing_ok=True)


async def _http_server(config: uvicorn.Config, sock: socket.socket) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """uvicorn serving `config`'s app on `sock` (it listens from now on)."""
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"http-{sock.family.name}")
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        await task  # the server could not start: fail loudly
    return server, task


async def _until_ready(rt: Runtime, poll_seconds: float) -> bool:
    """Until every dependency answers (what /readyz says), or the instance is told to stop first (False)."""
    said: dict[str, str] = {}
    while not rt.stop.is_set():
        checks = await rt.readiness()
        if all(v == "ok" for v in checks.values()):
            return True
        if checks != said:  # once per change, not every poll
            log.info("%s not ready yet, not listening on its port: %s", rt.name, checks)
            said = checks
        await wait_any(rt.stop, None, poll_seconds)
    return False


async def _drain_http(servers: list[uvicorn.Server], app: ClosingWhenDraining, within: float) -> None:
    """Stop listening (new connections go to the instances still listening on the shared port), then give the open
    connections up to `within` seconds to leave: each closes after an answer (ClosingWhenDraining)."""
    for server in servers:
        for listener in server.servers:
            listener.close()
    app.drain()
    deadline = time.monotonic() + within
    while any(server.server_state.connections for server in servers) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def main(definition: ServiceDefinition) -> None:
    # uvloop: the same asyncio, about half the per-message overhead of the default loop
    try:
        uvloop.run(serve(definition))
    except (ConnectionRefused, BusConfigError) as exc:  # retrying would not help: say why and stop
        log.error("%s cannot start: %s", definition.name, exc)
        sys.exit(3)
