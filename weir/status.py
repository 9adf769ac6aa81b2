"""`weir status`: one view of a running stack, read from where each figure lives.

- readiness: each service's `GET /readyz` (addresses from `--service NAME=URL`, else `.weir/stack.json`'s `services`);
- streams, consumers and the DLQ: JetStream's stream and consumer info, on the CLI's own connection (`operator`);
  the DLQ's counts by event type are the DLQ stream's per-subject counts (`dlq.<type>`);
- outbox backlogs: the unsent rows of each service's own schema's outbox table;
- the farm: encode's `workers` table (written on every heartbeat encode hears) and the outputs encoding on each
  worker, judged live by the same rule as encode's registry (silent for at most `media_heartbeat_timeout_seconds`,
  not leaving). The operator may neither hear `farm.heartbeat` nor ask `encode.status` (shared/identities.py), and
  the table is what encode itself reloads its registry from;
- the limits store's mode: each auth instance's `/metrics` (`weir_counter_store_mode`, or the older
  `weir_counter_store_shared` gauge), parsed with prometheus_client's parser, so either exposition works;
- the sweep's last run: its ledger (the sweep schema's `runs` table, through services/sweep/store.py).

A figure that cannot be read is null in the document and listed under `unavailable` with the reason; the exit code
is 0 only when nothing is unavailable and every service is ready (`exit_code`).

The module has two halves: plain data and pure functions that shape and draw it (unit-tested), then the reads.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from shared.contracts import DLQ_PREFIX, DLQ_STREAM, DLQ_SUBJECTS  # parked messages live on dlq.<type>
from shared.settings import CommonSettings
from shared.streams import STREAMS

T = TypeVar("T")

# the limits store's mode on auth's /metrics: the gauge the issue names, and the 1/0 gauge auth set before it
MODE_METRIC = "weir_counter_store_mode"
SHARED_METRIC = "weir_counter_store_shared"
MODES = ("shared", "local")


# ================================================================================================ what is read


@dataclass(frozen=True)
class Unavailable:
    """A figure that could not be read, and why (a service down, the database unreachable, a missing stream)."""

    reason: str


@dataclass(frozen=True)
class Readiness:
    url: str
    ready: bool
    status: int | None = None  # the HTTP status of /readyz; None when it did not answer
    checks: dict[str, str] = field(default_factory=dict)
    reason: str | None = None  # why it is not ready


@dataclass(frozen=True)
class StreamState:
    name: str
    messages: int
    bytes: int
    consumers: int


@dataclass(frozen=True)
class ConsumerState:
    stream: str
    name: str
    pending: int  # in the stream and not yet delivered to the consumer
    ack_pending: int  # delivered, not yet acknowledged
    redelivered: int  # delivered more than once and not yet acknowledged
    waiting: int  # pull requests waiting for messages


@dataclass(frozen=True)
class Backlog:
    unsent: int
    oldest_seconds: float | None  # age of the oldest unsent row; None when nothing waits


@dataclass(frozen=True)
class WorkerRow:
    """One worker as encode's table knows it: its last heartbeat's slots, and the outputs encoding on it."""

    name: str
    instance: str
    slots: int
    busy: int
    seen_seconds_ago: float
    leaving: bool


@dataclass(frozen=True)
class Farm:
    workers: tuple[WorkerRow, ...]  # live: heard within the heartbeat timeout and not leaving
    leaving: tuple[WorkerRow, ...]  # heard within the timeout, taking no more offers (SIGTERM)
    heartbeat_timeout_seconds: float

    @property
    def slots(self) -> int:
        return sum(w.slots for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(w.busy for w in self.workers)


@dataclass(frozen=True)
class Snapshot:
    """Everything `weir status` read at `checked_at`; each part is its value or Unavailable."""

    checked_at: datetime
    services: dict[str, Readiness] | Unavailable
    streams: dict[str, StreamState | Unavailable] | Unavailable
    consumers: dict[str, list[ConsumerState] | Unavailable] | Unavailable  # by stream
    dlq: dict[str, int] | Unavailable
    outbox: dict[str, Backlog | Unavailable] | Unavailable  # by service
    farm: Farm | Unavailable
    limits: dict[str, str | Unavailable] | Unavailable  # mode by auth instance
    sweep: dict[str, Any] | Unavailable | None  # the last run (services/sweep/trigger.py report_to_json), or None


# ================================================================================================ pure shaping


def reason_of(exc: BaseException) -> str:
    """An error as one short line: its type, and its message when it has one."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return (f"{name}: {text}" if text else name)[:300]


