"""Credential lookups: keys and account tokens by hash, keys by id, through a cache that a revocation empties.

A record in use is fetched again in the background before it expires, so that a busy key never waits for the
database; the expiry still bounds how long a missed revocation could go unnoticed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from services.auth import store
from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    CredentialOutcome,
    NoCredential,
    RejectedCredential,
    RejectionReason,
    ValidUploadToken,
    malformed_credential,
    upload_token_outcome,
)
from services.auth.domain.credentials import CredentialForm, FormKind, key_hash, key_prefix
from services.auth.domain.upload_tokens import verify_upload_token
from shared.authcheck import Identity
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.check")

Record = store.KeyRecord | store.TokenRecord
Fetch = Callable[[asyncpg.Connection], Awaitable[Record | None]]
REFRESH_AHEAD = 0.8  # a cached lookup is fetched again once this part of its lifetime has passed
CACHE_MAX = 100_000  # entries; all forgotten at once past it


@dataclass
class CachedRecord:
    record: Record | None
    until: float
    refresh_at: float  # from here on a hit is still served, and the record is fetched again in the background


@dataclass
class LookupCache:
    """Key and token lookups by hash; a revoked key leaves it on every instance through `key.revoked`."""

    ttl_seconds: float
    negative_ttl_seconds: float
    _entries: dict[str, CachedRecord] = field(default_factory=dict)
    _by_key_id: dict[str, set[str]] = field(default_factory=dict)  # a key is cached by its hash and by its id
    # bumped by every revocation: a lookup that started before one does not put back what it read
    epoch: int = 0

    def get(self, digest: str, now: float) -> CachedRecord | None:
        hit = self._entries.get(digest)
        if hit is None or hit.until <= now:
            return None
        return hit

    def put(self, slot: str, record: Record | None, now: float) -> None:
        if len(self._entries) > CACHE_MAX:
            self.clear()
        ttl = self.ttl_seconds if record is not None else self.negative_ttl_seconds
        refresh = REFRESH_AHEAD * ttl if record is not None else ttl
        self._entries[slot] = CachedRecord(record, now + ttl, now + refresh)
        if isinstance(record, store.KeyRecord):
            self._by_key_id.setdefault(record.id, set()).add(slot)

    def forget_key(self, key_id: str) -> None:
        self.epoch += 1
        for slot in self._by_key_id.pop(key_id, set()) | {f"id:{key_id}"}:
            self._entries.pop(slot, None)

    def clear(self) -> None:
        self.epoch += 1
        self._entries.clear()
        self._by_key_id.clear()


@dataclass(slots=True)
class Lookup:
    """The cached lookup a credential's outcome came from: its slot, how to fetch it again, and what it found."""

    slot: str
    fetch: Fetch
    record: Record | None


@dataclass(frozen=True, slots=True)
class CredentialFound:
    """What a credential amounts to, the identity it carries, the allowed origins of the app it names (known even
    when it is refused, for the refusal's CORS headers), and the lookup it came from (none without a lookup)."""

    outcome: CredentialOutcome
    identity: Identity | None = None
    origins: tuple[str, ...] = ()
    lookup: Lookup | None = None


