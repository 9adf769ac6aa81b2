"""The auth schema: accounts, users, account tokens, apps and keys (as keyed hashes), and their events."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import uuid6

from shared.events import KeyCreated, KeyRevoked, new_event
from shared.outbox import enqueue

SOURCE = "auth"


@dataclass(frozen=True)
class KeyRecord:
    id: str
    app_id: str
    account_id: str
    kind: str  # secret | publishable
    revoked: bool
    allowed_origins: tuple[str, ...]


@dataclass(frozen=True)
class TokenRecord:
    user_id: str
    account_id: str


@dataclass(frozen=True)
class NewKey:
    id: str
    kind: str
    raw: str
    key_hash: str
    prefix: str


def new_id() -> str:
    return str(uuid6.uuid7())


async def key_by_hash(conn: asyncpg.Connection, key_hash: str) -> KeyRecord | None:
    row = await conn.fetchrow(
        "SELECT k.id::text, k.app_id::text, k.account_id::text, k.kind, k.revoked_at IS NOT NULL AS revoked,"
        " a.allowed_origins FROM keys k JOIN apps a ON a.id = k.app_id WHERE k.key_hash = $1",
        key_hash,
    )
    return _key(row)


async def key_by_id(conn: asyncpg.Connection, key_id: str) -> KeyRecord | None:
    try:
        uuid.UUID(key_id)
    except ValueError:
        return None
    row = await conn.fetchrow(
        "SELECT k.id::text, k.app_id::text, k.account_id::text, k.kind, k.revoked_at IS NOT NULL AS revoked,"
        " a.allowed_origins FROM keys k JOIN apps a ON a.id = k.app_id WHERE k.id = $1",
        key_id,
    )
    return _key(row)


def _key(row: asyncpg.Record | None) -> KeyRecord | None:
    if row is None:
        return None
    return KeyRecord(row[0], row[1], row[2], row[3], row[4], tuple(row[5] or ()))


async def account_token_by_hash(conn: asyncpg.Connection, token_hash: str) -> TokenRecord | None:
    row = await conn.fetchrow(
        "SELECT u.id::text, u.account_id::text FROM account_tokens t JOIN users u ON u.id = t.user_id"
        " WHERE t.token_hash = $1 AND t.revoked_at IS NULL",
        token_hash,
    )
    return TokenRecord(row[0], row[1]) if row else None


async def create_account(
    conn: asyncpg.Connection, name: str, user_name: str, token_hash: str, token_prefix: str
) -> tuple[str, str]:
    account_id, user_id = new_id(), new_id()
    async with conn.transaction():
        await conn.execute("INSERT INTO accounts (id, name) VALUES ($1, $2)", account_id, name)
        await conn.execute(
            "INSERT INTO users (id, account_id, name) VALUES ($1, $2, $3)", user_id, account_id, user_name
        )
        await conn.execute(
            "INSERT INTO account_tokens (id, user_id, token_hash, prefix) VALUES ($1, $2, $3, $4)",
            new_id(), user_id, token_hash, token_prefix,
        )
    return account_id, user_id


async def create_app(
    conn: asyncpg.Connection,
    *,
    account_id: str,
    user_id: str,
    name: str,
    allowed_origins: tuple[str, ...],
    keys: tuple[NewKey, NewKey],
) -> str:
    app_id = new_id()
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO apps (id, account_id, name, allowed_origins, created_by) VALUES ($1, $2, $3, $4, $5)",
            app_id, account_id, name, list(allowed_origins), user_id,
        )
        await _insert_keys(conn, app_id, account_id, keys)
    return app_id


async def _insert_keys(conn: asyncpg.Connection, app_id: str, account_id: str, keys: tuple[NewKey, ...]) -> None:
    for key in keys:
        await conn.execute(
            "INSERT INTO keys (id, app_id, account_id, kind, key_hash, prefix) VALUES ($1, $2, $3, $4, $5, $6)",
            key.id, app_id, account_id, key.kind, key.key_hash, key.prefix,
        )
    await enqueue(
        conn,
        *(
            new_event(KeyCreated(key_id=k.id, app_id=app_id, account_id=account_id, kind=k.kind),  # type: ignore[arg-type]
                      source=SOURCE, subject=k.id)
            for k in keys
        ),
    )


async def app_owner(conn: asyncpg.Connection, app_id: str) -> str | None:
    try:
        uuid.UUID(app_id)
    except ValueError:
        return None
    owner: str | None = await conn.fetchval("SELECT account_id::text FROM apps WHERE id = $1", app_id)
    return owner


async def rotate_keys(
    conn: asyncpg.Connection, *, app_id: str, account_id: str, keys: tuple[NewKey, NewKey]
) -> list[str]:
    """The old live pair is revoked and the new one stored, in one transaction; returns the revoked key ids."""
    async with conn.transaction():
        await conn.execute("SELECT 1 FROM apps WHERE id = $1 FOR UPDATE", app_id)  # one rotation of an app at a time
        revoked = await _revoke(conn, "app_id = $1 AND revoked_at IS NULL", app_id)
        await _insert_keys(conn, app_id, account_id, keys)
    return revoked


async def revoke_key(conn: asyncpg.Connection, *, key_id: str, account_id: str) -> bool | None:
    """True if revoked now, False if it already was, None if no such key in the account."""
    try:
        uuid.UUID(key_id)
    except ValueError:
        return None
    async with conn.transaction():
        row = await conn.fetchrow(
            "SELECT revoked_at IS NOT NULL FROM keys WHERE id = $1 AND account_id = $2 FOR UPDATE", key_id, account_id
        )
        if row is None:
            return None
        if row[0]:
            return False
        await _revoke(conn, "id = $1", key_id)
        return True


async def _revoke(conn: asyncpg.Connection, where: str, arg: str) -> list[str]:
    rows = await conn.fetch(
        f"UPDATE keys SET revoked_at = now() WHERE {where} RETURNING id::text, app_id::text, account_id::text, kind",
        arg,
    )
    await enqueue(
        conn,
        *(
            new_event(KeyRevoked(key_id=r[0], app_id=r[1], account_id=r[2], kind=r[3]), source=SOURCE, subject=r[0])
            for r in rows
        ),
    )
    return [r[0] for r in rows]


async def list_keys(conn: asyncpg.Connection, app_id: str) -> list[tuple[str, str, str, datetime, datetime | None]]:
    rows = await conn.fetch(
        "SELECT id::text, kind, prefix, created_at, revoked_at FROM keys WHERE app_id = $1 ORDER BY created_at, kind",
        app_id,
    )
    return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]


# --- secret keys accepted from an address lately, as every instance sees them -----------------------------------


async def record_recent_keys(conn: asyncpg.Connection, accepted: list[tuple[str, str, float]]) -> None:
    """(address, key id, when accepted, as epoch seconds): the later of the stored and the given time is kept."""
    await conn.executemany(
        "INSERT INTO recent_keys (address, key_id, accepted_at) VALUES ($1, $2::uuid, to_timestamp($3))"
        " ON CONFLICT (address, key_id) DO UPDATE SET accepted_at = GREATEST(recent_keys.accepted_at,"
        " EXCLUDED.accepted_at)",
        accepted,
    )


async def recent_keys(conn: asyncpg.Connection, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """When each (address, key id) pair was last accepted by any instance (epoch seconds); absent pairs are left out."""
    rows = await conn.fetch(
        "SELECT r.address, r.key_id::text, extract(epoch FROM r.accepted_at)::float8 AS at FROM recent_keys r"
        " JOIN unnest($1::text[], $2::uuid[]) AS p(address, key_id) ON r.address = p.address AND r.key_id = p.key_id",
        [a for a, _ in pairs], [k for _, k in pairs],
    )
    return {(row["address"], row["key_id"]): float(row["at"]) for row in rows}


async def forget_recent_keys(conn: asyncpg.Connection, before: float) -> int:
    done = await conn.execute("DELETE FROM recent_keys WHERE accepted_at < to_timestamp($1)", before)
    return int(done.split()[-1])