def service_kind(name: str) -> str:
    """What a named process is: `media-2` is a media worker, `auth` is auth."""
    return name.split("-", 1)[0]


def parse_service_options(options: Iterable[str]) -> dict[str, str]:
    """`NAME=URL` pairs (`--service auth=http://127.0.0.1:8081`); raises ValueError on anything else."""
    found: dict[str, str] = {}
    for option in options:
        name, sep, url = option.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"not NAME=URL with an http(s) URL: {option!r}")
        found[name] = url
    return found


def services_in_stack(info: Mapping[str, Any]) -> dict[str, str]:
    """The service processes `weir up` wrote to .weir/stack.json (`services: {name: url}`)."""
    services = info.get("services") or {}
    return {str(k): str(v).rstrip("/") for k, v in services.items()} if isinstance(services, dict) else {}


def read_stack_file(path: Path) -> dict[str, Any]:
    """stack.json's content ({} when absent or unreadable: no `weir up` beside this shell)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def readiness(url: str, status: int, body: str) -> Readiness:
    """A `/readyz` answer: 200 is ready; otherwise the checks that failed (the 503 problem body lists them)."""
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        parsed = {}
    checks = parsed.get("checks") if isinstance(parsed, dict) else None
    checks = {str(k): str(v) for k, v in checks.items()} if isinstance(checks, dict) else {}
    if status == 200:
        return Readiness(url, True, status, checks)
    failing = [f"{k} {v}" for k, v in checks.items() if v != "ok"]
    detail = "; ".join(failing) or (parsed.get("detail") if isinstance(parsed, dict) else None) or body[:200]
    return Readiness(url, False, status, checks, f"HTTP {status}" + (f": {detail}" if detail else ""))


def unreachable(url: str, exc: BaseException) -> Readiness:
    return Readiness(url, False, None, {}, f"unreachable: {reason_of(exc)}")


def counter_store_mode(exposition: str) -> str:
    """The limits store's mode from auth's /metrics text (either exposition: Weir's own or prometheus_client's).

    `weir_counter_store_mode`: the sample at 1 whose label value is a mode (a labelled gauge or a prometheus_client
    Enum), or a bare value (1 shared, 0 local); `weir_counter_store_shared`: 1 shared, 0 local. Raises ValueError
    when neither series is there."""
    from prometheus_client.parser import text_string_to_metric_families

    by_name = {family.name: family for family in text_string_to_metric_families(exposition)}
    family = by_name.get(MODE_METRIC)
    if family is not None:
        for sample in family.samples:
            labelled = [v for v in sample.labels.values() if v in MODES]
            if labelled and sample.value == 1:
                return labelled[0]
        bare = [s for s in family.samples if not any(v in MODES for v in s.labels.values())]
        if bare:
            return "shared" if bare[0].value == 1 else "local"
    family = by_name.get(SHARED_METRIC)
    if family is not None and family.samples:
        return "shared" if family.samples[0].value == 1 else "local"
    raise ValueError(f"no {MODE_METRIC} (or {SHARED_METRIC}) series on /metrics")


def dlq_counts(subjects: Mapping[str, int] | None) -> dict[str, int]:
    """The DLQ stream's per-subject counts as counts by event type (`dlq.upload.completed` -> `upload.completed`)."""
    counts: dict[str, int] = {}
    for subject, n in (subjects or {}).items():
        if subject.startswith(DLQ_PREFIX) and n:
            event_type = subject[len(DLQ_PREFIX):]
            counts[event_type] = counts.get(event_type, 0) + int(n)
    return dict(sorted(counts.items()))


