"""Delivering: one loop claims what may go now on every endpoint (store.claim_due: each video's earliest unfinished
delivery, each endpoint's concurrency) and records the attempts finished since its last turn (store.record_many), in
one transaction a turn; each attempt runs as a task of its own over its endpoint's own HTTP client
(ssrf.attempt_delivery: resolved once, judged, connected to as judged), so a slow or dead endpoint holds up only
itself (SPEC 13). An endpoint's next delivery is claimed in the turn that records its previous one, and
`webhook_endpoint_claim_ahead` more are claimed ahead (other videos' heads), each sent as soon as the attempt in
flight ends: the endpoint does not wait for the database between two attempts.

An instance that dies mid-attempt (or before its turn recorded it) leaves the claim to run out (timeout plus grace);
the delivery is then due again and sent with the same `webhook-id`: twice at worst, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import ssl
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg

from services.webhooks import domain, store
from services.webhooks.settings import WebhookSettings
from services.webhooks.signing import signed_headers
from services.webhooks.ssrf import (
    AttemptReport,
    EndpointUrl,
    InvalidEndpointUrl,
    IPAddress,
    attempt_delivery,
    delivery_client,
    parse_endpoint_url,
    resolve,
)
from shared.bus import wait_any
from shared.metrics import Metrics

log = logging.getLogger("weir.webhooks")
MIN_WAIT = 0.002
# The deliverer's connections plan by index alone. Its queries look for the pending deliveries, a small moving part of
# a table that keeps every delivery for the log: the planner, on statistics that lag that churn, chose a sequential
# scan of the whole table (each turn read every delivery ever kept) or a bitmap scan (which never marks the index's
# dead entries, so each read them all again). 8 endpoints, bench.webhooks: 1,107 deliveries/s and steady round to
# round with these, against 537-810/s falling by a third a round without (bench/RESULTS.md, 2026-12-04 18:30).
INDEX_PLANS = {"enable_seqscan": "off", "enable_bitmapscan": "off"}
DELIVERER_CONNECTIONS = 2  # one turn at a time, and the stopping instance's last turn


async def resolve_name(host: str, port: int) -> list[IPAddress]:
    """ssrf.resolve, without the resolver's thread for an address written as such (it resolves to itself)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        return await resolve(host, port)


AckFloor = Callable[[str, str], Awaitable[int | None]]


