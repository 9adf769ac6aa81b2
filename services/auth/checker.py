"""The `auth.check` adapter: one credential lookup, the counters, the decision, and what it publishes.

The decisions are `services.auth.domain`'s; this module does the I/O around them: key and token lookups (with a
cache that `key.revoked` empties on every instance), the shared counters, and `credential.rejected` events
(folded per address and window once an address is past its `auth_failure` limit, so a flood does not flood the bus).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from services.auth import domain, store
from services.auth.counters import CounterStore
from services.auth.settings import AuthSettings
from shared.authcheck import CheckReply, CheckRequest, Identity
from shared.bus import enqueue
from shared.events import CredentialRejected, new_event
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.check")

COUNTER_PREFIX = "limits"
SPENT_SUBJECT = "auth.spent"
_KEY_TYPES = {"secret": "secret", "publishable": "publishable"}


Record = store.KeyRecord | store.TokenRecord


@dataclass
class _Cached:
    record: Record | None
    until: float


@dataclass
class LookupCache:
    """Key and token lookups by hash; a revoked key leaves it on every instance through `key.revoked`."""

    ttl_seconds: float
    negative_ttl_seconds: float
    _entries: dict[str, _Cached] = field(default_factory=dict)
    _by_key_id: dict[str, set[str]] = field(default_factory=dict)  # a key is cached by its hash and by its id

    def get(self, digest: str, now: float) -> _Cached | None:
        hit = self._entries.get(digest)
        if hit is None or hit.until <= now:
            return None
        return hit

    def put(self, slot: str, record: Record | None, now: float) -> None:
        if len(self._entries) > 100_000:
            self.clear()
        ttl = self.ttl_seconds if record is not None else self.negative_ttl_seconds
        self._entries[slot] = _Cached(record, now + ttl)
        if isinstance(record, store.KeyRecord):
            self._by_key_id.setdefault(record.id, set()).add(slot)

    def forget_key(self, key_id: str) -> None:
        for slot in self._by_key_id.pop(key_id, set()) | {f"id:{key_id}"}:
            self._entries.pop(slot, None)

    def clear(self) -> None:
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


@dataclass
class _Staged:
    """One request of a batch between its lookup and its decision."""

    request: CheckRequest
    facts: domain.RequestFacts
    identity: Identity | None
    plan: domain.CountPlan
    failure_key: domain.CounterKey
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
        broadcast: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.broadcast = broadcast
        self.settings = settings
        self.pool = pool
        self.counters = counters
        self.metrics = metrics or Metrics("auth")
        self.clock = clock
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

    # ------------------------------------------------------------------------------------------- lookups

    async def _cached(
        self, slot: str, now: float, fetch: Callable[[asyncpg.Connection], Awaitable[Record | None]]
    ) -> Record | None:
        """One lookup through the cache (hits and misses alike); `key.revoked` empties a key's slots."""
        hit = self.cache.get(slot, now)
        if hit is not None:
            return hit.record
        async with self.pool.acquire() as conn:
            record = await fetch(conn)
        self.cache.put(slot, record, now)
        return record

    async def _lookup_key(self, raw: str, now: float) -> store.KeyRecord | None:
        digest = domain.key_hash(self.hash_secret, raw)
        record = await self._cached(digest, now, lambda c: store.key_by_hash(c, digest))
        return record if isinstance(record, store.KeyRecord) else None

    async def _lookup_key_id(self, key_id: str, now: float) -> store.KeyRecord | None:
        record = await self._cached(f"id:{key_id}", now, lambda c: store.key_by_id(c, key_id))
        return record if isinstance(record, store.KeyRecord) else None

    async def _lookup_token(self, raw: str, now: float) -> store.TokenRecord | None:
        digest = domain.key_hash(self.hash_secret, raw)
        record = await self._cached(digest, now, lambda c: store.account_token_by_hash(c, digest))
        return record if isinstance(record, store.TokenRecord) else None

    async def outcome(
        self, form: domain.CredentialForm, now: float
    ) -> tuple[domain.CredentialOutcome, Identity | None]:
        """The one lookup of the request's credential: what it amounts to, and the identity it carries."""
        kind = form.kind
        if kind is domain.FormKind.NONE:
            return domain.NoCredential(), None
        if kind is domain.FormKind.MALFORMED:
            return domain.malformed_credential(form), None
        if kind in (domain.FormKind.SECRET_KEY, domain.FormKind.PUBLISHABLE_KEY):
            wanted = "secret" if kind is domain.FormKind.SECRET_KEY else "publishable"
            record = await self._lookup_key(form.value, now)
            catalog_kind = form.looks_like or "secret_key"
            if record is None or record.kind != wanted:
                return domain.RejectedCredential(catalog_kind, domain.RejectionReason.UNKNOWN,
                                                 domain.key_prefix(form.value)), None
            if record.revoked:
                return domain.RejectedCredential(catalog_kind, domain.RejectionReason.REVOKED,
                                                 domain.key_prefix(form.value)), None
            identity = Identity(account_id=record.account_id, app_id=record.app_id, key_id=record.id,
                                key_type=wanted, allowed_origins=record.allowed_origins)
            if wanted == "secret":
                return domain.AcceptedSecretKey(record.id, record.account_id, record.app_id), identity
            return domain.AcceptedPublishableKey(record.id, record.account_id, record.app_id), identity
        if kind is domain.FormKind.ACCOUNT_TOKEN:
            token = await self._lookup_token(form.value, now)
            if token is None:
                return domain.RejectedCredential("account_token", domain.RejectionReason.UNKNOWN,
                                                 domain.key_prefix(form.value)), None
            return (domain.AcceptedAccountToken(token.user_id, token.account_id),
                    Identity(account_id=token.account_id, user_id=token.user_id, key_type="account_token"))
        # an upload token: its signature first, then whether the key that minted it still lives
        check = domain.verify_upload_token(self.token_secret, form.value, now)
        key_live = False
        record = None
        if check.claims is not None and not check.rejected:
            record = await self._lookup_key_id(check.claims.key_id, now)
            key_live = record is not None and not record.revoked
        outcome = domain.upload_token_outcome(check, key_live)
        if isinstance(outcome, domain.ValidUploadToken) and record is not None:
            claims = outcome.claims
            return outcome, Identity(account_id=record.account_id, app_id=claims.app_id, key_id=claims.key_id,
                                key_type="upload_token", video_id=claims.video_id)
        return outcome, None

    # -------------------------------------------------------------------------------------------- check

    async def check(self, request: CheckRequest) -> CheckReply:
        return (await self.check_many([request]))[0]

    async def check_many(self, requests: list[CheckRequest]) -> list[CheckReply]:
        """Decide a batch of requests: each one as if alone, with one store increment per counter for the batch.

        The k requests of a batch that spend one counter are counted by one `+k`; the store's total T gives them
        T-k+1 ... T in arrival order, so counting stays exact while a flood costs one round trip per counter.
        """
        now = self.clock()
        staged = [await self._stage(r, now) for r in requests]  # cache hits do not suspend: no task per request
        users: dict[str, list[tuple[_Staged, domain.CounterKey]]] = {}
        for st in staged:
            if st.decision is None:
                for key in st.plan.increments:
                    subject = domain.counter_subject(COUNTER_PREFIX, key, key.window_start(now))
                    users.setdefault(subject, []).append((st, key))
        totals = await asyncio.gather(*(self.counters.incr(subject, len(who)) for subject, who in users.items()))
        for who, total in zip(users.values(), totals, strict=True):
            first = total - len(who) + 1
            for i, (st, key) in enumerate(who):
                st.counts[key] = first + i
        fresh: list[tuple[domain.CounterKey, int]] = []
        replies = []
        for st in staged:
            if st.decision is None:
                st.decision = domain.decide(st.plan, st.counts, now)
                fresh += [(k, until) for k, until in st.decision.remember
                          if self.memory.refused_until(k, now) is None]
                self.memory.remember_decision(st.decision, now)
            replies.append(self._reply(st, now))
        if fresh:
            await self._tell_others(fresh)
        events = [ev for st in staged for ev in self._rejection_events(st, now)]
        if events:
            await self._emit(events)  # one outbox write for the batch
        return replies

    async def _stage(self, request: CheckRequest, now: float) -> _Staged:
        """What a request amounts to before counting: its credential looked up once, its plan, a remembered refusal."""
        address = domain.client_address(request.peer, request.forwarded_for, self.trusted)
        presented = domain.read_credentials(request.authorization, request.internal_token, self.internal_token)
        credential, identity = await self.outcome(presented.credential, now)
        key_id = credential.key_id if isinstance(credential, domain.AcceptedSecretKey) else None
        facts = domain.RequestFacts(
            route=domain.RouteClass(request.route_class),
            address=address,
            credential=credential,
            internal=presented.internal,
            operation=domain.ManagementOperation(request.operation) if request.operation else None,
            video_id=request.video_id,
            recently_accepted_key=key_id is not None and self.recent.accepted_within(address, key_id, now),
        )
        plan = domain.plan_counts(facts, self.rules)
        failure_key = domain.CounterKey.of(self.rules[domain.RuleId.AUTH_FAILURE], address)
        past_failure_limit = self.memory.refused_until(failure_key, now) is not None  # before this request
        decision = domain.refusal_from_memory(plan, self.memory, now)
        if decision is not None:
            self.metrics.inc("limit_refusals_from_memory_total", help="429s answered without the counter store")
        if presented.internal is domain.InternalToken.REAL and identity is None:
            identity = Identity(key_type="internal")
        return _Staged(request, facts, identity, plan, failure_key, past_failure_limit, decision)

    def _reply(self, st: _Staged, now: float) -> CheckReply:
        decision = st.decision
        assert decision is not None
        if decision.accepted_key_id is not None:
            self.recent.record(st.facts.address, decision.accepted_key_id, now)
        self.metrics.inc("checks_total", help="auth.check decisions", status=str(decision.status))
        # model_construct: every field was made here, from validated values; nothing to check again per request
        return CheckReply.model_construct(
            allowed=decision.allowed,
            status=decision.status,
            problem=decision.problem(),
            headers=decision.headers(),
            identity=st.identity if decision.allowed else None,
            client_address=st.facts.address,
            counter_mode="local" if self.counter_mode() == "local" else "shared",
        )

    # ----------------------------------------------------------------------------- spent budgets, shared

    async def _tell_others(self, spent: list[tuple[domain.CounterKey, int]]) -> None:
        if self.broadcast is None:
            return
        payload = json.dumps([[str(k.rule.id), k.key, until] for k, until in spent]).encode()
        try:
            await self.broadcast(payload)
        except Exception as exc:  # the others then learn from their own counts, one request later
            log.warning("could not share spent budgets: %s", exc)

    def learn_spent(self, payload: bytes) -> None:
        """Another instance saw these budgets spent until the end of their windows."""
        now = self.clock()
        try:
            for rule_id, key, until in json.loads(payload):
                rule = self.rules[domain.RuleId(rule_id)]
                self.memory.remember(domain.CounterKey(rule, str(key)), int(until), now)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignored a malformed auth.spent message: %s", exc)

    # ----------------------------------------------------------------------------------- rejected events

    def _rejection_events(self, st: _Staged, now: float) -> list[CredentialRejected]:
        """The request's `credential.rejected` events to write now; past the address's limit they are folded."""
        found = domain.rejections(st.facts)
        if not found:
            return []
        events = [
            CredentialRejected(credential_kind=r.kind, reason=str(r.reason), client_address=st.facts.address,
                               key_prefix=r.key_prefix, route=st.request.route)
            for r in found
        ]
        self.metrics.inc("credentials_rejected_total", len(events), "rejected credentials")
        if st.past_failure_limit:
            for ev in events:
                self.folding.fold(ev, st.failure_key.window_start(now))
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

    async def run_folding(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                await self.flush_folded()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
        # on shutdown every folded window counts as ended, so nothing folded is lost
        events = self.folding.due(math.inf, self.rules[domain.RuleId.AUTH_FAILURE].window_seconds)
        if events:
            await self._emit(events)