def farm_view(rows: Iterable[WorkerRow], heartbeat_timeout_seconds: float) -> Farm:
    """Encode's registry rule: a worker is live while its last heartbeat is at most the timeout old and it is not
    leaving; older rows are workers that are gone (encode buries them after that same timeout)."""
    heard = sorted((w for w in rows if w.seen_seconds_ago <= heartbeat_timeout_seconds),
                   key=lambda w: (w.name, w.instance))
    return Farm(workers=tuple(w for w in heard if not w.leaving), leaving=tuple(w for w in heard if w.leaving),
                heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def limits_mode(modes: Iterable[str]) -> str | None:
    """One mode for the stack: shared or local when every auth instance agrees, `mixed` when not."""
    seen = set(modes)
    if not seen:
        return None
    return seen.pop() if len(seen) == 1 else "mixed"


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 3)


def document(s: Snapshot) -> dict[str, Any]:
    """The `--json` document. A figure that could not be read is null, and `unavailable` says why, by its path
    (`outbox.media`, `streams.LIMITS`, `farm`); `ok` is what the exit code says."""

    def part(value: T | Unavailable) -> T | None:
        return None if isinstance(value, Unavailable) else value

    doc: dict[str, Any] = {"checked_at": s.checked_at.isoformat()}

    services = part(s.services)
    doc["services"] = None if services is None else {
        name: {"ready": r.ready, "url": r.url, "status": r.status, "checks": r.checks, "reason": r.reason}
        for name, r in services.items()
    }

    streams = part(s.streams)
    if streams is not None:
        doc["streams"] = []
        for name, st in streams.items():
            got = part(st)
            doc["streams"].append({"name": name, "messages": got.messages if got else None,
                                   "bytes": got.bytes if got else None, "consumers": got.consumers if got else None})
    else:
        doc["streams"] = None

    consumers = part(s.consumers)
    if consumers is not None:
        doc["consumers"] = []
        for listed in consumers.values():
            for c in part(listed) or []:
                doc["consumers"].append({"stream": c.stream, "name": c.name, "pending": c.pending,
                                         "ack_pending": c.ack_pending, "redelivered": c.redelivered,
                                         "waiting": c.waiting})
    else:
        doc["consumers"] = None

    outbox = part(s.outbox)
    if outbox is not None:
        backlogs = {name: part(b) for name, b in outbox.items()}
        doc["outbox"] = {name: b.unsent if b else None for name, b in backlogs.items()}
        doc["outbox_oldest_unsent_seconds"] = {name: _round(b.oldest_seconds) if b else None
                                               for name, b in backlogs.items()}
    else:
        doc["outbox"] = doc["outbox_oldest_unsent_seconds"] = None

    doc["dlq"] = part(s.dlq)

    farm = part(s.farm)
    doc["farm"] = None if farm is None else {
        "workers": len(farm.workers), "slots": farm.slots, "busy": farm.busy, "leaving": len(farm.leaving),
        "heartbeat_timeout_seconds": farm.heartbeat_timeout_seconds,
        "detail": [{"name": w.name, "instance": w.instance, "slots": w.slots, "busy": w.busy,
                    "seen_seconds_ago": _round(w.seen_seconds_ago), "leaving": w.leaving}
                   for w in (*farm.workers, *farm.leaving)],
    }

    limits = part(s.limits)
    if limits is not None:
        instances = {name: part(m) for name, m in limits.items()}
        modes = {name: m for name, m in instances.items() if m is not None}
        # one instance that cannot be read leaves the stack's mode unknown
        doc["limits"] = {"mode": limits_mode(modes.values()) if len(modes) == len(instances) else None,
                         "instances": instances}
    else:
        doc["limits"] = None

    doc["sweep"] = None if isinstance(s.sweep, Unavailable) else {"last_run": s.sweep}

    doc["unavailable"] = document_unavailable(s)
    doc["ok"] = exit_code(s) == 0
    return doc