class Deliverer:
    def __init__(self, settings: WebhookSettings, pool: asyncpg.Pool, metrics: Metrics | None = None,
                 ack_floor: AckFloor | None = None) -> None:
        self.settings = settings
        self.ack_floor = ack_floor  # (stream, durable) -> its ack floor: the order gate (none: every gate opens late)
        self.longest_gate = timedelta(seconds=settings.webhook_order_gate_longest_seconds)
        self.pool = pool
        self.metrics = metrics
        self.policy = domain.RetryPolicy.from_settings(settings)
        self.disable_after = timedelta(seconds=settings.webhook_disable_after_seconds)
        self.flight = timedelta(seconds=settings.webhook_delivery_timeout_seconds
                                + settings.webhook_claim_grace_seconds)
        self.wake = asyncio.Event()
        self.busy: Counter[str] = Counter()  # endpoint -> its attempts claimed here and not recorded yet
        self.finished: list[store.Finished] = []  # attempts made, for the next turn to record
        self.attempts: set[asyncio.Task[None]] = set()
        self.sending: Counter[str] = Counter()  # endpoint -> its attempts under way here
        self.queued: dict[str, deque[store.Claimed]] = {}  # endpoint -> claimed here, waiting for one under way
        self.stopping = False
        self.step = timedelta(seconds=settings.webhook_delivery_timeout_seconds)
        # endpoint -> (its URL, its own client, the URL as judged)
        self._clients: dict[str, tuple[str, aiohttp.ClientSession, EndpointUrl | None]] = {}
        # one TLS context for every client: making one loads the CA file, ~75 ms of this loop's CPU
        self._tls = ssl.create_default_context()

    def nudge(self) -> None:
        """New deliveries were committed here: look at once."""
        self.wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        scan = self.settings.webhook_scan_seconds
        try:
            while not stop.is_set():
                self.wake.clear()
                wait = scan
                try:
                    wait = min(wait, await self._turn(claiming=True))
                except Exception as exc:  # the database away: look again shortly
                    log.warning("deliveries: %s", exc)
                await wait_any(stop, self.wake, max(MIN_WAIT, wait))
        finally:
            await self.close()

    async def _turn(self, *, claiming: bool) -> float:
        """Records the attempts finished since the last turn and claims (and starts, or queues behind the
        endpoint's attempt under way) what may go now, in one transaction; returns the wait until something not yet
        due may go."""
        batch, self.finished = self.finished, []
        now = datetime.now(UTC)
        s = self.settings
        most, ahead = s.webhook_endpoint_concurrency, s.webhook_endpoint_claim_ahead
        # what this turn records is no longer under way: its endpoint's next may be claimed in the same turn
        busy = self.busy - Counter(f.claimed.endpoint_id for f in batch)
        claims: store.Claims | None = None
        gated = False
        try:
            async with self.pool.acquire() as conn:
                gated = claiming and await self._open_gate(conn)
                due = await store.due_endpoints(conn) if claiming else []
                if batch or any(at <= now and busy[e] < most + ahead for e, at in due):  # else: nothing to write
                    async with conn.transaction():
                        decisions = await store.record_many(conn, batch, policy=self.policy,
                                                            disable_after=self.disable_after, now=now)
                        if claiming:
                            claims = await store.claim_due(
                                conn, now=now, most=most, ahead=ahead, flight=self.flight, step=self.step,
                                busy=busy, room=s.webhook_max_in_flight - sum(self.busy.values()), due=due)
                else:
                    decisions = []
                    claims = await store.claim_due(conn, now=now, most=most, ahead=ahead, flight=self.flight,
                                                   busy=busy, room=0, due=due)  # only the next due time
        except BaseException:
            self.finished[:0] = batch  # recorded by a later turn (or, if none comes, their claims run out)
            raise
        for f, decision in zip(batch, decisions, strict=True):
            self._release(f.claimed.endpoint_id)
            self._count(f.attempted, decision)
        if claims is None:
            return s.webhook_scan_seconds
        for claimed in claims.claimed:
            self.busy[claimed.endpoint_id] += 1
            if self.sending[claimed.endpoint_id] < most:
                self.sending[claimed.endpoint_id] += 1
                self._start(claimed)
            else:
                self.queued.setdefault(claimed.endpoint_id, deque()).append(claimed)
        wait = s.webhook_scan_seconds
        if claims.next_due is not None:
            wait = min(wait, (claims.next_due - datetime.now(UTC)).total_seconds())
        if claims.locked:  # another instance is claiming or recording there: look again soon
            wait = min(wait, s.webhook_locked_retry_seconds)
        if gated:  # deliveries wait for an ack floor: read it again soon
            wait = min(wait, s.webhook_order_gate_poll_seconds)
        return wait

    async def _open_gate(self, conn: asyncpg.Connection) -> bool:
        """Lets through the order gate each delivery `domain.gate_released` lets (its durable's ack floor, read
        now, reached its event; or it waited the longest); returns whether any still wait."""
        waiting = await store.gated(conn)
        if not waiting:
            return False
        floors: dict[tuple[str, str], int | None] = {}
        for key in {(g.stream, g.durable) for g in waiting}:
            floors[key] = None if self.ack_floor is None else await self.ack_floor(*key)
        now = datetime.now(UTC)
        through = [g.id for g in waiting
                   if domain.gate_released(g.seq, floor=floors[(g.stream, g.durable)], gated_due_at=g.due_at,
                                           now=now, longest=self.longest_gate)]
        if through:
            await store.release_gated(conn, through)
        return len(through) < len(waiting)

    def _start(self, claimed: store.Claimed) -> None:
        task = asyncio.create_task(self._attempt(claimed), name=f"webhooks-attempt-{claimed.id}")
        self.attempts.add(task)
        task.add_done_callback(self.attempts.discard)

    def _next(self, endpoint_id: str) -> None:
        """An attempt to the endpoint ended: the next claimed for it goes now (unless stopping)."""
        queue = self.queued.get(endpoint_id)
        if queue and not self.stopping:
            self._start(queue.popleft())
        else:
            self.sending[endpoint_id] -= 1
            if self.sending[endpoint_id] <= 0:
                del self.sending[endpoint_id]
        if queue is not None and not queue:
            del self.queued[endpoint_id]
        self.wake.set()

    def _release(self, endpoint_id: str) -> None:
        self.busy[endpoint_id] -= 1
        if self.busy[endpoint_id] <= 0:
            del self.busy[endpoint_id]

    async def _attempt(self, claimed: store.Claimed) -> None:
        s = self.settings
        body = claimed.body
        try:
            client, endpoint = self._client(claimed)
            if endpoint is None:  # judged when it was set; the rules (or the setting) changed since
                report = AttemptReport(domain.AttemptResult(error=domain.AttemptError.ADDRESS_REFUSED))
            else:
                headers = signed_headers(claimed.event_id, datetime.now(UTC), body, claimed.secrets)
                report = await attempt_delivery(client, endpoint, body, headers,
                                                allow_private=s.webhook_allow_private,
                                                timeout=s.webhook_delivery_timeout_seconds,
                                                max_bytes=s.webhook_response_max_bytes, resolver=resolve_name)
        except Exception as exc:  # not the endpoint's doing (the adapter reports those): the claim runs out
            log.warning("attempting delivery %s: %s", claimed.id, exc)
            self._release(claimed.endpoint_id)
        else:
            self.finished.append(store.Finished(claimed, store.Attempted(report.result, report.seconds,
                                                                         report.address, report.body),
                                                random.random()))
        finally:
            self._next(claimed.endpoint_id)

    def _client(self, claimed: store.Claimed) -> tuple[aiohttp.ClientSession, EndpointUrl | None]:
        """The endpoint's own client (ssrf.delivery_client says why one each) and its URL as judged (None:
        refused), both made again when its URL changed."""
        held = self._clients.get(claimed.endpoint_id)
        if held is not None and held[0] == claimed.url:
            return held[1], held[2]
        if held is not None:
            asyncio.get_running_loop().create_task(held[1].close())
        try:
            endpoint: EndpointUrl | None = parse_endpoint_url(claimed.url,
                                                              allow_private=self.settings.webhook_allow_private)
        except InvalidEndpointUrl:
            endpoint = None
        # as many connections as attempts under way at once (those claimed ahead wait for one to end: `_next`)
        client = delivery_client(concurrency=self.settings.webhook_endpoint_concurrency, tls=self._tls)
        self._clients[claimed.endpoint_id] = (claimed.url, client, endpoint)
        return client, endpoint

    def _count(self, attempted: store.Attempted, decision: domain.AttemptDecision | None) -> None:
        if self.metrics is None:
            return
        outcome = domain.judge_attempt(attempted.result).value
        self.metrics.inc("webhook_attempts_total", outcome=outcome)
        self.metrics.observe("webhook_attempt_seconds", attempted.seconds, outcome=outcome)
        if decision is not None and decision.disable is not None:
            self.metrics.inc("webhook_endpoints_disabled_total", reason=decision.disable.value)

    async def close(self) -> None:
        """Lets the attempts under way finish (their claims would otherwise run out and send them again), within
        the delivery timeout, and records them; closes the clients."""
        self.stopping = True
        waiting = [c for queue in self.queued.values() for c in queue]
        self.queued.clear()
        if waiting:
            try:  # given back: due again at once, here after a restart or at another instance
                async with self.pool.acquire() as conn:
                    await store.release(conn, [c.id for c in waiting])
            except Exception as exc:  # their claims run out
                log.warning("giving back %d claims: %s", len(waiting), exc)
        tasks = list(self.attempts)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.webhook_delivery_timeout_seconds)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.finished:
            try:
                await self._turn(claiming=False)
            except Exception as exc:  # their claims run out: sent again, the same webhook-id
                log.warning("recording the last attempts: %s", exc)
        for _, client, _ in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()


async def forget_old(settings: WebhookSettings, pool: asyncpg.Pool, stop: asyncio.Event) -> None:
    """Removes what is older than the keep period (SPEC 13: 30 days), a few times per period."""
    keep = settings.webhook_deliveries_keep_seconds
    while not stop.is_set():
        try:
            async with pool.acquire() as conn:
                removed = await store.forget_before(conn, datetime.now(UTC) - timedelta(seconds=keep))
            if removed:
                log.info("forgot %d events older than %g s", removed, keep)
        except Exception as exc:
            log.warning("forgetting old deliveries: %s", exc)
        await wait_any(stop, None, min(keep / 24, 3600.0))
