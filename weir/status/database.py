"""What the database holds: each service's outbox backlog, the farm (encode's `workers` table, judged live by encode's
registry rule), the sweep's last run (its ledger) and the webhooks' endpoints and deliveries, in one read-only
connection."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from weir.status.model import Backlog, Farm, Unavailable, WebhookDeliveries, WorkerRow, reason_of


def farm_view(rows: Iterable[WorkerRow], heartbeat_timeout_seconds: float) -> Farm:
    """Encode's registry rule: a worker is live while its last heartbeat is at most the timeout old and it is not
    leaving; older rows are workers that are gone (encode buries them after that same timeout)."""
    heard = sorted((w for w in rows if w.seen_seconds_ago <= heartbeat_timeout_seconds),
                   key=lambda w: (w.name, w.instance))
    return Farm(workers=tuple(w for w in heard if not w.leaving), leaving=tuple(w for w in heard if w.leaving),
                heartbeat_timeout_seconds=heartbeat_timeout_seconds)


@dataclass(frozen=True)
class DatabaseParts:
    outbox: dict[str, Backlog | Unavailable] | Unavailable
    farm: Farm | Unavailable
    sweep: dict[str, Any] | Unavailable | None
    webhooks: WebhookDeliveries | Unavailable

    @classmethod
    def down(cls, reason: str) -> DatabaseParts:
        gone = Unavailable(f"database: {reason}")
        return cls(gone, gone, gone, gone)


_FARM_SQL = (
    "SELECT w.instance, w.name, w.slots, w.leaving,"
    " extract(epoch FROM now() - w.last_seen)::float8 AS seen_seconds_ago,"
    " (SELECT count(*) FROM {schema}.outputs o WHERE o.worker_instance = w.instance AND o.state = 'encoding')::int"
    " AS busy"
    " FROM {schema}.workers w WHERE w.dead_at IS NULL"
)


# the pending deliveries by the partial index on them; "due": may go now to an enabled endpoint that is not failing
# (a failing one's deliveries wait for their retries: the developer's endpoint, not Weir, is behind)
_WEBHOOK_ENDPOINTS_SQL = (
    "SELECT count(*) FILTER (WHERE enabled)::int AS enabled, count(*) FILTER (WHERE NOT enabled)::int AS disabled,"
    " count(*) FILTER (WHERE enabled AND failing_since IS NOT NULL)::int AS failing FROM {schema}.endpoints"
)
_WEBHOOK_PENDING_SQL = (
    "SELECT count(*)::bigint AS pending, extract(epoch FROM now() - min(d.created_at))::float8 AS oldest_pending,"
    " count(*) FILTER (WHERE {due})::bigint AS due,"
    " extract(epoch FROM now() - min(d.due_at) FILTER (WHERE {due}))::float8 AS oldest_due"
    " FROM {schema}.deliveries d JOIN {schema}.endpoints e ON e.id = d.endpoint_id WHERE d.state = 'pending'"
).replace("{due}", "e.enabled AND e.failing_since IS NULL AND d.due_at <= now()"
                   " AND (d.in_flight_until IS NULL OR d.in_flight_until <= now())")
_WEBHOOK_FAILED_SQL = (
    "SELECT count(*)::bigint FROM {schema}.deliveries"
    " WHERE state = 'failed' AND finished_at > now() - interval '1 hour'"
)


async def _webhooks(conn: Any, schema: str, late_after_seconds: float) -> WebhookDeliveries:
    async with conn.transaction(readonly=True):
        endpoints = await conn.fetchrow(_WEBHOOK_ENDPOINTS_SQL.format(schema=schema))
        pending = await conn.fetchrow(_WEBHOOK_PENDING_SQL.format(schema=schema))
        failed = await conn.fetchval(_WEBHOOK_FAILED_SQL.format(schema=schema))
    return WebhookDeliveries(
        enabled=int(endpoints["enabled"]), disabled=int(endpoints["disabled"]), failing=int(endpoints["failing"]),
        pending=int(pending["pending"]), oldest_pending_seconds=pending["oldest_pending"], due=int(pending["due"]),
        oldest_due_seconds=pending["oldest_due"], failed_last_hour=int(failed), late_after_seconds=late_after_seconds)


async def read_database(database_url: str, heartbeat_timeout_seconds: float, timeout: float,
                        webhook_late_after_seconds: float) -> DatabaseParts:
    """Outbox backlogs, the farm, the sweep's last run and the webhooks' deliveries, in one read-only connection."""
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
        webhooks: WebhookDeliveries | Unavailable
        try:
            webhooks = await _webhooks(conn, db.quote_ident(db.SCHEMAS["webhooks"]), webhook_late_after_seconds)
        except Exception as exc:
            webhooks = Unavailable(reason_of(exc))
        return DatabaseParts(outbox, farm, sweep, webhooks)
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