def not_ready(s: Snapshot) -> list[str]:
    """The services that are not ready (an empty list when the services could not be listed at all)."""
    if isinstance(s.services, Unavailable):
        return []
    return [name for name, r in s.services.items() if not r.ready]


def document_unavailable(s: Snapshot) -> dict[str, str]:
    """Every figure that could not be read, by its path, with why."""
    found: dict[str, str] = {}

    def visit(path: str, value: object) -> None:
        if isinstance(value, Unavailable):
            found[path] = value.reason
        elif isinstance(value, dict) and path != "sweep":
            for key, inner in value.items():
                visit(f"{path}.{key}", inner)

    for name in ("services", "streams", "consumers", "dlq", "outbox", "farm", "limits", "sweep"):
        value = getattr(s, name)
        if name == "services" and not isinstance(value, Unavailable):
            continue  # a service that does not answer is not ready, not unavailable
        visit(name, value)
    return found


def exit_code(s: Snapshot) -> int:
    """0 when every figure was read and every service is ready (at least one was asked); 1 otherwise. A DLQ that
    holds messages, a backlog or the limits store on local windows are figures read, not failures."""
    if document_unavailable(s) or not_ready(s) or isinstance(s.services, Unavailable) or not s.services:
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ drawing


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _na(reason: str) -> Text:
    return Text(f"unavailable: {reason}", style="red")


