"""The `auth.check` adapter: one credential lookup, the counters, the decision, and what it publishes.

The decisions are `services.auth.domain`'s; this module does the I/O around them: key and token lookups (with a
cache that `key.revoked` empties on every instance), the shared counters, and `credential.rejected` events
(folded per address and window once an address is past its `auth_failure` limit, so a flood does not flood the bus).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import asyncpg
from pydantic import RootModel, ValidationError

from services.auth import domain, store
from services.auth.counters import CounterStore, CounterStoreFailingOver, ResilientCounters
from services.auth.leases import LeasedCounters
from services.auth.settings import AuthSettings
from shared.authcheck import CheckReply, CheckRequest, Identity
from shared.events import CredentialRejected, new_event
from shared.messaging import error_reply
from shared.metrics import Metrics
from shared.outbox import enqueue

log = logging.getLogger("weir.auth.check")

COUNTER_PREFIX = "limits"
SPENT_SUBJECT = "auth.spent"
_KEY_TYPES = {"secret": "secret", "publishable": "publishable"}


Record = store.KeyRecord | store.TokenRecord


class SpentBudgets(RootModel[list[tuple[str, str, int]]]):
    """`auth.spent`: budgets an instance saw spent, each as (rule id, counter key, end of its window), told to every
    instance so that each refuses them from memory; an end of 0 says counts went back and the budget may have room."""


@dataclass
class _Cached:
    record: Record | None
    until: float
    refresh_at: float  # from here on a hit is still served, and the record is fetched again in the background


@dataclass
class LookupCache:
    """Key and token lookups by hash; a revoked key leaves it on every instance through `key.revoked`."""

    ttl_seconds: float
    negative_ttl_seconds: float
    _entries: dict[str, _Cached] = field(default_factory=dict)
    _by_key_id: dict[str, set[str]] = field(default_factory=dict)  # a key is cached by its hash and by its id
    # bumped by every revocation: a lookup that started before one does not put back what it read
    epoch: int = 0

    def get(self, digest: str, now: float) -> _Cached | None:
        hit = self._entries.get(digest)
        if hit is None or hit.until <= now:
            return None
        return hit

    def put(self, slot: str, record: Record | None, now: float) -> None:
        if len(self._entries) > 100_000:
            self.clear()
        ttl = self.ttl_seconds if record is not None else self.negative_ttl_seconds
        refresh = REFRESH_AHEAD * ttl if record is not None else ttl
        self._entries[slot] = _Cached(record, now + ttl, now + refresh)
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


@dataclass
class RejectionFolding:
    """Past an address's `auth_failure` limit, its further rejections become one event per window with a count."""

    folded: dict[tuple[str, int], tuple[CredentialRejected, int]] = field(default_factory=dict)

    def fold(self, event: CredentialRejected, window_start: int) -> None:
        key = (event.client_address, window_start)
        first, count = self.folded.get(key, (event, 0))
        self.folded[key] = (first, count + event.count)

    def due(self, now: float, window_seconds: int) -> list[CredentialRejected]:
        """The folded events of windows that have ended."""
        ended = [k for k in self.folded if k[1] + window_seconds <= now]
        out = []
        for k in ended:
            first, count = self.folded.pop(k)
            out.append(first.model_copy(update={"count": count, "reason": f"{first.reason} (folded)"}))
        return out


_json = json.JSONEncoder(separators=(",", ":")).encode


def _invalid(exc: ValidationError) -> bytes:
    """The answer to a request that is not a CheckRequest: the same ErrorReply as FastStream's subscribers give."""
    detail = str(exc.errors(include_url=False, include_context=False))
    return error_reply(400, "validation_error", detail).model_dump_json().encode()


# credentials whose outcome stays the same while their lookup is cached (an upload token's also ends at its expiry)
_MEMO_KINDS = (domain.AcceptedSecretKey, domain.AcceptedPublishableKey, domain.AcceptedAccountToken,
               domain.ValidUploadToken, domain.NoCredential)
MEMO_MAX = 100_000
REFRESH_AHEAD = 0.8  # a cached lookup is fetched again once this part of its lifetime has passed


@dataclass(slots=True)
class _Lookup:
    """The cached lookup a credential's outcome came from: its slot, how to fetch it again, and what it found."""

    slot: str
    fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]
    record: Record | None