class CredentialLookups:
    def __init__(self, *, pool: asyncpg.Pool, metrics: Metrics, clock: Callable[[], float], hash_secret: bytes,
                 token_secret: bytes, cache: LookupCache, background: Callable[[Awaitable[None]], None]) -> None:
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self.hash_secret = hash_secret
        self.token_secret = token_secret
        self.cache = cache
        self.background = background
        self._refreshing: set[str] = set()

    async def cached(self, slot: str, now: float, fetch: Fetch) -> Record | None:
        """One lookup through the cache (hits and misses alike); `key.revoked` empties a key's slots."""
        hit = self.cache.get(slot, now)
        if hit is not None:
            self.refresh_if_due(slot, hit, now, fetch)
            return hit.record
        return await self.fetch(slot, now, fetch)

    def refresh_if_due(self, slot: str, hit: CachedRecord, now: float, fetch: Fetch) -> None:
        if hit.refresh_at <= now and slot not in self._refreshing:
            self._refreshing.add(slot)
            self.background(self._refresh(slot, fetch))

    async def fetch(self, slot: str, now: float, fetch: Fetch) -> Record | None:
        epoch = self.cache.epoch
        self.metrics.inc("credential_lookups_total", help="credential lookups that went to the database")
        async with self.pool.acquire() as conn:
            record = await fetch(conn)
        if self.cache.epoch == epoch:  # no revocation meanwhile: what was read is still the truth
            self.cache.put(slot, record, now)
        return record

    async def _refresh(self, slot: str, fetch: Fetch) -> None:
        try:
            await self.fetch(slot, self.clock(), fetch)
        except Exception as exc:  # the entry expires as usual; the next request fetches it itself
            log.warning("background refresh of a cached lookup failed: %s", exc)
        finally:
            self._refreshing.discard(slot)

    async def _lookup(self, slot: str, now: float, fetch: Fetch) -> Lookup:
        return Lookup(slot, fetch, await self.cached(slot, now, fetch))

    async def _key(self, raw: str, now: float) -> Lookup:
        digest = key_hash(self.hash_secret, raw)
        return await self._lookup(digest, now, lambda c: store.key_by_hash(c, digest))

    async def _key_by_id(self, key_id: str, now: float) -> Lookup:
        return await self._lookup(f"id:{key_id}", now, lambda c: store.key_by_id(c, key_id))

    async def _account_token(self, raw: str, now: float) -> Lookup:
        digest = key_hash(self.hash_secret, raw)
        return await self._lookup(digest, now, lambda c: store.account_token_by_hash(c, digest))

    async def credential(self, form: CredentialForm, now: float) -> CredentialFound:
        """The one lookup of the request's credential, and what it amounts to."""
        kind = form.kind
        if kind is FormKind.NONE:
            return CredentialFound(NoCredential())
        if kind is FormKind.MALFORMED:
            return CredentialFound(malformed_credential(form))
        if kind in (FormKind.SECRET_KEY, FormKind.PUBLISHABLE_KEY):
            wanted = "secret" if kind is FormKind.SECRET_KEY else "publishable"
            lookup = await self._key(form.value, now)
            record = lookup.record if isinstance(lookup.record, store.KeyRecord) else None
            catalog_kind = form.looks_like or "secret_key"
            if record is None or record.kind != wanted:
                return CredentialFound(RejectedCredential(catalog_kind, RejectionReason.UNKNOWN,
                                                                 key_prefix(form.value)), lookup=lookup)
            if record.revoked:
                return CredentialFound(RejectedCredential(catalog_kind, RejectionReason.REVOKED,
                                                                 key_prefix(form.value)),
                                       origins=record.allowed_origins, lookup=lookup)
            identity = Identity(account_id=record.account_id, app_id=record.app_id, key_id=record.id,
                                key_type=wanted, allowed_origins=record.allowed_origins)
            accepted: CredentialOutcome = (
                AcceptedSecretKey(record.id, record.account_id, record.app_id) if wanted == "secret"
                else AcceptedPublishableKey(record.id, record.account_id, record.app_id))
            return CredentialFound(accepted, identity, record.allowed_origins, lookup)
        if kind is FormKind.ACCOUNT_TOKEN:
            lookup = await self._account_token(form.value, now)
            token = lookup.record if isinstance(lookup.record, store.TokenRecord) else None
            if token is None:
                return CredentialFound(RejectedCredential("account_token", RejectionReason.UNKNOWN,
                                                                 key_prefix(form.value)), lookup=lookup)
            return CredentialFound(
                AcceptedAccountToken(token.user_id, token.account_id),
                Identity(account_id=token.account_id, user_id=token.user_id, key_type="account_token"), (), lookup)
        # an upload token: its signature first, then whether the key that minted it still lives
        check = verify_upload_token(self.token_secret, form.value, now)
        key_live = False
        record = None
        found = None
        if check.claims is not None and not check.rejected:
            found = await self._key_by_id(check.claims.key_id, now)
            record = found.record if isinstance(found.record, store.KeyRecord) else None
            key_live = record is not None and not record.revoked
        outcome = upload_token_outcome(check, key_live)
        # a good signature names its app, through the key that minted it (expired or revoked too); a bad one nothing
        origins = record.allowed_origins if record is not None else ()
        if isinstance(outcome, ValidUploadToken) and record is not None:
            claims = outcome.claims
            return CredentialFound(outcome, Identity(account_id=record.account_id, app_id=claims.app_id,
                                                     key_id=claims.key_id, key_type="upload_token",
                                                     video_id=claims.video_id), origins, found)
        return CredentialFound(outcome, None, origins, found)