def render(s: Snapshot) -> RenderableType:
    """The terminal view: one table per part; an unreadable part is one red line with its reason."""
    parts: list[RenderableType] = []
    code = exit_code(s)
    gaps = document_unavailable(s)
    waiting = not_ready(s)
    summary = "everything answered and is ready" if code == 0 else ", ".join(
        ([f"not ready: {', '.join(waiting)}"] if waiting else [])
        + ([f"{len(gaps)} figure(s) unavailable"] if gaps else [])
        + (["no service addresses"] if not isinstance(s.services, Unavailable) and not s.services else []))
    parts.append(Text(f"weir status at {s.checked_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC: {summary}",
                      style="bold green" if code == 0 else "bold red"))

    if isinstance(s.services, Unavailable):
        parts.append(Text.assemble("services: ", _na(s.services.reason)))
    else:
        table = Table("service", "ready", "url", "detail", title="services", title_justify="left")
        for name, r in s.services.items():
            table.add_row(name, Text("ready", "green") if r.ready else Text("NOT READY", "red"), r.url,
                          r.reason or "")
        parts.append(table)

    if isinstance(s.streams, Unavailable):
        parts.append(Text.assemble("streams: ", _na(s.streams.reason)))
    else:
        table = Table("stream", "messages", "consumers", title="streams", title_justify="left")
        for name, st in s.streams.items():
            if isinstance(st, Unavailable):
                table.add_row(name, _na(st.reason), "")
            else:
                table.add_row(name, str(st.messages), str(st.consumers))
        parts.append(table)

    if isinstance(s.consumers, Unavailable):
        parts.append(Text.assemble("consumers: ", _na(s.consumers.reason)))
    else:
        table = Table("stream", "consumer", "pending", "ack pending", "redelivered", title="consumers",
                      title_justify="left")
        for stream, listed in s.consumers.items():
            if isinstance(listed, Unavailable):
                table.add_row(stream, _na(listed.reason), "", "", "")
                continue
            for c in listed:
                table.add_row(c.stream, c.name, str(c.pending), str(c.ack_pending),
                              Text(str(c.redelivered), "yellow" if c.redelivered else ""))
        parts.append(table)

    if isinstance(s.outbox, Unavailable):
        parts.append(Text.assemble("outbox: ", _na(s.outbox.reason)))
    else:
        table = Table("service", "unsent", "oldest unsent", title="outbox", title_justify="left")
        for name, b in s.outbox.items():
            if isinstance(b, Unavailable):
                table.add_row(name, _na(b.reason), "")
            else:
                table.add_row(name, Text(str(b.unsent), "yellow" if b.unsent else ""), _age(b.oldest_seconds))
        parts.append(table)

    if isinstance(s.dlq, Unavailable):
        parts.append(Text.assemble("dlq: ", _na(s.dlq.reason)))
    elif not s.dlq:
        parts.append(Text("dlq: empty"))
    else:
        table = Table("event type", "parked", title="dlq", title_justify="left")
        for event_type, n in s.dlq.items():
            table.add_row(event_type, Text(str(n), "yellow"))
        parts.append(table)

    if isinstance(s.farm, Unavailable):
        parts.append(Text.assemble("farm: ", _na(s.farm.reason)))
    else:
        farm = s.farm
        table = Table("worker", "instance", "slots", "busy", "last heartbeat", title=(
            f"farm: {len(farm.workers)} worker(s), {farm.busy} of {farm.slots} slot(s) busy"
            + (f", {len(farm.leaving)} leaving" if farm.leaving else "")), title_justify="left")
        for w in (*farm.workers, *farm.leaving):
            table.add_row(w.name + (" (leaving)" if w.leaving else ""), w.instance[:12], str(w.slots), str(w.busy),
                          f"{w.seen_seconds_ago:.1f} s ago")
        parts.append(table)

    if isinstance(s.limits, Unavailable):
        parts.append(Text.assemble("limits store: ", _na(s.limits.reason)))
    else:
        line = Text("limits store: ")
        for i, (name, mode) in enumerate(s.limits.items()):
            line.append(", " if i else "")
            if isinstance(mode, Unavailable):
                line.append(f"{name} ")
                line.append_text(_na(mode.reason))
            else:
                line.append(f"{name} {mode}", style="green" if mode == "shared" else "yellow")
        parts.append(line)

    if isinstance(s.sweep, Unavailable):
        parts.append(Text.assemble("sweep: ", _na(s.sweep.reason)))
    elif s.sweep is None:
        parts.append(Text("sweep: no run yet"))
    else:
        run = s.sweep
        retired = sum(int(n) for n in (run.get("retired") or {}).values())
        parts.append(Text(
            f"sweep: last run {run.get('started_at')} ({run.get('trigger')}"
            f"{', dry run' if run.get('dry_run') else ''}): {run.get('outcome')}, examined {run.get('examined')}, "
            f"retired {retired}, errors {run.get('errors')}"))

    return Group(*parts)


# ================================================================================================ the reads


async def read_services(services: Mapping[str, str], timeout: float) -> dict[str, Readiness]:
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(url: str) -> Readiness:
            try:
                r = await http.get(f"{url}/readyz")
            except Exception as exc:  # refused, timed out, not HTTP: the service does not answer
                return unreachable(url, exc)
            return readiness(url, r.status_code, r.text)

        answers = await asyncio.gather(*(one(url) for url in services.values()))
    return dict(zip(services, answers, strict=True))


async def read_limits(services: Mapping[str, str], timeout: float) -> dict[str, str | Unavailable] | Unavailable:
    import httpx

    auths = {name: url for name, url in services.items() if service_kind(name) == "auth"}
    if not auths:
        return Unavailable("no auth service address (its /metrics tells the mode): pass --service auth=URL")

    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(url: str) -> str | Unavailable:
            try:
                r = await http.get(f"{url}/metrics")
                r.raise_for_status()
                return counter_store_mode(r.text)
            except Exception as exc:
                return Unavailable(f"{url}/metrics: {reason_of(exc)}")

        modes = await asyncio.gather(*(one(url) for url in auths.values()))
    return dict(zip(auths, modes, strict=True))


