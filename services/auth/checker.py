"""The `auth.check` adapter: a batch of payloads decided with at most one counter-store round trip per counter.

The decisions are `services.auth.domain`'s; around them: credential lookups (services/auth/lookups.py), the replies
(replies.py), the shared counters with their leases, budgets known spent shared between instances (`auth.spent`),
the block's exception for keys accepted lately on any instance, and `credential.rejected` events (rejections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable

import asyncpg
from pydantic import ValidationError

from services.auth import store
from services.auth.counters import CounterStore, CounterStoreFailingOver, ResilientCounters
from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    ManagementOperation,
    NoCredential,
    RequestFacts,
    RouteClass,
    ValidUploadToken,
)
from services.auth.domain.addresses import client_address, parse_trusted_proxies
from services.auth.domain.credentials import InternalToken, read_credentials
from services.auth.domain.lease_rules import LeasePolicy
from services.auth.domain.limits import decide, failing_over, plan_counts
from services.auth.domain.memory import RecentAcceptedKeys, RefusalMemory, refusal_from_memory
from services.auth.domain.rules import CounterKey, RuleId, counter_subject, rules_from, subject_value
from services.auth.domain.throttled import (
    CallerClass,
    RecentRefusals,
    RefusedCaller,
    presented_key_prefix,
    refused_caller,
)
from services.auth.domain.windows import WindowsAt
from services.auth.leases import LeasedCounters
from services.auth.lookups import REFRESH_AHEAD, CredentialLookups, LookupCache
from services.auth.rejections import RejectionEvents
from services.auth.replies import PendingCheck, RememberedPayload, invalid_reply, reply_bytes, reply_model
from services.auth.settings import AuthSettings
from services.auth.spent import SpentBudgets
from shared.authcheck import CheckReply, CheckRequest, CounterMode, Identity
from shared.contracts import COUNTER_PREFIX
from shared.metrics import Metrics

log = logging.getLogger("weir.auth.check")


# credentials whose outcome stays the same while their lookup is cached (an upload token's also ends at its expiry)
_MEMO_KINDS = (AcceptedSecretKey, AcceptedPublishableKey, AcceptedAccountToken,
               ValidUploadToken, NoCredential)
MEMO_MAX = 100_000


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
        self.leases: LeasedCounters[CounterKey] = LeasedCounters(
            counters,
            LeasePolicy(settings.counter_lease_max, settings.counter_lease_fraction),
            idle_seconds=settings.counter_lease_idle_ms / 1000,
            metrics=self.metrics,
            on_give_back=self._gave_back,
        )
        if isinstance(counters, ResilientCounters):
            counters.send_late_totals_to(self.leases.late_grant)
        self.counter_mode = counter_mode
        self.rules = rules_from(settings)
        self.trusted = parse_trusted_proxies(settings.trusted_proxies)
        self.internal_token = settings.internal_token.get_secret_value()
        self.hash_secret = settings.key_hash_secret.get_secret_value().encode()
        self.token_secret = settings.upload_token_secret.get_secret_value().encode()
        if not self.hash_secret or not self.token_secret:
            raise ValueError("WEIR_KEY_HASH_SECRET and WEIR_UPLOAD_TOKEN_SECRET must be set")
        self.cache = LookupCache(ttl_seconds=settings.key_cache_seconds, negative_ttl_seconds=2.0)
        self.lookups = CredentialLookups(pool=pool, metrics=self.metrics, clock=lambda: self.clock(),
                                         hash_secret=self.hash_secret, token_secret=self.token_secret,
                                         cache=self.cache, background=self._background)
        self.memory = RefusalMemory()
        self.recent = RecentAcceptedKeys(float(settings.limit_window_seconds))
        self.rejections = RejectionEvents(pool, self.metrics, self.rules[RuleId.AUTH_FAILURE].window_seconds)
        # who is throttled: 429s by caller and rule, for `GET /throttled` (services/auth/throttled.py)
        self.refusals = RecentRefusals(settings.throttled_window_seconds, settings.throttled_windows,
                                       settings.throttled_capacity)
        # internal traffic's series exist at 0 from the start, so that an alert's increase() sees its first 429
        for rule_id in RuleId:
            self.metrics.inc("limit_refusals_total", 0, caller=CallerClass.INTERNAL.value, rule=rule_id.value)
        self._tasks: set[asyncio.Future[None]] = set()
        # payload (keyed hash, never the payload: it holds a secret) -> what it amounts to; emptied on revocations
        self._memo: dict[bytes, RememberedPayload] = {}
        self._memo_key = secrets.token_bytes(32)
        # the auth_failure block comes from the shared counter: a reading that found room is trusted this long
        self._block_room: dict[CounterKey, tuple[float, int]] = {}
        self._block_recheck = settings.block_recheck_ms / 1000
        # keys accepted from an address, shared through the database so that every instance honours the block's
        # exception: when this instance last wrote each pair, and pairs known not to be recent anywhere
        self._recent_share = settings.recent_key_share_seconds
        self._recent_written: dict[tuple[str, str], float] = {}
        self._not_recent_until: dict[tuple[str, str], float] = {}

    # -------------------------------------------------------------------------------------------- check

    async def check(self, request: CheckRequest) -> CheckReply:
        return (await self.check_many([request]))[0]

    async def check_many(self, requests: list[CheckRequest]) -> list[CheckReply]:
        now = self.clock()
        staged = [self._staged(await self._remembered(r, now), now) for r in requests]
        await self._decide(staged, now)
        mode = self._mode()
        return [reply_model(st, mode) for st in staged]

    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]:
        """Decide a batch of `auth.check` payloads; a payload seen before skips its parsing and lookup."""
        now = self.clock()
        staged: list[PendingCheck | bytes] = []
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
                    staged.append(invalid_reply(exc))
                    continue
                template = await self._remembered(request, now)  # cache hits do not suspend: no task per request
                if isinstance(template.credential, _MEMO_KINDS):
                    if len(self._memo) >= MEMO_MAX:
                        self._memo.clear()
                    self._memo[digest] = template
            staged.append(self._staged(template, now))
        await self._decide([st for st in staged if isinstance(st, PendingCheck)], now)
        mode = self._mode()
        return [st if isinstance(st, bytes) else reply_bytes(st, mode) for st in staged]

    def forget_key(self, key_id: str) -> None:
        """A revoked key: out of the lookup cache and, with every remembered payload, out of the memo."""
        self.cache.forget_key(key_id)
        self._memo.clear()

    def forget_all(self) -> None:
        self.cache.clear()
        self._memo.clear()

    async def _decide(self, staged: list[PendingCheck], now: float) -> None:
        """Decide a batch of requests: each one as if alone, with at most one store increment per counter.

        Counts come from the leases of each counter (`LeasedCounters`) and, for those that ran out, one grant for
        the batch: the k requests of a batch that spend one counter get k consecutive numbers in arrival order, so
        counting stays exact while a flood costs at most one round trip per counter.
        """
        await self._read_blocks(staged, now)
        await self._recent_elsewhere(staged, now)
        users: dict[CounterKey, list[PendingCheck]] = {}  # one object per budget: grouped by identity
        for st in staged:
            if st.decision is None:
                for key in st.plan.increments:
                    who = users.get(key)
                    if who is None:
                        users[key] = [st]
                    else:
                        who.append(st)
        # counts held in leases first, without waiting; the store only for counters whose lease ran out
        short: list[tuple[str, CounterKey, list[PendingCheck]]] = []
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
            undecided: list[PendingCheck] = []
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
        fresh: list[tuple[CounterKey, int]] = []
        statuses: dict[tuple[str, str, int], int] = {}
        throttled: dict[tuple[str, str], int] = {}
        allowed = 0
        share: list[tuple[str, str, float]] = []
        accepted: list[tuple[str, str]] = []
        at = WindowsAt(now)
        memory = self.memory
        for st in staged:
            decision = st.decision
            if decision is None:
                decision = st.decision = decide(st.plan, st.counts, now, at)
                if decision.remember:
                    fresh += [(k, until) for k, until in decision.remember if memory.refused_until(k, now) is None]
                    memory.remember_decision(decision, now)
            key_id = decision.accepted_key_id
            if key_id is not None:
                pair = (st.facts.address, key_id)
                accepted.append(pair)
                if memory and memory.refused_until(st.payload.failure_key, now) is not None:
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
            if decision.status == 429 and decision.refused_by is not None:
                refused_as = self._refused_as(st.payload)
                rule_name = decision.refused_by.id.value
                throttled[(refused_as.caller, rule_name)] = throttled.get((refused_as.caller, rule_name), 0) + 1
                self.refusals.record(refused_as, rule_name, now)
        if accepted:
            self.recent.record_many(accepted, now)
        if allowed:
            statuses[("allowed", "none", 200)] = statuses.get(("allowed", "none", 200), 0) + allowed
        for (outcome_name, rule_name, status), n in statuses.items():
            self.metrics.inc("checks_total", n, status=str(status))
            self.metrics.inc("check_decisions_total", n, outcome=outcome_name, rule=rule_name)
        for (caller, rule_name), n in throttled.items():
            self.metrics.inc("limit_refusals_total", n, caller=caller, rule=rule_name)
        if fresh:
            share += self._block_exceptions([k for k, _ in fresh], now)
            await self._tell_others(fresh)
        if share:
            self._background(self._share_recent(share))
        events = [ev for st in staged if st.plan.rejections for ev in self.rejections.of(st, now)]
        if events:
            await self.rejections.emit(events)  # one outbox write for the batch

    @staticmethod
    def _refused_as(payload: RememberedPayload) -> RefusedCaller:
        """Who a refused payload is, as `weir status` shows it (made once per remembered payload)."""
        who = payload.refused_as
        if who is None:
            identity = payload.identity
            who = payload.refused_as = refused_caller(
                payload.credential, payload.internal, payload.address,
                account_id=identity.account_id if identity is not None else None,
                presented_prefix=presented_key_prefix(payload.request.authorization))
        return who

    def _not_decided(self, staged: list[PendingCheck], now: float) -> None:
        """Requests whose counts the store could not give while it fails over: 503, and the numbers they took from
        other counters' leases held again (nothing is spent for a request that was not decided)."""
        refusal = failing_over()
        for st in {id(st): st for st in staged}.values():
            for key, n in st.counts.items():
                if key in st.plan.increments:
                    self.leases.put_back(self._subject(key, now), [n])
            st.counts.clear()
            st.decision = refusal

    async def _read_blocks(self, staged: list[PendingCheck], now: float) -> None:
        """The `auth_failure` counters that requests not exempt from the block depend on, read from the shared store
        (a direct get: nothing written), so that a block set on any instance holds here, even on an instance started
        after it or one that missed the `auth.spent` broadcast. A spent one is remembered to the end of its window (by
        `decide`); one with room is trusted for `block_recheck_ms`, so a busy address costs one read per period."""
        wanted: dict[CounterKey, list[PendingCheck]] = {}
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

    async def _recent_elsewhere(self, staged: list[PendingCheck], now: float) -> None:
        """Requests that meet the block with a secret key this instance has not accepted from that address lately:
        the key gets through if another instance accepted it from there within the window (the shared record)."""
        asking: dict[tuple[str, str], list[PendingCheck]] = {}
        for st in staged:
            key_id = st.payload.key_id
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

    def _block_exceptions(self, spent: list[CounterKey], now: float) -> list[tuple[str, str, float]]:
        """Blocks this instance just learned of: the keys it accepted lately from those addresses, for the shared
        record (the block's exception holds on every instance, including ones started later). Written only when a
        block begins, since only a blocked address needs them, so accepting a key costs no write."""
        out: list[tuple[str, str, float]] = []
        for key in spent:
            if key.rule.id is RuleId.AUTH_FAILURE:
                address = subject_value(key.key)  # the counter's key is the address as a subject token
                for key_id, at in self.recent.accepted_from(address, now).items():
                    self._recent_written[(address, key_id)] = now
                    out.append((address, key_id, at))
        return out

    def _meets_block(self, st: PendingCheck, now: float) -> bool:
        """The request would be refused by its address's `auth_failure` block (remembered, or read just now)."""
        block = st.plan.block_check
        if block is None:
            return False
        if self.memory.refused_until(block, now) is not None:
            return True
        return st.decision is None and st.counts.get(block, 0) >= block.rule.limit

    def _restage(self, st: PendingCheck, now: float) -> None:
        """Stage the request again (its key now counts as recently accepted here), in place."""
        again = self._staged(st.payload, now)
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

    async def _remembered(self, request: CheckRequest, now: float) -> RememberedPayload:
        """What a request amounts to before counting: its address, its credential looked up once, its identity."""
        address = client_address(request.peer, request.forwarded_for, self.trusted)
        presented = read_credentials(request.authorization, request.internal_token, self.internal_token)
        found = await self.lookups.credential(presented.credential, now)
        credential, identity = found.outcome, found.identity
        # CORS: decided here, once per remembered payload (the Origin is part of it), for answers and refusals alike
        cors_origin = request.origin if request.origin is not None and request.origin in found.origins else None
        if presented.internal is InternalToken.REAL and identity is None:
            identity = Identity(key_type="internal")
        # remembered only until the lookup's refresh point: the next sight then goes through the cache, which
        # fetches the record again in the background, so a busy credential never waits for the database
        until = now + REFRESH_AHEAD * self.cache.ttl_seconds
        if isinstance(credential, ValidUploadToken):
            until = min(until, credential.claims.expires_at)
        return RememberedPayload(
            request, address, credential, identity, presented.internal,
            credential.key_id if isinstance(credential, AcceptedSecretKey) else None,
            CounterKey.of(self.rules[RuleId.AUTH_FAILURE], address), until,
            cors_origin=cors_origin, lookup=found.lookup,
        )

    def _renewed(self, t: RememberedPayload, now: float) -> bool:
        """A remembered payload past its refresh point is kept while its lookup, read from the cache now, still finds
        the same record (remembered to the next refresh point), rather than parsed, looked up and planned again: the
        payloads of a busy key come due together. A record fetched again that differs rebuilds the payload, and no
        payload outlives its lookup's expiry."""
        credential = t.credential
        until = now + REFRESH_AHEAD * self.cache.ttl_seconds
        if isinstance(credential, ValidUploadToken):
            if credential.claims.expires_at <= now:
                return False  # an upload token's outcome changes at its expiry
            until = min(until, credential.claims.expires_at)
        lookup = t.lookup
        if lookup is None:
            if not isinstance(credential, NoCredential):
                return False
        else:
            hit = self.cache.get(lookup.slot, now)
            if hit is None or hit.record != lookup.record:
                return False
            self.lookups.refresh_if_due(lookup.slot, hit, now, lookup.fetch)
            until = min(until, hit.until)
        t.until = until
        self.metrics.inc("check_payloads_renewed_total")
        return True

    def _staged(self, t: RememberedPayload, now: float) -> PendingCheck:
        """A request's plan (which depends on whether its key was accepted here lately) and a remembered refusal."""
        recent = t.key_id is not None and self.recent.accepted_within(t.address, t.key_id, now)
        planned = t.plans.get(recent)
        if planned is None:
            request = t.request
            facts = RequestFacts(
                route=RouteClass(request.route_class),
                address=t.address,
                credential=t.credential,
                internal=t.internal,
                operation=ManagementOperation(request.operation) if request.operation else None,
                video_id=request.video_id,
                recently_accepted_key=recent,
            )
            planned = t.plans[recent] = (facts, plan_counts(facts, self.rules))
        facts, plan = planned
        if not self.memory:  # nothing is known as spent (most of the time): nothing to refuse from memory
            return PendingCheck(t, facts, plan, False, None)
        past_failure_limit = self.memory.refused_until(t.failure_key, now) is not None  # before this request
        decision = refusal_from_memory(plan, self.memory, now, lambda key: self._holds(key, now))
        if decision is not None:
            self.metrics.inc("limit_refusals_from_memory_total", help="429s answered without the counter store")
        return PendingCheck(t, facts, plan, past_failure_limit, decision)

    def _subject(self, key: CounterKey, now: float) -> str:
        return counter_subject(COUNTER_PREFIX, key, key.window_start(now))

    def _holds(self, key: CounterKey, now: float) -> bool:
        """This instance still holds leased counts of the key's current window."""
        return self.leases.held(self._subject(key, now)) > 0

    def _gave_back(self, key: CounterKey) -> None:
        """Counts of `key` went back to the store: here and on every instance, it is no longer known as spent."""
        self.memory.forget(key)
        if self.broadcast is not None:
            self._background(self._tell_others([(key, 0)]))

    def _background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mode(self) -> CounterMode:
        return "local" if self.counter_mode() == "local" else "shared"

    # ----------------------------------------------------------------------------- spent budgets, shared

    async def _tell_others(self, spent: list[tuple[CounterKey, int]]) -> None:
        if self.broadcast is None:
            return
        try:
            await self.broadcast(SpentBudgets([(str(k.rule.id), k.key, until) for k, until in spent]))
        except Exception as exc:  # the others then learn from their own counts, one request later
            log.warning("could not share spent budgets: %s", exc)

    def learn_spent(self, budgets: SpentBudgets) -> None:
        """Another instance saw these budgets spent until the end of their windows."""
        now = self.clock()
        learned: list[CounterKey] = []
        for rule_id, key, until in budgets.root:
            try:
                counter = CounterKey(self.rules[RuleId(rule_id)], key)
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

    async def flush_folded(self) -> int:
        return await self.rejections.flush_due(self.clock())

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
        await self.rejections.flush_due(math.inf)  # on shutdown every folded window counts as ended
