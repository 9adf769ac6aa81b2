"""The webhooks service's SQL (schema `webhooks`): endpoints, the events received, deliveries and their attempts.

Its pool's search_path is `webhooks, public`, so the outbox an `enqueue` writes to is the service's own.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import uuid6

from services.webhooks import domain
from shared.consumer import Position
from shared.events import WebhookDisabled, new_event
from shared.outbox import enqueue

SOURCE = "webhooks"
ENDPOINT_COLUMNS = ("id::text, app_id, account_id, url, events, description, enabled, disabled_reason, disabled_at, "
                    "failing_since, created_at, secret_rotated_at")


# ------------------------------------------------------------------------------------------------ endpoints


@dataclass(frozen=True)
class EndpointRow:
    id: str
    app_id: str
    account_id: str
    url: str
    events: tuple[str, ...]
    description: str
    enabled: bool
    disabled_reason: str | None
    disabled_at: datetime | None
    failing_since: datetime | None
    created_at: datetime
    secret_rotated_at: datetime | None


def _endpoint(row: asyncpg.Record) -> EndpointRow:
    return EndpointRow(row["id"], row["app_id"], row["account_id"], row["url"], tuple(row["events"]),
                       row["description"], row["enabled"], row["disabled_reason"], row["disabled_at"],
                       row["failing_since"], row["created_at"], row["secret_rotated_at"])


async def create_endpoint(conn: asyncpg.Connection, *, app_id: str, account_id: str, url: str,
                          events: Sequence[str], description: str, secret: str) -> EndpointRow:
    row = await conn.fetchrow(
        f"INSERT INTO endpoints (id, app_id, account_id, url, events, description, secret)"
        f" VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {ENDPOINT_COLUMNS}",
        uuid6.uuid7(), app_id, account_id, url, list(events), description, secret)
    return _endpoint(row)


async def endpoints_of_app(conn: asyncpg.Connection, app_id: str) -> list[EndpointRow]:
    rows = await conn.fetch(f"SELECT {ENDPOINT_COLUMNS} FROM endpoints WHERE app_id = $1 ORDER BY created_at, id",
                            app_id)
    return [_endpoint(r) for r in rows]


async def endpoint(conn: asyncpg.Connection, app_id: str, endpoint_id: str, *, lock: bool = False
                   ) -> EndpointRow | None:
    """The app's endpoint, or None (another app's, or none: the same answer, so ids cannot be probed)."""
    if not _is_uuid(endpoint_id):
        return None
    row = await conn.fetchrow(f"SELECT {ENDPOINT_COLUMNS} FROM endpoints WHERE id = $1 AND app_id = $2"
                              + (" FOR UPDATE" if lock else ""), uuid.UUID(endpoint_id), app_id)
    return None if row is None else _endpoint(row)


async def update_endpoint(conn: asyncpg.Connection, endpoint_id: str, *, url: str | None,
                          events: Sequence[str] | None, description: str | None, enabled: bool | None
                          ) -> EndpointRow:
    """Changes what is given. Turning an endpoint on forgets its failures (the 5 days count again from the next
    failure); turning it off is the developer's own reason."""
    row = await conn.fetchrow(
        f"UPDATE endpoints SET url = coalesce($2, url), events = coalesce($3, events),"
        f" description = coalesce($4, description),"
        f" enabled = coalesce($5, enabled),"
        f" disabled_reason = CASE WHEN $5 IS TRUE THEN NULL WHEN $5 IS FALSE AND enabled THEN 'developer'"
        f"                        ELSE disabled_reason END,"
        f" disabled_at = CASE WHEN $5 IS TRUE THEN NULL WHEN $5 IS FALSE AND enabled THEN now() ELSE disabled_at END,"
        f" failing_since = CASE WHEN $5 IS TRUE AND NOT enabled THEN NULL ELSE failing_since END"
        f" WHERE id = $1 RETURNING {ENDPOINT_COLUMNS}",
        uuid.UUID(endpoint_id), url, None if events is None else list(events), description, enabled)
    if enabled is False:
        await _give_up_pending(conn, endpoint_id)
    return _endpoint(row)