@dataclass(frozen=True)
class BusParts:
    streams: dict[str, StreamState | Unavailable] | Unavailable
    consumers: dict[str, list[ConsumerState] | Unavailable] | Unavailable
    dlq: dict[str, int] | Unavailable

    @classmethod
    def down(cls, reason: str) -> BusParts:
        gone = Unavailable(f"NATS: {reason}")
        return cls(gone, gone, gone)


async def read_bus(settings: CommonSettings, timeout: float) -> BusParts:
    """Streams, consumers and DLQ counts over JetStream's API, as `operator` (its rights: STREAM.INFO, CONSUMER.LIST).
    The declared streams are read one by one: the operator may not list the server's streams."""
    from nats.js.errors import NotFoundError

    from shared.messaging import tool_broker

    try:
        async with asyncio.timeout(timeout * 2), tool_broker(settings, "status", fail_fast=True) as broker:
            js = broker.connection.jetstream(timeout=timeout)
            streams: dict[str, StreamState | Unavailable] = {}
            consumers: dict[str, list[ConsumerState] | Unavailable] = {}
            dlq: dict[str, int] | Unavailable = Unavailable(f"stream {DLQ_STREAM} was not read")
            for spec in STREAMS:
                try:
                    info = await js.stream_info(spec.name)
                except NotFoundError:
                    streams[spec.name] = consumers[spec.name] = Unavailable("stream not found")
                    continue
                except Exception as exc:
                    streams[spec.name] = consumers[spec.name] = Unavailable(reason_of(exc))
                    continue
                streams[spec.name] = StreamState(spec.name, info.state.messages, info.state.bytes,
                                                 info.state.consumer_count)
                consumers[spec.name] = await _consumers(js, spec.name)
            try:
                dlq = dlq_counts((await js.stream_info(DLQ_STREAM, subjects_filter=DLQ_SUBJECTS)).state.subjects)
            except Exception as exc:
                dlq = Unavailable(f"stream {DLQ_STREAM}: {reason_of(exc)}")
            return BusParts(streams, consumers, dlq)
    except Exception as exc:  # no server answers, this identity is refused, or it took too long
        return BusParts.down(reason_of(exc) if not isinstance(exc, TimeoutError) else f"no answer in {timeout * 2:g} s")


async def _consumers(js: Any, stream: str) -> list[ConsumerState] | Unavailable:
    page = 256  # JetStream's page of a consumer listing
    found: list[ConsumerState] = []
    try:
        while True:
            infos = await js.consumers_info(stream, offset=len(found) or None)
            found += [ConsumerState(stream, i.name, i.num_pending or 0, i.num_ack_pending or 0,
                                    i.num_redelivered or 0, i.num_waiting or 0) for i in infos]
            if len(infos) < page:
                return sorted(found, key=lambda c: c.name)
    except Exception as exc:
        return Unavailable(reason_of(exc))


@dataclass(frozen=True)
class DatabaseParts:
    outbox: dict[str, Backlog | Unavailable] | Unavailable
    farm: Farm | Unavailable
    sweep: dict[str, Any] | Unavailable | None

    @classmethod
    def down(cls, reason: str) -> DatabaseParts:
        gone = Unavailable(f"database: {reason}")
        return cls(gone, gone, gone)


_FARM_SQL = (
    "SELECT w.instance, w.name, w.slots, w.leaving,"
    " extract(epoch FROM now() - w.last_seen)::float8 AS seen_seconds_ago,"
    " (SELECT count(*) FROM {schema}.outputs o WHERE o.worker_instance = w.instance AND o.state = 'encoding')::int"
    " AS busy"
    " FROM {schema}.workers w WHERE w.dead_at IS NULL"
)