@dataclass(slots=True)
class _Template:
    """What a request payload amounts to before counting, kept for the same payload arriving again."""

    request: CheckRequest
    address: str
    credential: domain.CredentialOutcome
    identity: Identity | None
    internal: domain.InternalToken
    key_id: str | None  # the accepted secret key, for the block's recently-accepted exception
    failure_key: domain.CounterKey
    until: float
    cors_origin: str | None = None  # the request's Origin, when the credential's app allows it
    plans: dict[bool, tuple[domain.RequestFacts, domain.CountPlan]] = field(default_factory=dict)
    identity_json: str | None = None
    cors_json: str = "null"
    lookup: _Lookup | None = None  # the cached lookup behind `credential`; none for a request without a credential

    reply_parts: tuple[str, str] | None = None  # an allowed reply's text before its counter mode, and after it

    def identity_text(self) -> str:
        if self.identity_json is None:
            self.identity_json = "null" if self.identity is None else self.identity.model_dump_json()
        return self.identity_json

    def allowed_reply_parts(self) -> tuple[str, str]:
        """An allowed reply's text (`Checker._reply_bytes`) but for its counter mode and headers: the same for every
        request of the payload."""
        if self.reply_parts is None:
            self.reply_parts = (
                f'{{"allowed":true,"status":200,"problem":null,"identity":{self.identity_text()},'
                f'"client_address":{_json(self.address)},"counter_mode":"',
                f'","cors_origin":{self.cors_json},"headers":',
            )
        return self.reply_parts


@dataclass(slots=True)
class _Staged:
    """One request of a batch between its lookup and its decision (the rest of what it is: its template's)."""

    template: _Template
    facts: domain.RequestFacts
    plan: domain.CountPlan
    past_failure_limit: bool
    decision: domain.Decision | None  # already known when refused from memory
    counts: dict[domain.CounterKey, int] = field(default_factory=dict)


