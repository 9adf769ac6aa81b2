"""The `weir` command: run the stack, apply streams and migrations, replay, print settings, show status, trace a
video."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from services.sweep.cli import sweep_app
from shared.settings import STACK_FILE_ENV, CommonSettings, local_stack_settings, redact, stack_file
from weir.contracts_cli import contracts_app, release_command
from weir.dlq_cli import dlq_app
from weir.nats_cli import echo as _echo
from weir.nats_cli import nats_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Weir: the developer video API back end.")
streams_app = typer.Typer(no_args_is_help=True, help="JetStream streams, from the one declaration.")
events_app = typer.Typer(no_args_is_help=True, help="The event catalog and its schema snapshots.")
accounts_app = typer.Typer(no_args_is_help=True, help="Accounts (each with one user and its account token).")
apps_app = typer.Typer(no_args_is_help=True, help="Apps of an account; each gets a secret and a publishable key.")
keys_app = typer.Typer(no_args_is_help=True, help="Keys of an app: list, rotate, revoke.")
storage_app = typer.Typer(no_args_is_help=True, help="The S3 bucket's settings (CORS for browser uploads).")
app.add_typer(streams_app, name="streams")
app.add_typer(storage_app, name="storage")
app.add_typer(events_app, name="events")
edge_app = typer.Typer(no_args_is_help=True, help="The edge: HAProxy in front of the api (weir/edge.py).")
app.add_typer(edge_app, name="edge")
app.add_typer(accounts_app, name="accounts")
app.add_typer(apps_app, name="apps")
app.add_typer(keys_app, name="keys")
app.add_typer(sweep_app, name="sweep")
app.add_typer(contracts_app, name="contracts")
app.add_typer(dlq_app, name="dlq")
app.add_typer(nats_app, name="nats")
app.command("release")(release_command)
console = Console()

SERVICE_SETTINGS = {
    "auth": "services.auth.settings:AuthSettings",
    "api": "services.api.settings:ApiSettings",
    "encode": "services.encode.settings:EncodeSettings",
    "media": "services.media.settings:MediaSettings",
    "sweep": "services.sweep.settings:SweepSettings",
    "webhooks": "services.webhooks.settings:WebhookSettings",
}


# the tools' own settings, for `weir config`: each its own prefix; the edge's beside the api's shedding it inherits
TOOL_SETTINGS = {
    "rollout": "weir.rollout:RolloutSettings",
    "dlq": "weir.deadletters:DeadLetterSettings",
    "edge": "weir.edge:EdgeSettings",
    "supervise": "weir.supervise:SuperviseSettings",
}


def settings_class(service: str) -> type[CommonSettings]:
    module, _, name = SERVICE_SETTINGS[service].partition(":")
    cls: type[CommonSettings] = getattr(importlib.import_module(module), name)
    return cls


def _tool_settings_class(tool: str) -> type[BaseSettings]:
    module, _, name = TOOL_SETTINGS[tool].partition(":")
    cls: type[BaseSettings] = getattr(importlib.import_module(module), name)
    return cls


def _settings() -> CommonSettings:
    """Addresses from the environment, else from a running `weir up` (.weir/stack.json); the CLI connects to NATS as
    `operator` (its seed from the stack's, unless the environment names one)."""
    return CommonSettings(**local_stack_settings())


def _unreachable(settings: CommonSettings, exc: BaseException, what: str = "NATS") -> typer.Exit:
    """A command that found no server: one line saying where it looked and how to point it elsewhere (exit 1)."""
    where = settings.nats_url if what == "NATS" else "WEIR_DATABASE_URL's address"
    console.print(f"[red]{what} does not answer at {where} ({type(exc).__name__}: {exc}): is the stack running? A "
                  f"`weir up` elsewhere: set {STACK_FILE_ENV} to its stack.json (`--data-dir D`: D/stack.json); a "
                  f"deployment: WEIR_NATS_URL, WEIR_NATS_NKEY_SEED and WEIR_DATABASE_URL.[/red]", soft_wrap=True)
    return typer.Exit(1)


def _run_tool(settings: CommonSettings, go: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """`go()` on its own loop; no NATS there (the tool broker made with fail_fast) ends the command in one line."""
    from nats.errors import NoServersError

    try:
        return asyncio.run(go())
    except (OSError, NoServersError) as exc:
        raise _unreachable(settings, exc) from exc


@app.command()
def up(
    media: Annotated[int, typer.Option(help="number of media workers")] = 1,
    external: Annotated[bool, typer.Option(help="use WEIR_NATS_URL, WEIR_DATABASE_URL, WEIR_S3_ENDPOINT")] = False,
    data_dir: Annotated[Path, typer.Option(help="where servers keep their data")] = Path(".weir"),
    api_port: Annotated[int, typer.Option(help="port of the public API (default 8080, or a free one)")] = 0,
    nats_cluster: Annotated[int, typer.Option(min=1, max=5, help="NATS nodes: 1, or a JetStream cluster of N "
                                              "(3: streams at 3 replicas)")] = 1,
    edge: Annotated[bool, typer.Option(help="HAProxy (Debian's haproxy) on the public port in front of the api: "
                                       "refuses what the api cannot answer in time before it reaches the api "
                                       "(WEIR_EDGE_*; weir/edge.py)")] = False,
) -> None:
    """Start NATS, PostgreSQL and S3 (embedded), the streams and migrations, then every service; a service that dies
    is started again (WEIR_SUPERVISE_*)."""
    from weir.up import up as run_up

    raise typer.Exit(run_up(data_dir, media=media, external=external, api_port=api_port or None, out=_echo,
                            nats_cluster=nats_cluster, edge=edge))


@edge_app.command("config")
def edge_config_command(
    out: Annotated[Path, typer.Option(help="folder for haproxy.cfg and the files it names")] = Path("deploy/edge"),
    api: Annotated[list[str] | None, typer.Option(help="an api instance's HOST:PORT (repeatable; default: "
                                                  "compose's `api` service, resolved by DNS)")] = None,
    replicas: Annotated[int, typer.Option(help="with one --api name: how many instances DNS may give (0: the "
                                          "addresses as given)")] = -1,
    bind: Annotated[str, typer.Option(help="where the edge takes the public's requests")] = "",
    admin_bind: Annotated[str, typer.Option(help="where it serves /metrics, /healthz, /readyz")] = "",
    files_dir: Annotated[str, typer.Option(help="where HAProxy finds the files (default: compose's mount)")] = "",
) -> None:
    """Write the edge's HAProxy config, from the api's routes and the WEIR_EDGE_*/WEIR_SHED_* settings. Its
    defaults are compose.yaml's `edge` service (`weir edge config` writes deploy/edge/, which it mounts). HAProxy
    reads the internal token from WEIR_INTERNAL_TOKEN, as the services do."""
    from weir.edge import COMPOSE, EdgeSettings, edge_files, write_files

    given = {"apis": tuple(api or ()), "replicas": replicas if replicas >= 0 else None, "bind": bind,
             "admin_bind": admin_bind, "files_dir": files_dir}
    chosen: dict[str, Any] = {**COMPOSE, **{k: v for k, v in given.items() if v not in ("", (), None)}}
    if api and replicas < 0:
        chosen["replicas"] = 0
    files = edge_files(settings=EdgeSettings(), **chosen)
    _echo(f"wrote {write_files(out, files)} and {len(files) - 1} files it names")


@app.command()
def rollout(
    services: Annotated[list[str] | None, typer.Argument(help="api, auth, encode, media, sweep")] = None,
    every: Annotated[bool, typer.Option("--all", help="every service of the stack, in turn")] = False,
    data_dir: Annotated[Path | None, typer.Option(help="the running `weir up`'s data dir (default: WEIR_STACK's "
                                                  "folder, else .weir)")] = None,
    ready_timeout: Annotated[float, typer.Option(help="seconds a new instance gets to be ready (default: "
                                                 "WEIR_ROLLOUT_READY_TIMEOUT_SECONDS, 60)")] = 0,
    env: Annotated[list[str] | None, typer.Option(help="NAME=VALUE for the new instances (kept from then on): a "
                                                  "changed setting rolled out; repeatable")] = None,
) -> None:
    """Replace a running service's instances one at a time with the code on disk: start the new one, wait until it
    is ready, drain the old one (WEIR_ROLLOUT_*). A new instance that is not ready is stopped; the old one serves."""
    from weir.rollout import RolloutSettings, rollout_command

    settings = RolloutSettings()
    if ready_timeout:
        settings = settings.model_copy(update={"ready_timeout_seconds": ready_timeout})
    pairs = [item.partition("=") for item in env or []]
    if any(not name or not eq for name, eq, _ in pairs):
        raise typer.BadParameter("--env takes NAME=VALUE")
    stack_json = data_dir / "stack.json" if data_dir is not None else stack_file()
    raise typer.Exit(rollout_command(services or [], every=every, stack_json=stack_json,
                                     settings=settings, out=_echo, env={name: value for name, _, value in pairs}))


@streams_app.command("apply")
def streams_apply(
    restart: Annotated[list[str] | None, typer.Option(
        "--restart", help="a publisher's durable (e.g. acme_videos_acme1) to start over, once per durable: the team "
        "asks, it may not touch its consumers itself")] = None,
    since: Annotated[str | None, typer.Option(help="with --restart: from this time (ISO 8601, UTC unless given); "
                                              "default: the stream's start")] = None,
) -> None:
    """Create or update every stream to match the declaration in shared/streams.py; make or widen every service's
    durable to the subjects this release reads (never narrowed: the release before may still read it); then the
    publishers' durables (the stack's publisher and the teams of WEIR_NATS_TEAMS_FILE): pull, made by the operator,
    never by a team; a lost account's removed, and any push consumer on a public stream."""
    from shared.consumer import apply_service_durables
    from shared.messaging import tool_broker
    from shared.streams import apply_streams
    from weir.natsdeploy import CredentialsError
    from weir.readerdurables import apply_reader_durables

    if since is not None and not restart:
        raise typer.BadParameter("--since goes with --restart DURABLE")
    start = _parse_time(since) if since is not None else None
    restarts = dict.fromkeys(restart or [], start)

    settings = _settings()

    async def go() -> list[str]:
        # stream management is JetStream's API, on its connection; no NATS: say so, never retry for ever
        async with tool_broker(settings, "cli", fail_fast=True) as broker:
            js = broker.connection.jetstream()
            return [*await apply_streams(js, settings), *await apply_service_durables(js, settings),
                    *await apply_reader_durables(js, settings, restarts=restarts)]

    try:
        lines = _run_tool(settings, go)
    except (CredentialsError, ValueError) as exc:
        console.print(f"[red]weir streams apply: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from exc
    for line in lines:
        console.print(line)


@storage_app.command("apply")
def storage_apply() -> None:
    """Set the bucket's CORS rules (PUT of parts, GET/HEAD with Range, from any origin, ETag exposed); once per
    deploy, like `weir streams apply`."""
    from shared.storage import apply_bucket_cors, s3_client

    settings = _settings()

    async def go() -> bool:
        async with s3_client(settings) as s3:
            return await apply_bucket_cors(s3, settings.s3_bucket)

    changed = asyncio.run(go())
    console.print(f"{'set' if changed else 'unchanged'} CORS rules of bucket {settings.s3_bucket}")


@app.command()
def migrate(services: Annotated[list[str] | None, typer.Argument(help="services (default: all)")] = None) -> None:
    """Apply every service's pending migrations to its own schema."""
    import asyncpg

    from shared import db

    async def go() -> list[str]:
        conn = await asyncpg.connect(_settings().database_url)
        try:
            done: list[str] = []
            for service in services or list(db.SCHEMAS):
                done += await db.migrate(conn, service)
            return done
        finally:
            await conn.close()

    done = asyncio.run(go())
    for line in done:
        console.print(f"applied {line}")
    if not done:
        console.print("nothing to apply")


@app.command()
def config(
    service: Annotated[str | None, typer.Option(help="one service only")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """Print every setting of every service, then the tools' (rollout, dlq, edge, supervise): variable, default,
    current value (this shell's environment, with a running `weir up`'s addresses where it sets none)."""
    names = [*SERVICE_SETTINGS, *TOOL_SETTINGS]
    if service is not None and service not in names:
        raise typer.BadParameter(f"no service or tool {service!r} (one of: {', '.join(names)})", param_hint="--service")
    stack = local_stack_settings()
    rows: list[dict[str, str]] = []
    for name in [service] if service else names:
        cls: type[BaseSettings] = settings_class(name) if name in SERVICE_SETTINGS else _tool_settings_class(name)
        prefix = str(cls.model_config.get("env_prefix", ""))
        fields = cls.model_fields
        if name in TOOL_SETTINGS:  # a tool's own settings (the edge inherits the api's shedding: shown there)
            fields = {k: v for k, v in fields.items() if k in cls.__annotations__}
        current = cls(**{k: v for k, v in stack.items() if k in cls.model_fields})
        for field_name, info in fields.items():
            default = info.get_default(call_default_factory=True)
            value = getattr(current, field_name)
            secret = "secret" in field_name or "token" in field_name or "password" in field_name
            rows.append(
                {
                    "service": name,
                    "variable": f"{prefix}{field_name.upper()}",
                    "default": _show(default, secret),
                    "current": _show(value, secret),
                    "description": info.description or "",
                }
            )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("service", "variable", "default", "current", "description")
    for r in rows:
        style = "bold" if r["default"] != r["current"] else ""
        table.add_row(r["service"], r["variable"], r["default"], r["current"], r["description"], style=style)
    console.print(table)


def _show(value: object, secret: bool) -> str:
    """A setting's value as `weir config` prints it: a text under a secret-like name that is not typed secret is
    never printed (a number or a flag is no secret: WEIR_LIMIT_UPLOAD_TOKEN_PER_MINUTE)."""
    shown = redact(value)
    if secret and isinstance(value, str):
        return "(set)" if value else "(unset)"
    return str(shown)


def _parse_time(value: str) -> datetime:
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise typer.BadParameter(f"not an ISO 8601 time: {value!r}") from exc
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


@app.command()
def replay(
    stream: Annotated[str, typer.Option(help="stream to read, e.g. VIDEOS")],
    subject: Annotated[str, typer.Option(help="event type, e.g. upload.completed")],
    since: Annotated[str, typer.Option(help="start of the slice (ISO 8601)")],
    until: Annotated[str | None, typer.Option(help="end of the slice (ISO 8601; default: now)")] = None,
    to: Annotated[list[str] | None, typer.Option(help="consumer(s) to deliver to (default: every consumer)")] = None,
    dry_run: Annotated[bool, typer.Option(help="count the slice, deliver nothing")] = False,
    reprocess: Annotated[bool, typer.Option(help="run the handlers again even for events already handled")] = False,
    inbox_schema: Annotated[list[str] | None, typer.Option(
        "--inbox-schema", metavar="CONSUMER=SCHEMA", help="with --dry-run: where a consumer's inbox is, when it is "
        "not a declared consumer in its service's schema (once per consumer)")] = None,
) -> None:
    """Re-deliver a time slice of a stream to a consumer. With --dry-run: the slice counted, and for each consumer
    how many of its events it has handled already (its inbox) and how many it would apply."""
    from shared.messaging import tool_broker
    from shared.publishers import EventPublishers
    from shared.replay import ReplayError
    from shared.replay import replay as run_replay
    from weir.dlq_cli import inbox_reader

    overrides = _inbox_overrides(inbox_schema)
    settings = _settings()

    async def go() -> None:
        async with (tool_broker(settings, "replay", fail_fast=True) as broker,
                    inbox_reader(dry_run, overrides) as handled):
            publishers = EventPublishers(broker, replay=True, timeout=settings.bus_publish_timeout_seconds)
            with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), console=console) as bar:
                task = bar.add_task("replay", total=None)
                report = await run_replay(
                    publishers, stream=stream, subject=subject, since=_parse_time(since),
                    until=_parse_time(until) if until else None, to=to, dry_run=dry_run, reprocess=reprocess,
                    progress=lambda done, total: bar.update(task, completed=done, total=total), handled=handled,
                )
        verb = "would deliver" if dry_run else "delivered"
        console.print(
            f"{report.matched} events of {subject} on {stream} (seq {report.first_seq}..{report.last_seq}); "
            f"{verb} to {', '.join(report.consumers) or 'no consumer'}"
            + ("" if dry_run else f"; replay id {report.replay_id}")
            + (" (reprocess)" if reprocess and not dry_run else "")
        )
        if report.no_replays:
            console.print(f"not to {', '.join(report.no_replays)}: they read {subject} but take no replays (an "
                          "operator-made publisher's durable)")
        for consumer in report.consumers if dry_run else ():
            applied = report.would_apply(consumer, reprocess)
            console.print(f"{consumer}: inbox not readable, handled unknown" if applied is None else
                          f"{consumer}: {report.handled.get(consumer, 0)} handled already, would apply {applied}")

    try:
        _run_tool(settings, go)
    except ReplayError as exc:
        console.print(f"[red]replay: {exc}[/red]")
        raise typer.Exit(2) from exc


@app.command()
def rebuild(
    projection: Annotated[str, typer.Argument(help="the projection: api-status (the api's video status, from "
                                              "encode's events)")],
    schema: Annotated[str | None, typer.Option(help="the api's schema (default: its own)")] = None,
    consumer: Annotated[str, typer.Option(help="the consumer whose inbox says which events were handled")]
    = "api_status",
) -> None:
    """Rebuild a projection from the start of its stream into a fresh table and swap it in, in one transaction
    under the rows' locks, beside the running service (services/api/rebuild.py says how)."""
    import asyncpg

    from services.api.rebuild import rebuild_status
    from shared import db
    from shared.messaging import tool_broker

    if projection != "api-status":
        raise typer.BadParameter("the projections that can be rebuilt: api-status", param_hint="PROJECTION")
    settings = _settings()
    where = schema or db.SCHEMAS["api"]

    async def go() -> Any:
        try:
            conn = await asyncpg.connect(settings.database_url, timeout=10,
                                         server_settings={"search_path": f"{db.quote_ident(where)}, public"})
        except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
            raise _unreachable(settings, exc, "PostgreSQL") from exc
        try:
            if await conn.fetchval("SELECT to_regclass('videos')") is None:
                raise typer.BadParameter(f"schema {where!r} has no videos table (the api's schema: "
                                         f"{db.SCHEMAS['api']})", param_hint="--schema")
            async with tool_broker(settings, "rebuild", fail_fast=True) as broker:
                return await rebuild_status(broker.connection.jetstream(), conn, consumer=consumer)
        finally:
            await conn.close()

    report = _run_tool(settings, go)
    console.print(f"read {report.read} events of {report.stream} (to seq {report.last_seq}), {report.handled} handled "
                  f"by {consumer}; rebuilt and swapped in {report.videos} videos"
                  + (f"; left as they were: {len(report.left)} ({', '.join(report.left[:10])})" if report.left else ""))


def _inbox_overrides(pairs: list[str] | None) -> dict[str, str]:
    from weir.inboxes import parse_overrides

    try:
        return parse_overrides(pairs or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--inbox-schema") from exc


@app.command()
def status(
    watch: Annotated[bool, typer.Option("--watch", help="redraw every --interval seconds until Ctrl-C")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable (with --watch: one document a line)")]
    = False,
    service: Annotated[list[str] | None, typer.Option(
        "--service", envvar="WEIR_STATUS_SERVICES", metavar="NAME=URL",
        help="a service process to ask (its /readyz; auth's /metrics for the limits store's mode), once per "
             "process; names like media-2 are instances of media. Given: these only; else the services of "
             "--stack. WEIR_STATUS_SERVICES takes them space-separated")] = None,
    stack: Annotated[Path | None, typer.Option(help="the running `weir up`'s stack file: service addresses, and "
                                               "the NATS, database addresses and seeds where WEIR_* sets none "
                                               "(default: WEIR_STACK, else .weir/stack.json)")] = None,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between redraws with --watch")] = 2.0,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds each read may take before it counts as "
                                           "unavailable")] = 5.0,
    top: Annotated[int, typer.Option(min=1, help="how many of the callers refused 429 most lately to show")] = 10,
) -> None:
    """One view of a running stack: readiness and release (version, commit) of each instance, streams and consumers
    (pending, redelivered), outbox backlogs, DLQ counts by event type, the farm's workers and slots, the limits
    store's mode, who is throttled (the callers refused 429 most in auth's last windows, all instances together;
    read with WEIR_INTERNAL_TOKEN, or the --stack's), the sweep's last run, the webhooks' endpoints and deliveries
    (pending, failed in the last hour, oldest waiting). Several versions running at once, webhook deliveries falling
    behind, or Weir's own internal traffic refused 429 is a warning, not a failure.

    Exit code 0 when every figure could be read and every service is ready, 1 otherwise (a figure that cannot be
    read shows as unavailable, with its reason). With --watch, Ctrl-C ends it with 0."""
    from services.encode.settings import EncodeSettings
    from services.webhooks.settings import WebhookSettings
    from weir.status.gather import read_snapshot
    from weir.status.model import Snapshot
    from weir.status.render import render
    from weir.status.services import service_addresses
    from weir.status.verdict import document, exit_code

    stack = stack or stack_file()
    try:
        addresses = service_addresses(service or [], stack)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--service") from exc
    # encode's settings: the addresses every part needs, and the heartbeat timeout that makes a worker live
    settings = EncodeSettings(**local_stack_settings(stack))
    # a delivery that may go waits at most a scan, an attempt before it (the timeout) and a dead instance's claim
    hooks = WebhookSettings(**local_stack_settings(stack))
    late_after = (hooks.webhook_scan_seconds + hooks.webhook_delivery_timeout_seconds
                  + hooks.webhook_claim_grace_seconds)

    async def snapshot() -> Snapshot:
        return await read_snapshot(settings, addresses, timeout=timeout,
                                   heartbeat_timeout_seconds=settings.media_heartbeat_timeout_seconds,
                                   webhook_late_after_seconds=late_after, throttled_top=top)

    def show(snap: Snapshot, *, live: bool) -> None:
        if as_json:
            print(json.dumps(document(snap), indent=None if live else 2), flush=True)
            return
        if live:
            console.clear()
        console.print(render(snap))

    if not watch:
        snap = asyncio.run(snapshot())
        show(snap, live=False)
        raise typer.Exit(exit_code(snap))

    async def forever() -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            show(await snapshot(), live=True)
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))  # one view every interval

    try:
        asyncio.run(forever())
    except KeyboardInterrupt:  # Ctrl-C is how --watch ends
        pass


@app.command()
def trace(
    video_id: Annotated[str, typer.Argument(help="the video's id")],
    directory: Annotated[Path | None, typer.Option(
        "--dir", help="the trace files (WEIR_TRACES_DIR of the stack's services; default: `traces` beside the "
        "stack file, WEIR_STACK's or .weir/stack.json)", envvar="WEIR_TRACES_DIR")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the traces as one JSON document")] = False,
    everything: Annotated[bool, typer.Option("--all", help="database queries and FastStream's plumbing spans too")]
    = False,
) -> None:
    """A video's journey through the stack, from its services' trace files: one tree per trace (the create request,
    the upload's completion, the outbox relay, encode's handling and dispatch rounds, each media job, the events
    published), with each span's service, start and duration.

    Exit code 0 when some span concerns the video, 1 otherwise."""
    from weir import trace as traces

    directory = directory or stack_file().parent / "traces"  # where `weir up --data-dir D` has its services write
    if not traces.trace_files(directory):
        typer.echo(f"no trace files in {directory} (the services write them when WEIR_TRACES_DIR is set)", err=True)
        raise typer.Exit(1)
    trees = traces.journey(traces.read_spans(directory), video_id, everything=everything)
    if as_json:
        typer.echo(json.dumps(traces.as_json(trees, video_id), indent=2))
    else:
        typer.echo(traces.render(trees, video_id))
    if not trees:
        raise typer.Exit(1)


@events_app.command("snapshot")
def events_snapshot() -> None:
    """Record the JSON Schema of every event's current version (refuses incompatible changes)."""
    from shared.events.compat import DEFAULT_SCHEMAS_DIR, write_snapshots

    try:
        written = write_snapshots(DEFAULT_SCHEMAS_DIR)
    except Exception as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    for path in written:
        console.print(f"wrote {path}")
    if not written:
        console.print("every snapshot is up to date")


@events_app.command("check")
def events_check() -> None:
    """Fail when an event model changed incompatibly or lacks its snapshot, or when a service's AsyncAPI document
    (FastStream's, as the service serves it) shows an event schema other than the catalog's snapshot."""
    from shared.events.compat import DEFAULT_SCHEMAS_DIR, check_catalog
    from shared.events.documents import check_documents, check_routing

    documents = service_documents()
    problems = (check_catalog(DEFAULT_SCHEMAS_DIR) + check_documents(documents, DEFAULT_SCHEMAS_DIR)
                + check_routing(documents))
    for p in problems:
        console.print(f"[red]{p}[/red]", soft_wrap=True)
    if problems:
        raise typer.Exit(1)
    console.print(f"catalog compatible with its snapshots; the AsyncAPI documents of {', '.join(documents)} show "
                  "the catalog's schemas, and the events shared/contracts.py declares")


def service_documents() -> dict[str, dict[str, Any]]:
    """Each service's AsyncAPI document of its events, declared as the running service declares them (no server)."""
    from shared.runtime import ServiceDefinition, messaging_document

    documents: dict[str, dict[str, Any]] = {}
    for service in SERVICE_SETTINGS:
        definition = importlib.import_module(f"services.{service}.app").SERVICE
        assert isinstance(definition, ServiceDefinition)
        documents[service] = messaging_document(definition)
    return documents


CLI_PEER = "weir-cli"  # the address auth limits the CLI's management calls by (not an IP: no HTTP client has it)
AccountToken = Annotated[str, typer.Option(envvar="WEIR_ACCOUNT_TOKEN", help="the account token (wat_...)")]


def _auth_call(work: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run `work(nc)` against auth, `nc` the tool broker's connection (shared.authclient asks over nats-py's
    request); auth's refusals become a one-line error and exit code 2, a reply this release cannot read (auth at
    another release that broke its contract) one naming the subject and both releases, and exit code 1."""
    from nats.errors import NoServersError

    from shared.authclient import AuthError
    from shared.messaging import UnreadableReply, tool_broker, unreadable_shown_by_caller

    settings = _settings()

    async def go() -> Any:
        async with tool_broker(settings, "cli", fail_fast=True) as broker:  # no stack: say so, never retry for ever
            return await work(broker.connection)

    try:
        with unreadable_shown_by_caller():
            return asyncio.run(go())
    except (OSError, NoServersError) as exc:
        raise _unreachable(settings, exc) from exc
    except AuthError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    except UnreadableReply as exc:
        console.print(f"[red]auth answered what this CLI cannot read, {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from exc


async def _acting_user(nc: Any, account_token: str, operation: str | None) -> Any:
    """Who the account token is, through the same auth.check (and limits) as the HTTP routes."""
    from shared.authcheck import CheckRequest, ManageError
    from shared.authclient import AuthError, check

    reply = await check(nc, CheckRequest(
        # no HTTP peer: the CLI's own address key, so that it neither spends nor is refused by 127.0.0.1's budgets
        authorization=f"Bearer {account_token}", peer=CLI_PEER, route_class="management",
        route=f"cli {operation or 'manage'}", operation=operation,
    ))
    if not reply.allowed or reply.identity is None:
        problem = reply.problem or {}
        raise AuthError(ManageError(status=reply.status, code=str(problem.get("code", "refused")),
                                    detail=str(problem.get("detail", ""))))
    return reply.identity


@accounts_app.command("create")
def accounts_create(name: str, user: Annotated[str, typer.Option(help="the first user's name")] = "owner") -> None:
    """Create an account and its first user; prints the account token once."""
    from shared.authcheck import AccountCreated, CreateAccount
    from shared.authclient import manage

    created = _auth_call(lambda nc: manage(nc, "account.create", CreateAccount(name=name, user_name=user),
                                           AccountCreated))
    console.print(f"account {created.account_id} (user {created.user_id})")
    console.print(f"account token (shown once): {created.account_token}")


@apps_app.command("create")
def apps_create(
    name: str,
    account_token: AccountToken,
    origin: Annotated[list[str] | None, typer.Option(help="allowed browser origin for SDK routes")] = None,
) -> None:
    """Create an app with a secret and a publishable key (shown once)."""
    from shared.authcheck import AppCreated, CreateApp
    from shared.authclient import manage

    async def work(nc: Any) -> AppCreated:
        who = await _acting_user(nc, account_token, "app_create")
        req = CreateApp(user_id=who.user_id, account_id=who.account_id, name=name, allowed_origins=tuple(origin or ()))
        return await manage(nc, "app.create", req, AppCreated)

    print(_auth_call(work).model_dump_json(indent=2))


@keys_app.command("rotate")
def keys_rotate(app_id: str, account_token: AccountToken) -> None:
    """Mint a new key pair for the app and revoke the old one."""
    from shared.authcheck import KeyPair, RotateKeys
    from shared.authclient import manage

    async def work(nc: Any) -> KeyPair:
        who = await _acting_user(nc, account_token, "key_rotate")
        return await manage(nc, "keys.rotate", RotateKeys(user_id=who.user_id, account_id=who.account_id,
                                                          app_id=app_id), KeyPair)

    print(_auth_call(work).model_dump_json(indent=2))


@keys_app.command("revoke")
def keys_revoke(key_id: str, account_token: AccountToken) -> None:
    """Revoke one key; every auth instance refuses it within a second."""
    from shared.authcheck import KeyRevocation, RevokeKey
    from shared.authclient import manage

    async def work(nc: Any) -> KeyRevocation:
        who = await _acting_user(nc, account_token, None)
        return await manage(nc, "key.revoke", RevokeKey(user_id=who.user_id, account_id=who.account_id,
                                                        key_id=key_id), KeyRevocation)

    result: KeyRevocation = _auth_call(work)
    console.print("already revoked" if result.already else f"revoked {key_id}")


@keys_app.command("list")
def keys_list(app_id: str, account_token: AccountToken,
              as_json: Annotated[bool, typer.Option("--json", help="the list as JSON")] = False) -> None:
    """The app's keys: id, kind, prefix, created, revoked."""
    from shared.authcheck import KeyList, ListKeys
    from shared.authclient import manage

    async def work(nc: Any) -> KeyList:
        who = await _acting_user(nc, account_token, None)
        return await manage(nc, "keys.list", ListKeys(account_id=who.account_id, app_id=app_id), KeyList)

    listed: KeyList = _auth_call(work)
    if as_json:
        print(listed.model_dump_json(indent=2))
        return
    table = Table("id", "kind", "prefix", "created_at", "revoked_at")
    table.columns[0].no_wrap = True  # whole, to copy into `weir keys revoke` (on a narrow terminal others fold)
    table.columns[0].min_width = 36
    for k in listed.keys:
        table.add_row(k.id, k.kind, k.prefix, k.created_at, k.revoked_at or "")
    console.print(table)


def main() -> None:
    try:
        app()
    except Exception as exc:
        from shared.natsconn import BusConfigError, ConnectionRefused  # here: importing NATS costs every command

        if not isinstance(exc, ConnectionRefused | BusConfigError):
            raise
        print(f"weir: {exc}", file=sys.stderr)  # NATS refused this identity, or its settings cannot work
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