async def delete_endpoint(conn: asyncpg.Connection, endpoint_id: str) -> None:
    await conn.execute("DELETE FROM endpoints WHERE id = $1", uuid.UUID(endpoint_id))  # deliveries go with it


async def secrets_of(conn: asyncpg.Connection, endpoint_id: str) -> domain.EndpointSecrets:
    row = await conn.fetchrow("SELECT secret, retiring FROM endpoints WHERE id = $1", uuid.UUID(endpoint_id))
    return _secrets(row["secret"], row["retiring"])


def _secrets(current: str, retiring: str) -> domain.EndpointSecrets:
    return domain.EndpointSecrets(current, tuple((s, datetime.fromisoformat(u)) for s, u in json.loads(retiring)))


async def save_secrets(conn: asyncpg.Connection, endpoint_id: str, secrets: domain.EndpointSecrets,
                       now: datetime) -> None:
    await conn.execute(
        "UPDATE endpoints SET secret = $2, retiring = $3, secret_rotated_at = $4 WHERE id = $1",
        uuid.UUID(endpoint_id), secrets.current,
        json.dumps([[s, until.isoformat()] for s, until in secrets.retiring]), now)


# --------------------------------------------------------------------------------------- events received


async def learn_video(conn: asyncpg.Connection, video_id: str, app_id: str, account_id: str, *,
                      hold: timedelta, settle: timedelta = timedelta(0)) -> int:
    """Keeps the video's app; the events of it that came before (`receive` without an app) are delivered now.
    Returns how many deliveries that made."""
    await _hold_video(conn, video_id)
    new = await conn.fetchval("INSERT INTO videos (video_id, app_id, account_id) VALUES ($1, $2, $3)"
                              " ON CONFLICT (video_id) DO NOTHING RETURNING true", video_id, app_id, account_id)
    if not new:
        return 0
    rows = await conn.fetch("UPDATE events SET app_id = $2 WHERE video_id = $1 AND app_id IS NULL"
                            " RETURNING id::text, type, video_id, occurred_at", video_id, app_id)
    made = 0
    for r in sorted(rows, key=lambda r: (r["occurred_at"], r["id"])):
        event = Received(r["id"], r["type"], app_id, r["video_id"], r["occurred_at"], b"")
        made += await _deliver(conn, event, source_seen=False, hold=hold, settle=settle)
    return made


@dataclass(frozen=True)
class KnownVideo:
    app_id: str
    source_seen: bool  # its upload.completed received


async def video(conn: asyncpg.Connection, video_id: str) -> KnownVideo | None:
    """The video as known here, its row share-locked: a concurrent `source_arrived` of it waits for this
    transaction, so it releases what this one holds back (and this one sees its source once it committed)."""
    query = "SELECT app_id, source_seen FROM videos WHERE video_id = $1 FOR SHARE"
    row = await conn.fetchrow(query, video_id)
    if row is None:  # not known: a `learn_video` of it beside this one waits until this one committed, and after
        await _hold_video(conn, video_id)  # it, the event this one keeps without an app is seen there and delivered
        row = await conn.fetchrow(query, video_id)  # (it may have committed just before: it is known then)
    return None if row is None else KnownVideo(row["app_id"], row["source_seen"])


async def _hold_video(conn: asyncpg.Connection, video_id: str) -> None:
    """The video's lock until the transaction ends. A row lock cannot serve while the video has no row: an event
    kept without an app while `learn_video` ran beside it was committed after its UPDATE looked, and never
    delivered."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('weir-webhooks-video'), hashtext($1))", video_id)


async def source_arrived(conn: asyncpg.Connection, video_id: str) -> None:
    """The video's upload.completed is received: its encoding events held back for it are due now (they follow its
    own delivery, which is earlier in the video's order)."""
    first = await conn.fetchval("UPDATE videos SET source_seen = true WHERE video_id = $1 AND NOT source_seen"
                                " RETURNING true", video_id)
    if first:  # (a delivery at the gate is due then at once: its time kept aside)
        await conn.execute("UPDATE deliveries SET due_at = CASE WHEN gate_seq IS NULL THEN now() ELSE due_at END,"
                           " gated_due_at = CASE WHEN gate_seq IS NULL THEN NULL ELSE least(gated_due_at, now()) END"
                           " WHERE video_id = $1 AND state = 'pending' AND attempts = 0"
                           " AND coalesce(gated_due_at, due_at) > now()", video_id)