class Checker:
    def __init__(
        self,
        settings: AuthSettings,
        pool: asyncpg.Pool,
        counters: CounterStore,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        counter_mode: Callable[[], str] = lambda: "shared",
        broadcast: Callable[[SpentBudgets], Awaitable[None]] | None = None,
    ) -> None:
        self.broadcast = broadcast
        self.settings = settings
        self.pool = pool
        self.counters = counters
        self.metrics = metrics or Metrics("auth")
        self.clock = clock
        self.leases: LeasedCounters[domain.CounterKey] = LeasedCounters(
            counters,
            domain.LeasePolicy(settings.counter_lease_max, settings.counter_lease_fraction),
            idle_seconds=settings.counter_lease_idle_ms / 1000,
            metrics=self.metrics,
            on_give_back=self._gave_back,
        )
        if isinstance(counters, ResilientCounters):
            counters.send_late_totals_to(self.leases.late_grant)
        self.counter_mode = counter_mode
        self.rules = domain.rules_from(settings)
        self.trusted = domain.parse_trusted_proxies(settings.trusted_proxies)
        self.internal_token = settings.internal_token.get_secret_value()
        self.hash_secret = settings.key_hash_secret.get_secret_value().encode()
        self.token_secret = settings.upload_token_secret.get_secret_value().encode()
        if not self.hash_secret or not self.token_secret:
            raise ValueError("WEIR_KEY_HASH_SECRET and WEIR_UPLOAD_TOKEN_SECRET must be set")
        self.cache = LookupCache(ttl_seconds=settings.key_cache_seconds, negative_ttl_seconds=2.0)
        self.memory = domain.RefusalMemory()
        self.recent = domain.RecentAcceptedKeys(float(settings.limit_window_seconds))
        self.folding = RejectionFolding()
        self._tasks: set[asyncio.Future[None]] = set()
        self._refreshing: set[str] = set()
        # payload (keyed hash, never the payload: it holds a secret) -> its template; emptied on every revocation
        self._memo: dict[bytes, _Template] = {}
        self._memo_key = secrets.token_bytes(32)
        # the auth_failure block comes from the shared counter: a reading that found room is trusted this long
        self._block_room: dict[domain.CounterKey, tuple[float, int]] = {}
        self._block_recheck = settings.block_recheck_ms / 1000
        # keys accepted from an address, shared through the database so that every instance honours the block's
        # exception: when this instance last wrote each pair, and pairs known not to be recent anywhere
        self._recent_share = settings.recent_key_share_seconds
        self._recent_written: dict[tuple[str, str], float] = {}
        self._not_recent_until: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------------------------------------- lookups

    async def _cached(
        self, slot: str, now: float, fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]
    ) -> Record | None:
        """One lookup through the cache (hits and misses alike); `key.revoked` empties a key's slots.

        A record in use is fetched again in the background before it expires, so that a busy key never waits for
        the database; the expiry still bounds how long a missed revocation could go unnoticed.
        """
        hit = self.cache.get(slot, now)
        if hit is not None:
            self._refresh_if_due(slot, hit, now, fetch)
            return hit.record
        return await self._fetch(slot, now, fetch)

    def _refresh_if_due(self, slot: str, hit: _Cached, now: float,
                        fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]) -> None:
        if hit.refresh_at <= now and slot not in self._refreshing:
            self._refreshing.add(slot)
            self._background(self._refresh(slot, fetch))

    async def _fetch(
        self, slot: str, now: float, fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]
    ) -> Record | None:
        epoch = self.cache.epoch
        self.metrics.inc("credential_lookups_total", help="credential lookups that went to the database")
        async with self.pool.acquire() as conn:
            record = await fetch(conn)
        if self.cache.epoch == epoch:  # no revocation meanwhile: what was read is still the truth
            self.cache.put(slot, record, now)
        return record

    async def _refresh(self, slot: str, fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]) -> None:
        try:
            await self._fetch(slot, self.clock(), fetch)
        except Exception as exc:  # the entry expires as usual; the next request fetches it itself
            log.warning("background refresh of a cached lookup failed: %s", exc)
        finally:
            self._refreshing.discard(slot)

    async def _lookup(self, slot: str, now: float,
                      fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]) -> _Lookup:
        return _Lookup(slot, fetch, await self._cached(slot, now, fetch))

    async def _lookup_key(self, raw: str, now: float) -> _Lookup:
        digest = domain.key_hash(self.hash_secret, raw)
        return await self._lookup(digest, now, lambda c: store.key_by_hash(c, digest))

    async def _lookup_key_id(self, key_id: str, now: float) -> _Lookup:
        return await self._lookup(f"id:{key_id}", now, lambda c: store.key_by_id(c, key_id))

    async def _lookup_token(self, raw: str, now: float) -> _Lookup:
        digest = domain.key_hash(self.hash_secret, raw)
        return await self._lookup(digest, now, lambda c: store.account_token_by_hash(c, digest))

    async def outcome(
        self, form: domain.CredentialForm, now: float
    ) -> tuple[domain.CredentialOutcome, Identity | None]:
        """The one lookup of the request's credential: what it amounts to, and the identity it carries."""
        credential, identity, _, _ = await self._outcome(form, now)
        return credential, identity

    async def _outcome(
        self, form: domain.CredentialForm, now: float
    ) -> tuple[domain.CredentialOutcome, Identity | None, tuple[str, ...], _Lookup | None]:
        """`outcome`; the allowed origins of the app the credential names (known whenever its key was found, even
        when the credential is refused (revoked, expired, on the wrong route), for the refusal's CORS headers); and
        the cached lookup the outcome came from (none when it needed no lookup)."""
        kind = form.kind
        if kind is domain.FormKind.NONE:
            return domain.NoCredential(), None, (), None
        if kind is domain.FormKind.MALFORMED:
            return domain.malformed_credential(form), None, (), None
        if kind in (domain.FormKind.SECRET_KEY, domain.FormKind.PUBLISHABLE_KEY):
            wanted = "secret" if kind is domain.FormKind.SECRET_KEY else "publishable"
            lookup = await self._lookup_key(form.value, now)
            record = lookup.record if isinstance(lookup.record, store.KeyRecord) else None
            catalog_kind = form.looks_like or "secret_key"
            if record is None or record.kind != wanted:
                return domain.RejectedCredential(catalog_kind, domain.RejectionReason.UNKNOWN,
                                                 domain.key_prefix(form.value)), None, (), lookup
            if record.revoked:
                return domain.RejectedCredential(catalog_kind, domain.RejectionReason.REVOKED,
                                                 domain.key_prefix(form.value)), None, record.allowed_origins, lookup
            identity = Identity(account_id=record.account_id, app_id=record.app_id, key_id=record.id,
                                key_type=wanted, allowed_origins=record.allowed_origins)
            if wanted == "secret":
                return (domain.AcceptedSecretKey(record.id, record.account_id, record.app_id), identity,
                        record.allowed_origins, lookup)
            return (domain.AcceptedPublishableKey(record.id, record.account_id, record.app_id), identity,
                    record.allowed_origins, lookup)
        if kind is domain.FormKind.ACCOUNT_TOKEN:
            lookup = await self._lookup_token(form.value, now)
            token = lookup.record if isinstance(lookup.record, store.TokenRecord) else None
            if token is None:
                return domain.RejectedCredential("account_token", domain.RejectionReason.UNKNOWN,
                                                 domain.key_prefix(form.value)), None, (), lookup
            return (domain.AcceptedAccountToken(token.user_id, token.account_id),
                    Identity(account_id=token.account_id, user_id=token.user_id, key_type="account_token"), (),
                    lookup)
        # an upload token: its signature first, then whether the key that minted it still lives
        check = domain.verify_upload_token(self.token_secret, form.value, now)
        key_live = False
        record = None
        found = None
        if check.claims is not None and not check.rejected:
            found = await self._lookup_key_id(check.claims.key_id, now)
            record = found.record if isinstance(found.record, store.KeyRecord) else None
            key_live = record is not None and not record.revoked
        outcome = domain.upload_token_outcome(check, key_live)
        # a good signature names its app, through the key that minted it (expired or revoked too); a bad one nothing
        origins = record.allowed_origins if record is not None else ()
        if isinstance(outcome, domain.ValidUploadToken) and record is not None:
            claims = outcome.claims
            return outcome, Identity(account_id=record.account_id, app_id=claims.app_id, key_id=claims.key_id,
                                     key_type="upload_token", video_id=claims.video_id), origins, found
        return outcome, None, origins, found

    # -------------------------------------------------------------------------------------------- check

    async def check(self, request: CheckRequest) -> CheckReply:
        return (await self.check_many([request]))[0]

    async def check_many(self, requests: list[CheckRequest]) -> list[CheckReply]:
        now = self.clock()
        staged = [self._staged(await self._template(r, now), now) for r in requests]
        await self._decide(staged, now)
        return [self._reply(st) for st in staged]

    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]:
        """Decide a batch of `auth.check` payloads; a payload seen before skips its parsing and lookup."""
        now = self.clock()
        staged: list[_Staged | bytes] = []
        for data in payloads:
            digest = hashlib.blake2b(data, digest_size=16, key=self._memo_key).digest()
            template = self._memo.get(digest)
            if template is not None and template.until <= now and not self._renewed(template, now):
                del self._memo[digest]  # rebuilt below, and remembered again only if its outcome may be
                template = None
            if template is None:
                try:
                    request = CheckRequest.model_validate_json(data)
                except ValidationError as exc:
                    staged.append(_invalid(exc))
                    continue
                template = await self._template(request, now)  # cache hits do not suspend: no task per request
                if isinstance(template.credential, _MEMO_KINDS):
                    if len(self._memo) >= MEMO_MAX:
                        self._memo.clear()
                    self._memo[digest] = template
            staged.append(self._staged(template, now))
        await self._decide([st for st in staged if isinstance(st, _Staged)], now)
        mode = self._mode()
        return [st if isinstance(st, bytes) else self._reply_bytes(st, mode) for st in staged]

    def forget_key(self, key_id: str) -> None:
        """A revoked key: out of the lookup cache and, with every remembered payload, out of the memo."""
        self.cache.forget_key(key_id)
        self._memo.clear()

    def forget_all(self) -> None:
        self.cache.clear()
        self._memo.clear()

    async def _decide(self, staged: list[_Staged], now: float) -> None:
        """Decide a batch of requests: each one as if alone, with at most one store increment per counter.

        Counts come from the leases of each counter (`LeasedCounters`) and, for those that ran out, one grant for
        the batch: the k requests of a batch that spend one counter get k consecutive numbers in arrival order, so
        counting stays exact while a flood costs at most one round trip per counter.
        """
        await self._read_blocks(staged, now)
        await self._recent_elsewhere(staged, now)
        users: dict[domain.CounterKey, list[_Staged]] = {}  # one object per budget: grouped by identity
        for st in staged:
            if st.decision is None:
                for key in st.plan.increments:
                    who = users.get(key)
                    if who is None:
                        users[key] = [st]
                    else:
                        who.append(st)
        # counts held in leases first, without waiting; the store only for counters whose lease ran out
        short: list[tuple[str, domain.CounterKey, list[_Staged]]] = []
        for key, who in users.items():
            rule = key.rule
            subject = self._subject(key, now)
            numbers = self.leases.take_now(subject, len(who), key, rule.id, rule.limit, key.window_end(now))
            for st, n in zip(who, numbers, strict=False):
                st.counts[key] = n
            if len(numbers) < len(who):
                short.append((subject, key, who[len(numbers):]))
        if short:
            granted = await asyncio.gather(*(
                self.leases.take(subject, len(who), key, key.rule.id, key.rule.limit, key.window_end(now))
                for subject, key, who in short
            ), return_exceptions=True)
            undecided: list[_Staged] = []
            for (_, key, who), got in zip(short, granted, strict=True):
                if isinstance(got, CounterStoreFailingOver):
                    undecided += who
                    continue
                if isinstance(got, BaseException):
                    raise got
                for st, n in zip(who, got, strict=True):
                    st.counts[key] = n
            if undecided:
                self._not_decided(undecided, now)
        fresh: list[tuple[domain.CounterKey, int]] = []
        statuses: dict[tuple[str, str, int], int] = {}
        allowed = 0
        share: list[tuple[str, str, float]] = []
        accepted: list[tuple[str, str]] = []
        at = domain.WindowsAt(now)
        memory = self.memory
        for st in staged:
            decision = st.decision
            if decision is None:
                decision = st.decision = domain.decide(st.plan, st.counts, now, at)
                if decision.remember:
                    fresh += [(k, until) for k, until in decision.remember if memory.refused_until(k, now) is None]
                    memory.remember_decision(decision, now)
            key_id = decision.accepted_key_id
            if key_id is not None:
                pair = (st.facts.address, key_id)
                accepted.append(pair)
                if memory and memory.refused_until(st.template.failure_key, now) is not None:
                    # a key let through a block: the other instances may need to know it (written now and then)
                    if self._recent_written.get(pair, -math.inf) + self._recent_share <= now:
                        self._recent_written[pair] = now
                        share.append((*pair, now))
            # by outcome (allowed, or the refusal's code) and the rule that refused it ("none" when no limit did)
            if decision.status == 200 and decision.refused_by is None:
                allowed += 1
                continue
            outcome = ("allowed" if decision.allowed else decision.code or str(decision.status),
                       decision.refused_by.id.value if decision.refused_by is not None else "none", decision.status)
            statuses[outcome] = statuses.get(outcome, 0) + 1
        if accepted:
            self.recent.record_many(accepted, now)
        if allowed:
            statuses[("allowed", "none", 200)] = statuses.get(("allowed", "none", 200), 0) + allowed
        for (outcome_name, rule_name, status), n in statuses.items():
            self.metrics.inc("checks_total", n, status=str(status))
            self.metrics.inc("check_decisions_total", n, outcome=outcome_name, rule=rule_name)
        if fresh:
            share += self._block_exceptions([k for k, _ in fresh], now)
            await self._tell_others(fresh)
        if share:
            self._background(self._share_recent(share))
        events = [ev for st in staged if st.plan.rejections for ev in self._rejection_events(st, now)]
        if events:
            await self._emit(events)  # one outbox write for the batch

    def _not_decided(self, staged: list[_Staged], now: float) -> None:
        """Requests whose counts the store could not give while it fails over: 503, and the numbers they took from
        other counters' leases held again (nothing is spent for a request that was not decided)."""
        refusal = domain.failing_over()
        for st in {id(st): st for st in staged}.values():
            for key, n in st.counts.items():
                if key in st.plan.increments:
                    self.leases.put_back(self._subject(key, now), [n])
            st.counts.clear()
            st.decision = refusal

    async def _read_blocks(self, staged: list[_Staged], now: float) -> None:
        """The `auth_failure` counters that requests not exempt from the block depend on, read from the shared store
        (a direct get: nothing written), so that a block set on any instance holds here, even on an instance started
        after it or one that missed the `auth.spent` broadcast. A spent one is remembered to the end of its window (by
        `decide`); one with room is trusted for `block_recheck_ms`, so a busy address costs one read per period."""
        wanted: dict[domain.CounterKey, list[_Staged]] = {}
        for st in staged:
            if st.decision is None:
                for key in st.plan.reads:
                    room = self._block_room.get(key)
                    if room is not None and room[0] > now:
                        st.counts[key] = room[1]
                    else:
                        wanted.setdefault(key, []).append(st)
        if not wanted:
            return
        totals = await asyncio.gather(*(self.counters.read(self._subject(key, now)) for key in wanted))
        if len(self._block_room) > MEMO_MAX:
            self._block_room.clear()
        for (key, who), total in zip(wanted.items(), totals, strict=True):
            if total < key.rule.limit:
                self._block_room[key] = (min(now + self._block_recheck, key.window_end(now)), total)
            for st in who:
                st.counts[key] = total

    async def _recent_elsewhere(self, staged: list[_Staged], now: float) -> None:
        """Requests that meet the block with a secret key this instance has not accepted from that address lately:
        the key gets through if another instance accepted it from there within the window (the shared record)."""
        asking: dict[tuple[str, str], list[_Staged]] = {}
        for st in staged:
            key_id = st.template.key_id
            if key_id is None or st.facts.recently_accepted_key or not self._meets_block(st, now):
                continue
            pair = (st.facts.address, key_id)
            if self._not_recent_until.get(pair, -math.inf) > now:
                continue
            asking.setdefault(pair, []).append(st)
        if not asking:
            return
        try:
            async with self.pool.acquire() as conn:
                found = await store.recent_keys(conn, list(asking))
        except Exception as exc:  # the block holds (fail closed); the next request asks again
            log.warning("could not read the keys accepted lately on other instances: %s", exc)
            return
        if len(self._not_recent_until) > MEMO_MAX:
            self._not_recent_until.clear()
        horizon = self.recent.horizon_seconds
        for pair, who in asking.items():
            at = found.get(pair)
            if at is None or not 0 <= now - at < horizon:
                # nobody accepted it there lately, as far as the shared record can lag behind
                self._not_recent_until[pair] = now + self._recent_share
                continue
            self.recent.record(*pair, at)
            for st in who:
                self._restage(st, now)

    def _block_exceptions(self, spent: list[domain.CounterKey], now: float) -> list[tuple[str, str, float]]:
        """Blocks this instance just learned of: the keys it accepted lately from those addresses, for the shared
        record (the block's exception holds on every instance, including ones started later). Written only when a
        block begins, since only a blocked address needs them, so accepting a key costs no write."""
        out: list[tuple[str, str, float]] = []
        for key in spent:
            if key.rule.id is domain.RuleId.AUTH_FAILURE:
                address = domain.subject_value(key.key)  # the counter's key is the address as a subject token
                for key_id, at in self.recent.accepted_from(address, now).items():
                    self._recent_written[(address, key_id)] = now
                    out.append((address, key_id, at))
        return out

    def _meets_block(self, st: _Staged, now: float) -> bool:
        """The request would be refused by its address's `auth_failure` block (remembered, or read just now)."""
        block = st.plan.block_check
        if block is None:
            return False
        if self.memory.refused_until(block, now) is not None:
            return True
        return st.decision is None and st.counts.get(block, 0) >= block.rule.limit

    def _restage(self, st: _Staged, now: float) -> None:
        """Stage the request again (its key now counts as recently accepted here), in place."""
        again = self._staged(st.template, now)
        st.facts, st.plan, st.decision = again.facts, again.plan, again.decision
        st.past_failure_limit = again.past_failure_limit

    async def _share_recent(self, accepted: list[tuple[str, str, float]]) -> None:
        try:
            async with self.pool.acquire() as conn:
                await store.record_recent_keys(conn, accepted)
        except Exception as exc:  # written again at the pair's next acceptance
            log.warning("could not record keys accepted lately for the other instances: %s", exc)
            for address, key_id, _ in accepted:
                self._recent_written.pop((address, key_id), None)

    async def forget_old_recent_keys(self) -> int:
        """Shared records older than the exception's horizon serve nobody; this instance's own tables too."""
        now = self.clock()
        horizon = self.recent.horizon_seconds
        self._recent_written = {p: at for p, at in self._recent_written.items() if now - at < horizon}
        self._not_recent_until = {p: t for p, t in self._not_recent_until.items() if t > now}
        self._block_room = {k: v for k, v in self._block_room.items() if v[0] > now}
        async with self.pool.acquire() as conn:
            return await store.forget_recent_keys(conn, now - horizon)

    async def _template(self, request: CheckRequest, now: float) -> _Template:
        """What a request amounts to before counting: its address, its credential looked up once, its identity."""
        address = domain.client_address(request.peer, request.forwarded_for, self.trusted)
        presented = domain.read_credentials(request.authorization, request.internal_token, self.internal_token)
        credential, identity, origins, lookup = await self._outcome(presented.credential, now)
        # CORS: decided here, once per remembered payload (the Origin is part of it), for answers and refusals alike
        cors_origin = request.origin if request.origin is not None and request.origin in origins else None
        if presented.internal is domain.InternalToken.REAL and identity is None:
            identity = Identity(key_type="internal")
        # remembered only until the lookup's refresh point: the next sight then goes through the cache, which
        # fetches the record again in the background, so a busy credential never waits for the database
        until = now + REFRESH_AHEAD * self.cache.ttl_seconds
        if isinstance(credential, domain.ValidUploadToken):
            until = min(until, credential.claims.expires_at)
        return _Template(
            request, address, credential, identity, presented.internal,
            credential.key_id if isinstance(credential, domain.AcceptedSecretKey) else None,
            domain.CounterKey.of(self.rules[domain.RuleId.AUTH_FAILURE], address), until,
            cors_origin=cors_origin, cors_json=_json(cors_origin) if cors_origin is not None else "null",
            lookup=lookup,
        )

    def _renewed(self, t: _Template, now: float) -> bool:
        """A remembered payload past its refresh point, kept when its lookup, read from the cache now, still finds
        the same record: remembered again until the next refresh point (the cache fetches the record again in the
        background, as for any hit past that point), instead of parsed, looked up and planned again.

        The payloads of a busy key are remembered within moments of each other, so they all came due together: auth
        then rebuilt every one of them in the next moments, each check costing a parse, a lookup and new plans, and
        its p99 rose with them (bench/RESULTS.md, issue 12). What a missed revocation can get away with is as
        before: a record fetched again that differs (revoked, other origins) rebuilds the payload, and no payload is
        remembered past its lookup's expiry."""
        credential = t.credential
        until = now + REFRESH_AHEAD * self.cache.ttl_seconds
        if isinstance(credential, domain.ValidUploadToken):
            if credential.claims.expires_at <= now:
                return False  # an upload token's outcome changes at its expiry
            until = min(until, credential.claims.expires_at)
        lookup = t.lookup
        if lookup is None:
            if not isinstance(credential, domain.NoCredential):
                return False
        else:
            hit = self.cache.get(lookup.slot, now)
            if hit is None or hit.record != lookup.record:
                return False
            self._refresh_if_due(lookup.slot, hit, now, lookup.fetch)
            until = min(until, hit.until)
        t.until = until
        self.metrics.inc("check_payloads_renewed_total")
        return True

    def _staged(self, t: _Template, now: float) -> _Staged:
        """A request's plan (which depends on whether its key was accepted here lately) and a remembered refusal."""
        recent = t.key_id is not None and self.recent.accepted_within(t.address, t.key_id, now)
        planned = t.plans.get(recent)
        if planned is None:
            request = t.request
            facts = domain.RequestFacts(
                route=domain.RouteClass(request.route_class),
                address=t.address,
                credential=t.credential,
                internal=t.internal,
                operation=domain.ManagementOperation(request.operation) if request.operation else None,
                video_id=request.video_id,
                recently_accepted_key=recent,
            )
            planned = t.plans[recent] = (facts, domain.plan_counts(facts, self.rules))
        facts, plan = planned
        if not self.memory:  # nothing is known as spent (most of the time): nothing to refuse from memory
            return _Staged(t, facts, plan, False, None)
        past_failure_limit = self.memory.refused_until(t.failure_key, now) is not None  # before this request
        decision = domain.refusal_from_memory(plan, self.memory, now, lambda key: self._holds(key, now))
        if decision is not None:
            self.metrics.inc("limit_refusals_from_memory_total", help="429s answered without the counter store")
        return _Staged(t, facts, plan, past_failure_limit, decision)

    def _subject(self, key: domain.CounterKey, now: float) -> str:
        return domain.counter_subject(COUNTER_PREFIX, key, key.window_start(now))

    def _holds(self, key: domain.CounterKey, now: float) -> bool:
        """This instance still holds leased counts of the key's current window."""
        return self.leases.held(self._subject(key, now)) > 0

    def _gave_back(self, key: domain.CounterKey) -> None:
        """Counts of `key` went back to the store: here and on every instance, it is no longer known as spent."""
        self.memory.forget(key)
        if self.broadcast is not None:
            self._background(self._tell_others([(key, 0)]))

    def _background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mode(self) -> Literal["shared", "local"]:
        return "local" if self.counter_mode() == "local" else "shared"

    def _reply(self, st: _Staged) -> CheckReply:
        decision = st.decision
        assert decision is not None
        # model_construct: every field was made here, from validated values; nothing to check again per request
        return CheckReply.model_construct(
            allowed=decision.allowed,
            status=decision.status,
            problem=decision.problem(),
            headers=decision.headers(),
            identity=st.template.identity if decision.allowed else None,
            client_address=st.facts.address,
            counter_mode=self._mode(),
            cors_origin=st.template.cors_origin,
        )

    def _reply_bytes(self, st: _Staged, mode: Literal["shared", "local"]) -> bytes:
        """The reply as `CheckReply` JSON, written directly (the same value as `_reply`'s, a third of the cost:
        the identity's JSON is made once per remembered payload), its fields in the model's order: the headers
        last, for the edge's memo (shared/authclient.py's check_reply)."""
        decision = st.decision
        assert decision is not None
        if decision.status == 200:
            head, tail = st.template.allowed_reply_parts()
            return f"{head}{mode}{tail}{decision.headers_json()}}}".encode()
        return (
            f'{{"allowed":false,"status":{decision.status},"problem":{_json(decision.problem())},"identity":null,'
            f'"client_address":{_json(st.facts.address)},"counter_mode":"{mode}",'
            f'"cors_origin":{st.template.cors_json},"headers":{decision.headers_json()}}}'
        ).encode()

    # ----------------------------------------------------------------------------- spent budgets, shared

    async def _tell_others(self, spent: list[tuple[domain.CounterKey, int]]) -> None:
        if self.broadcast is None:
            return
        try:
            await self.broadcast(SpentBudgets([(str(k.rule.id), k.key, until) for k, until in spent]))
        except Exception as exc:  # the others then learn from their own counts, one request later
            log.warning("could not share spent budgets: %s", exc)

    def learn_spent(self, budgets: SpentBudgets) -> None:
        """Another instance saw these budgets spent until the end of their windows."""
        now = self.clock()
        learned: list[domain.CounterKey] = []
        for rule_id, key, until in budgets.root:
            try:
                counter = domain.CounterKey(self.rules[domain.RuleId(rule_id)], key)
            except (ValueError, KeyError) as exc:  # a rule this instance does not know (a newer one's)
                log.warning("ignored a spent budget of an unknown rule: %s", exc)
                continue
            if until == 0:  # counts were given back: the budget may have room again
                self.memory.forget(counter)
            else:
                if self.memory.refused_until(counter, now) is None:
                    learned.append(counter)
                self.memory.remember(counter, until, now)
        share = self._block_exceptions(learned, now)
        if share:
            self._background(self._share_recent(share))

    # ----------------------------------------------------------------------------------- rejected events

    def _rejection_events(self, st: _Staged, now: float) -> list[CredentialRejected]:
        """The request's `credential.rejected` events to write now; past the address's limit they are folded."""
        found = st.plan.rejections
        if not found:
            return []
        events = [
            CredentialRejected(credential_kind=r.kind, reason=str(r.reason), client_address=st.facts.address,
                               key_prefix=r.key_prefix, route=st.template.request.route)
            for r in found
        ]
        self.metrics.inc("credentials_rejected_total", len(events), "rejected credentials")
        if st.past_failure_limit:
            for ev in events:
                self.folding.fold(ev, st.template.failure_key.window_start(now))
            return []
        return events

    async def flush_folded(self) -> int:
        events = self.folding.due(self.clock(), self.rules[domain.RuleId.AUTH_FAILURE].window_seconds)
        if events:
            await self._emit(events)
        return len(events)

    async def _emit(self, events: list[CredentialRejected]) -> None:
        try:
            async with self.pool.acquire() as conn:
                await enqueue(conn, *(new_event(e, source="auth", subject=e.client_address) for e in events))
        except Exception as exc:  # the decision stands; losing a security event is logged, never silent
            log.error("credential.rejected not recorded: %s", exc)

    async def close(self) -> None:
        """Leased counts back to the store and spent budgets told, before the connection closes."""
        await self.leases.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def run_folding(self, stop: asyncio.Event) -> None:
        forget_at = self.clock() + self.recent.horizon_seconds
        while not stop.is_set():
            try:
                await self.flush_folded()
                if self.clock() >= forget_at:
                    forget_at = self.clock() + self.recent.horizon_seconds
                    await self.forget_old_recent_keys()
            except Exception as exc:  # tried again in a second
                log.warning("housekeeping of folded rejections or recent keys failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
        # on shutdown every folded window counts as ended, so nothing folded is lost
        events = self.folding.due(math.inf, self.rules[domain.RuleId.AUTH_FAILURE].window_seconds)
        if events:
            await self._emit(events)