async def read_database(database_url: str, heartbeat_timeout_seconds: float, timeout: float) -> DatabaseParts:
    """Outbox backlogs, the farm and the sweep's last run, in one read-only connection."""
    import asyncpg

    from shared import db

    try:
        conn = await asyncpg.connect(database_url, timeout=timeout, command_timeout=timeout)
    except Exception as exc:
        return DatabaseParts.down(reason_of(exc))
    try:
        outbox: dict[str, Backlog | Unavailable] = {}
        for service, schema in db.SCHEMAS.items():
            try:
                row = await conn.fetchrow(
                    "SELECT count(*)::bigint AS unsent, extract(epoch FROM now() - min(created_at))::float8 AS oldest"
                    f" FROM {db.quote_ident(schema)}.outbox WHERE sent_at IS NULL")
                outbox[service] = Backlog(int(row["unsent"]), row["oldest"])
            except Exception as exc:
                outbox[service] = Unavailable(reason_of(exc))
        farm: Farm | Unavailable
        try:
            rows = await conn.fetch(_FARM_SQL.format(schema=db.quote_ident(db.SCHEMAS["encode"])))
            farm = farm_view((WorkerRow(r["name"], r["instance"], r["slots"], r["busy"], r["seen_seconds_ago"],
                                        r["leaving"]) for r in rows), heartbeat_timeout_seconds)
        except Exception as exc:
            farm = Unavailable(reason_of(exc))
        sweep: dict[str, Any] | Unavailable | None
        try:
            sweep = await _last_run(conn, db.quote_ident(db.SCHEMAS["sweep"]))
        except Exception as exc:
            sweep = Unavailable(reason_of(exc))
        return DatabaseParts(outbox, farm, sweep)
    except Exception as exc:  # the connection broke under us
        return DatabaseParts.down(reason_of(exc))
    finally:
        try:
            await conn.close(timeout=timeout)
        except Exception:  # what was read is read; a failed close changes none of it
            conn.terminate()


async def _last_run(conn: Any, schema: str) -> dict[str, Any] | None:
    """The sweep ledger's newest run, read by the sweep's own store (its table, its JSON counters)."""
    from services.sweep import store as sweep_store
    from services.sweep.trigger import report_to_json

    async with conn.transaction(readonly=True):
        await conn.execute(f"SET LOCAL search_path TO {schema}")
        runs = await sweep_store.recent_runs(conn, 1)
    return report_to_json(runs[0]) if runs else None


async def read_snapshot(settings: CommonSettings, services: Mapping[str, str] | Unavailable, *,
                        heartbeat_timeout_seconds: float, timeout: float) -> Snapshot:
    """Every part at once; each read waits at most about `timeout` s and never raises."""
    checked_at = datetime.now(UTC)
    addresses: Mapping[str, str] = {} if isinstance(services, Unavailable) else services
    ready, limits, bus, database = await asyncio.gather(
        read_services(addresses, timeout),
        read_limits(addresses, timeout),
        read_bus(settings, timeout),
        read_database(settings.database_url, heartbeat_timeout_seconds, timeout),
    )
    return Snapshot(
        checked_at=checked_at, services=services if isinstance(services, Unavailable) else ready,
        streams=bus.streams, consumers=bus.consumers, dlq=bus.dlq, outbox=database.outbox, farm=database.farm,
        limits=services if isinstance(services, Unavailable) else limits, sweep=database.sweep,
    )


def service_addresses(options: Sequence[str], stack_json: Path) -> dict[str, str] | Unavailable:
    """`--service` options when given (they name every service to ask), else the services `weir up` wrote to
    stack.json; Unavailable when neither names one. Raises ValueError on a malformed option."""
    given = parse_service_options(options)
    if given:
        return given
    found = services_in_stack(read_stack_file(stack_json))
    if found:
        return found
    return Unavailable(f"no service addresses: no `services` in {stack_json} (is `weir up` running here?) and no "
                       "--service NAME=URL (or WEIR_STATUS_SERVICES)")