@dataclass(frozen=True)
class Received:
    """A public event as the service keeps it: whose app (None: not known yet), about which video, when, and the
    body delivered."""

    id: str
    type: str
    app_id: str | None
    video_id: str | None
    occurred_at: datetime
    body: bytes


async def receive(conn: asyncpg.Connection, event: Received, *, source_seen: bool = True,
                  hold: timedelta = timedelta(0), settle: timedelta = timedelta(0),
                  gate: Position | None = None) -> int:
    """Keeps the event and makes a delivery to each enabled endpoint of its app that takes its type, first due as
    `domain.first_due` says (`source_seen`: its video's upload.completed received), behind `gate` (where its durable
    read it: it waits for the durable's ack floor, `release_gated`); returns how many (0 for an event received
    before, its deliveries made then, and for one whose app is not known yet)."""
    fresh = await conn.fetchval(
        "INSERT INTO events (id, type, app_id, video_id, occurred_at, body) VALUES ($1, $2, $3, $4, $5, $6)"
        " ON CONFLICT (id) DO NOTHING RETURNING true",
        uuid.UUID(event.id), event.type, event.app_id, event.video_id, event.occurred_at, event.body)
    if not fresh or event.app_id is None:
        return 0
    return await _deliver(conn, event, source_seen=source_seen, hold=hold, settle=settle, gate=gate)


async def _deliver(conn: asyncpg.Connection, event: Received, *, source_seen: bool, hold: timedelta,
                   settle: timedelta, gate: Position | None = None) -> int:
    rows = await conn.fetch("SELECT id::text, app_id, events, enabled FROM endpoints WHERE app_id = $1 AND enabled",
                            event.app_id)
    targets = domain.endpoints_for(event.type, event.app_id or "",
                                   (domain.Endpoint(r["id"], r["app_id"], tuple(r["events"]), r["enabled"])
                                    for r in rows))
    if targets:
        due = domain.first_due(event.type, source_seen=source_seen, now=datetime.now(UTC), hold=hold, settle=settle)
        await _add_deliveries(conn, [(event, t) for t in targets], replay_id=None, due=due, gate=gate)
    return len(targets)


async def _add_deliveries(conn: asyncpg.Connection, pairs: Sequence[tuple[Received, str]], *,
                          replay_id: str | None, due: datetime | None = None, gate: Position | None = None) -> None:
    due = due or datetime.now(UTC)
    n = len(pairs)
    await conn.execute(
        "INSERT INTO deliveries (id, endpoint_id, event_id, event_type, video_id, occurred_at, replay_id, due_at,"
        " gate_stream, gate_durable, gate_seq, gated_due_at)"
        " SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::text[], $6::timestamptz[],"
        " $7::uuid[], $8::timestamptz[], $9::text[], $10::text[], $11::bigint[], $12::timestamptz[])"
        " ON CONFLICT DO NOTHING",
        [uuid6.uuid7() for _ in pairs], [uuid.UUID(t) for _, t in pairs], [uuid.UUID(e.id) for e, _ in pairs],
        [e.type for e, _ in pairs], [e.video_id for e, _ in pairs], [e.occurred_at for e, _ in pairs],
        [None if replay_id is None else uuid.UUID(replay_id)] * n, [due if gate is None else domain.GATED] * n,
        [None if gate is None else gate.stream] * n, [None if gate is None else gate.durable] * n,
        [None if gate is None else gate.seq] * n, [None if gate is None else due] * n)


@dataclass(frozen=True)
class Gated:
    """A delivery waiting at the gate: where its event was read, and its own due time."""

    id: str
    stream: str
    durable: str
    seq: int
    due_at: datetime


