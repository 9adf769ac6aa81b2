"""Which events a consumer has handled, from its service's inbox (`<schema>.inbox`: consumer, event_id), for the
operator's tools (`weir replay --dry-run`, `weir dlq`). Read directly, read-only, with the database URL, as `weir
status` reads the outbox: the inbox is the record the consumer itself commits with its effects, so it is the one
answer that cannot disagree with what was applied (a question to the service would only read the same table)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

import asyncpg

from shared import db
from shared.contracts import ContractError, consumer_contract


class InboxUnknown(Exception):
    """No inbox to ask for this consumer: it is not declared, and no --inbox-schema names its schema."""


def inbox_schema(consumer: str, overrides: Mapping[str, str]) -> str:
    """Its service's schema (shared/contracts.py's consumer, shared/db.py's schema), unless named in `overrides`."""
    if consumer in overrides:
        return overrides[consumer]
    try:
        return db.SCHEMAS[consumer_contract(consumer).service]
    except (ContractError, KeyError) as exc:
        raise InboxUnknown(f"no inbox known for consumer {consumer!r} (not declared in shared/contracts.py; "
                           "--inbox-schema CONSUMER=SCHEMA names one)") from exc


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """`CONSUMER=SCHEMA` options as a mapping (ValueError for one without `=`)."""
    found: dict[str, str] = {}
    for pair in pairs:
        consumer, eq, schema = pair.partition("=")
        if not consumer or not eq or not schema:
            raise ValueError(f"not CONSUMER=SCHEMA: {pair!r}")
        found[consumer] = schema
    return found


async def handled(conn: asyncpg.Connection, schema: str, consumer: str, event_ids: Iterable[str]) -> set[str]:
    """The ids among `event_ids` that the consumer's inbox records as handled."""
    ids = [i for i in dict.fromkeys(event_ids) if _is_uuid(i)]  # an id that is no uuid was never handled
    if not ids:
        return set()
    rows = await conn.fetch(
        f"SELECT event_id::text FROM {db.quote_ident(schema)}.inbox"
        " WHERE consumer = $1 AND event_id = ANY($2::uuid[])", consumer, ids)
    return {r[0] for r in rows}


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