async def gated(conn: asyncpg.Connection) -> list[Gated]:
    """The deliveries waiting at the gate (the few made since the floors were last read: by its index)."""
    rows = await conn.fetch("SELECT id::text, gate_stream, gate_durable, gate_seq, gated_due_at FROM deliveries"
                            " WHERE gate_seq IS NOT NULL AND state = 'pending'")
    return [Gated(r["id"], r["gate_stream"], r["gate_durable"], r["gate_seq"], r["gated_due_at"]) for r in rows]


async def release_gated(conn: asyncpg.Connection, ids: Sequence[str]) -> None:
    """Through the gate: each due at its own time."""
    await conn.execute("UPDATE deliveries SET due_at = gated_due_at, gate_stream = NULL, gate_durable = NULL,"
                       " gate_seq = NULL, gated_due_at = NULL WHERE id IN (SELECT id FROM deliveries"
                       "  WHERE id = ANY($1::uuid[]) AND gate_seq IS NOT NULL ORDER BY id FOR UPDATE SKIP LOCKED)",
                       [uuid.UUID(i) for i in ids])  # in one order, skipping rows held: through at the next turn


async def replay(conn: asyncpg.Connection, endpoint: EndpointRow, *, since: datetime, until: datetime | None,
                 types: Sequence[str] | None, replay_id: str) -> int:
    """A new delivery to `endpoint` of each event of its app in [since, until] that it takes (and of `types`, when
    given): the same events, the same webhook-ids, delivered again in their order. Returns how many."""
    rows = await conn.fetch(
        "SELECT id::text, type, app_id, video_id, occurred_at FROM events"
        " WHERE app_id = $1 AND occurred_at >= $2 AND ($3::timestamptz IS NULL OR occurred_at <= $3)"
        " ORDER BY occurred_at, id", endpoint.app_id, since, until)
    chosen = [Received(r["id"], r["type"], r["app_id"], r["video_id"], r["occurred_at"], b"") for r in rows
              if domain.subscribed(endpoint.events, r["type"]) and (not types or domain.subscribed(types, r["type"]))]
    if chosen:
        await _add_deliveries(conn, [(e, endpoint.id) for e in chosen], replay_id=replay_id)
    return len(chosen)


# ------------------------------------------------------------------------------------------- the delivery log


@dataclass(frozen=True)
class LoggedAttempt:
    at: datetime
    status_code: int | None
    error: str | None
    latency_ms: float
    address: str


@dataclass(frozen=True)
class LoggedDelivery:
    id: str
    event_id: str
    event_type: str
    video_id: str | None
    state: str
    replay_id: str | None
    created_at: datetime
    next_attempt_at: datetime | None
    attempts: list[LoggedAttempt]


def encode_cursor(created_at: datetime, delivery_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{delivery_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str] | None:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        when, _, delivery_id = text.partition("|")
        return datetime.fromisoformat(when), str(uuid.UUID(delivery_id))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None


async def deliveries(conn: asyncpg.Connection, endpoint_id: str, *, state: str | None,
                     after: tuple[datetime, str] | None, limit: int) -> list[LoggedDelivery]:
    """An endpoint's deliveries, newest first, with their attempts; `after`: the cursor's (created_at, id)."""
    rows = await conn.fetch(
        "SELECT id::text, event_id::text, event_type, video_id, state, replay_id::text, created_at, due_at,"
        " in_flight_until FROM deliveries WHERE endpoint_id = $1 AND ($2::text IS NULL OR state = $2)"
        " AND ($3::timestamptz IS NULL OR (created_at, id) < ($3, $4::uuid))"
        " ORDER BY created_at DESC, id DESC LIMIT $5",
        uuid.UUID(endpoint_id), state, after[0] if after else None, uuid.UUID(after[1]) if after else None, limit)
    attempts: dict[str, list[LoggedAttempt]] = {r["id"]: [] for r in rows}
    if rows:
        for a in await conn.fetch(
                "SELECT delivery_id::text, at, status_code, error, latency_ms, address FROM attempts"
                " WHERE delivery_id = ANY($1::uuid[]) ORDER BY delivery_id, n", [uuid.UUID(r["id"]) for r in rows]):
            attempts[a["delivery_id"]].append(LoggedAttempt(a["at"], a["status_code"], a["error"], a["latency_ms"],
                                                            a["address"]))
    return [LoggedDelivery(r["id"], r["event_id"], r["event_type"], r["video_id"], r["state"], r["replay_id"],
                           r["created_at"], r["due_at"] if r["state"] == "pending" else None, attempts[r["id"]])
            for r in rows]


# ------------------------------------------------------------------------------------------------ delivering


async def due_endpoints(conn: asyncpg.Connection) -> list[tuple[str, datetime]]:
    """Each enabled endpoint with a pending delivery, and the earliest time one of them may be attempted (an
    attempt under way counts from its end: past it, its instance died)."""
    # two index probes per endpoint, not a scan of every pending delivery: a dead endpoint's backlog grows by every
    # event, and this runs at each turn of the deliverer (the earliest not under way by (endpoint_id, due_at); the
    # earliest end of those under way by the in-flight index, which holds only the few claimed)
    rows = await conn.fetch(
        "SELECT id, due FROM (SELECT e.id::text AS id, least("
        "  (SELECT d.due_at FROM deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending'"
        "    AND (d.in_flight_until IS NULL OR d.in_flight_until <= $1) ORDER BY d.due_at LIMIT 1),"
        "  (SELECT min(d.in_flight_until) FROM deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending'"
        "    AND d.in_flight_until > $1)) AS due"
        " FROM endpoints e WHERE e.enabled) AS t WHERE due IS NOT NULL", datetime.now(UTC))
    return [(r["id"], r["due"]) for r in rows]


@dataclass(frozen=True)
class Claimed:
    """One delivery claimed for an attempt: where to, what, signed with which secrets."""

    id: str
    endpoint_id: str
    url: str
    event_id: str
    body: bytes
    secrets: tuple[str, ...]


@dataclass(frozen=True)
class Claims:
    """What one `claim_due` claimed, the endpoints it found locked by another claimer (to look at again soon), and
    the earliest time something not yet due may go (None: nothing waits on time)."""

    claimed: list[Claimed]
    locked: list[str]
    next_due: datetime | None


async def claim(conn: asyncpg.Connection, endpoint_id: str, *, now: datetime, most: int, flight: timedelta
                ) -> list[Claimed]:
    """`claim_due` for one endpoint."""
    return (await claim_due(conn, now=now, most=most, flight=flight, only=[endpoint_id])).claimed


async def claim_due(conn: asyncpg.Connection, *, now: datetime, most: int, flight: timedelta,
                    busy: Mapping[str, int] | None = None, room: int | None = None,
                    only: Sequence[str] | None = None, ahead: int = 0, step: timedelta = timedelta(0),
                    due: list[tuple[str, datetime]] | None = None) -> Claims:
    """Claims (marks in flight until `now + flight`) what may be attempted now on every endpoint (or `only` these):
    each video's earliest unfinished delivery once due (domain.deliverable), at most `most` under way at once per
    endpoint, `room` in all. `busy`: attempts under way here per endpoint, not yet recorded (an endpoint at `most`
    here is not looked at). One claimer per endpoint at a time (its row locked), across instances; one statement
    each for all endpoints. Call in a transaction.

    `ahead`: each endpoint may have this many more claimed, to be sent here as soon as one under way ends; a claim
    that waits behind k attempts (k // most) is held `step` (the delivery timeout) longer each. `due`: what
    `due_endpoints` answered just before, if it was asked.

    The lock is NO KEY UPDATE: it excludes other claimers and recorders, but not the consumers adding deliveries
    (their foreign key takes KEY SHARE on the endpoint), which a FOR UPDATE would skip the endpoint for."""
    busy = busy or {}
    if only is not None:
        due = [(e, now) for e in only if _is_uuid(e)]
    elif due is None:
        due = await due_endpoints(conn)
    candidates = sorted(((at, e) for e, at in due if busy.get(e, 0) < most + ahead), key=lambda x: x[0])
    next_due = min((at for at, _ in candidates if at > now), default=None)
    wanted = [e for at, e in candidates if at <= now]
    if not wanted or (room is not None and room <= 0):
        return Claims([], [], next_due)
    eps = {r["id"]: r for r in await conn.fetch(
        "SELECT id::text, url, secret, retiring FROM endpoints WHERE id = ANY($1::uuid[]) AND enabled"
        " ORDER BY id FOR NO KEY UPDATE SKIP LOCKED", [uuid.UUID(e) for e in wanted])}
    locked = [e for e in wanted if e not in eps and e not in (only or ())]
    if not eps:
        return Claims([], locked, next_due)
    rows = await conn.fetch(
        "SELECT DISTINCT ON (endpoint_id, coalesce(video_id, id::text)) id::text, endpoint_id::text, video_id,"
        " occurred_at, due_at, in_flight_until FROM deliveries WHERE endpoint_id = ANY($1::uuid[])"
        " AND state = 'pending' ORDER BY endpoint_id, coalesce(video_id, id::text), occurred_at, event_id",
        [uuid.UUID(e) for e in eps])
    heads: dict[str, list[asyncpg.Record]] = {}
    for r in rows:
        heads.setdefault(r["endpoint_id"], []).append(r)
    chosen: list[tuple[str, domain.PendingDelivery, datetime]] = []
    left = room
    for endpoint_id in (e for e in wanted if e in heads):
        mine = heads[endpoint_id]
        in_flight = sum(1 for r in mine if r["in_flight_until"] is not None and r["in_flight_until"] > now)
        pending = [domain.PendingDelivery(r["id"], r["video_id"], r["occurred_at"], domain.DeliveryState.PENDING,
                                          max(r["due_at"], r["in_flight_until"] or r["due_at"])) for r in mine]
        # an instance claims ahead only behind attempts of its own (it sends them as those end); one holding
        # none of the endpoint's sends what it claims at once, so it may claim only what may go now
        limit = most + ahead if busy.get(endpoint_id, 0) > 0 else most
        take = max(0, limit - in_flight) if left is None else max(0, min(limit - in_flight, left))
        picked = domain.deliverable(pending, now)[:take]
        chosen += [(endpoint_id, d, now + flight + step * ((in_flight + k) // most)) for k, d in enumerate(picked)]
        if left is not None:
            left -= len(picked)
    if not chosen:
        return Claims([], locked, next_due)
    ids = [uuid.UUID(d.event_id) for _, d, _ in chosen]  # PendingDelivery.event_id holds the delivery's id here
    claimed = await conn.fetch(
        "UPDATE deliveries d SET in_flight_until = u.until FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, until),"
        " events e WHERE d.id = u.id AND e.id = d.event_id RETURNING d.id::text, d.event_id::text, e.body",
        ids, [until for _, _, until in chosen])
    by_id = {r["id"]: r for r in claimed}
    signing = {e: domain.signing_secrets(_secrets(r["secret"], r["retiring"]), now) for e, r in eps.items()}
    return Claims([Claimed(d.event_id, e, eps[e]["url"], by_id[d.event_id]["event_id"],
                           bytes(by_id[d.event_id]["body"]), signing[e]) for e, d, _ in chosen if d.event_id in by_id],
                  locked, next_due)


async def release(conn: asyncpg.Connection, delivery_ids: Sequence[str]) -> None:
    """Claims given back unattempted (an instance stopping): due again at once, here or elsewhere."""
    await conn.execute("UPDATE deliveries SET in_flight_until = NULL WHERE id = ANY($1::uuid[]) AND state = 'pending'",
                       [uuid.UUID(d) for d in delivery_ids])


@dataclass(frozen=True)
class Attempted:
    """What one attempt found (services/webhooks/ssrf.py's AttemptReport, as kept)."""

    result: domain.AttemptResult
    seconds: float
    address: str
    response: bytes


@dataclass(frozen=True)
class Finished:
    """An attempt made, to be recorded: what was claimed, what the attempt found, and the random draw of its retry
    jitter."""

    claimed: Claimed
    attempted: Attempted
    draw: float


async def record(conn: asyncpg.Connection, claimed: Claimed, attempted: Attempted, *, policy: domain.RetryPolicy,
                 disable_after: timedelta, now: datetime, draw: float) -> domain.AttemptDecision | None:
    """`record_many` of one attempt."""
    return (await record_many(conn, [Finished(claimed, attempted, draw)], policy=policy,
                              disable_after=disable_after, now=now))[0]


async def record_many(conn: asyncpg.Connection, finished: Sequence[Finished], *, policy: domain.RetryPolicy,
                      disable_after: timedelta, now: datetime) -> list[domain.AttemptDecision | None]:
    """Keeps the attempts and applies each one's decision to its delivery and its endpoint, in their order, as one
    transaction each after the other would (disabling an endpoint, with a `webhook.disabled` event, when a decision
    says so; its later attempts here then only count). Each one's decision, or None: the delivery is gone or
    finished (deleted with its endpoint, or settled by an attempt that outlived its claim). A few statements for
    the whole batch. Call in a transaction."""
    if not finished:
        return []
    endpoint_ids = sorted({uuid.UUID(f.claimed.endpoint_id) for f in finished})
    eps = {r["id"]: r for r in await conn.fetch(
        "SELECT id::text, app_id, account_id, failing_since, enabled FROM endpoints WHERE id = ANY($1::uuid[])"
        " ORDER BY id FOR NO KEY UPDATE", endpoint_ids)}
    rows = {r["id"]: r for r in await conn.fetch(
        "SELECT id::text, attempts, first_failure, state FROM deliveries WHERE id = ANY($1::uuid[])"
        " ORDER BY id FOR UPDATE", sorted({uuid.UUID(f.claimed.id) for f in finished}))}
    failing = {e: r["failing_since"] for e, r in eps.items()}
    enabled = {e: r["enabled"] for e, r in eps.items()}
    attempts = {d: r["attempts"] for d, r in rows.items()}
    settled = {d for d, r in rows.items() if r["state"] != domain.DeliveryState.PENDING}
    first = {d: r["first_failure"] for d, r in rows.items()}
    kept: list[tuple[str, int, Finished]] = []
    changes: dict[str, tuple[int, domain.AttemptDecision | None]] = {}  # the delivery's last attempt and decision
    disabled: list[tuple[str, domain.AttemptDecision]] = []
    disabled_here: set[str] = set()
    decisions: list[domain.AttemptDecision | None] = []
    for f in finished:
        c = f.claimed
        if c.endpoint_id not in eps or c.id not in rows:
            decisions.append(None)
            continue
        n = attempts[c.id] = attempts[c.id] + 1
        kept.append((c.id, n, f))
        if c.id in settled or c.endpoint_id in disabled_here:  # its endpoint disabled above: given up with it
            changes[c.id] = (n, changes.get(c.id, (0, None))[1])
            decisions.append(None)
            continue
        decision = domain.attempt_decision(f.attempted.result, policy, attempt=n, first_failure=first[c.id],
                                           endpoint_failing_since=failing[c.endpoint_id],
                                           disable_after=disable_after, now=now, draw=f.draw)
        first[c.id] = decision.first_failure
        failing[c.endpoint_id] = decision.endpoint_failing_since
        if decision.state.finished:
            settled.add(c.id)
        changes[c.id] = (n, decision)
        if decision.disable is not None and enabled[c.endpoint_id]:
            enabled[c.endpoint_id] = False
            disabled.append((c.endpoint_id, decision))
            disabled_here.add(c.endpoint_id)
        decisions.append(decision)
    if kept:
        await conn.execute(
            "INSERT INTO attempts (delivery_id, n, at, status_code, error, latency_ms, address, response)"
            " SELECT u.d, u.n, $3, u.s, u.e, u.l, u.a, u.r FROM unnest($1::uuid[], $2::int[], $4::int[], $5::text[],"
            " $6::float8[], $7::text[], $8::bytea[]) AS u(d, n, s, e, l, a, r)",
            [uuid.UUID(d) for d, _, _ in kept], [n for _, n, _ in kept], now,
            [f.attempted.result.status for _, _, f in kept],
            [None if f.attempted.result.error is None else f.attempted.result.error.value for _, _, f in kept],
            [f.attempted.seconds * 1000 for _, _, f in kept], [f.attempted.address for _, _, f in kept],
            [f.attempted.response for _, _, f in kept])
    if changes:
        items = list(changes.items())
        # a delivery settled before (or only counted) keeps its state; one decided here takes its decision's
        await conn.execute(
            "UPDATE deliveries d SET attempts = u.n,"
            " state = CASE WHEN u.decided THEN u.state ELSE d.state END,"
            " due_at = CASE WHEN u.decided THEN coalesce(u.due, d.due_at) ELSE d.due_at END,"
            " in_flight_until = CASE WHEN u.decided THEN NULL ELSE d.in_flight_until END,"
            " first_failure = CASE WHEN u.decided THEN u.first ELSE d.first_failure END,"
            " finished_at = CASE WHEN NOT u.decided THEN d.finished_at WHEN u.state = 'pending' THEN NULL"
            "                    ELSE $7::timestamptz END"
            " FROM unnest($1::uuid[], $2::int[], $3::bool[], $4::text[], $5::timestamptz[], $6::timestamptz[])"
            " AS u(id, n, decided, state, due, first) WHERE d.id = u.id",
            [uuid.UUID(d) for d, _ in items], [n for _, (n, _) in items], [x is not None for _, (_, x) in items],
            [None if x is None else x.state.value for _, (_, x) in items],
            [None if x is None else x.next_attempt_at for _, (_, x) in items],
            [None if x is None else x.first_failure for _, (_, x) in items], now)
    moved = [(e, f) for e, f in failing.items() if f != eps[e]["failing_since"]]
    if moved:
        await conn.execute(
            "UPDATE endpoints e SET failing_since = u.f FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, f)"
            " WHERE e.id = u.id", [uuid.UUID(e) for e, _ in moved], [f for _, f in moved])
    for endpoint_id, decision in disabled:
        assert decision.disable is not None
        ep = eps[endpoint_id]
        await conn.execute("UPDATE endpoints SET enabled = false, disabled_reason = $2, disabled_at = $3"
                           " WHERE id = $1", uuid.UUID(endpoint_id), decision.disable.value, now)
        await _give_up_pending(conn, endpoint_id)
        await enqueue(conn, new_event(
            WebhookDisabled(endpoint_id=endpoint_id, app_id=ep["app_id"], account_id=ep["account_id"],
                            reason=decision.disable.value, failing_since=decision.endpoint_failing_since),
            source=SOURCE, subject=endpoint_id))
    return decisions


async def _give_up_pending(conn: asyncpg.Connection, endpoint_id: str) -> None:
    """A disabled endpoint's pending deliveries are given up (in the log as failed; a replay sends them again)."""
    await conn.execute("UPDATE deliveries SET state = 'failed', finished_at = now(), in_flight_until = NULL"
                       " WHERE endpoint_id = $1 AND state = 'pending'", uuid.UUID(endpoint_id))


async def forget_before(conn: asyncpg.Connection, before: datetime) -> int:
    """Removes the events received before `before` with their deliveries and attempts (SPEC 13: kept 30 days),
    and deliveries finished before it."""
    await conn.execute("DELETE FROM deliveries WHERE state <> 'pending' AND finished_at < $1", before)
    removed: int = await conn.fetchval(
        "WITH gone AS (DELETE FROM events e WHERE received_at < $1 AND NOT EXISTS"
        " (SELECT 1 FROM deliveries d WHERE d.event_id = e.id AND d.state = 'pending') RETURNING 1)"
        " SELECT count(*) FROM gone", before)
    return removed


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True
