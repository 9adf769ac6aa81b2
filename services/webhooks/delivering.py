"""Delivering: one task per endpoint with something due, so that a slow or dead endpoint holds up only itself
(SPEC 13). Each task claims what may go now (store.claim: each video's earliest unfinished delivery, the endpoint's
concurrency), attempts it over the endpoint's own HTTP client (ssrf.attempt_delivery: resolved once, judged,
connected to as judged), and records the attempt with its decision in one transaction.

An instance that dies mid-attempt leaves the claim to run out (timeout plus grace); the delivery is then due again
and sent with the same `webhook-id`: twice at worst, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from services.webhooks import domain, store
from services.webhooks.settings import WebhookSettings
from services.webhooks.signing import signed_headers
from services.webhooks.ssrf import (
    AttemptReport,
    InvalidEndpointUrl,
    attempt_delivery,
    delivery_client,
    parse_endpoint_url,
)
from shared.bus import wait_any
from shared.metrics import Metrics

log = logging.getLogger("weir.webhooks")
MIN_WAIT = 0.002


class Deliverer:
    def __init__(self, settings: WebhookSettings, pool: asyncpg.Pool, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.policy = domain.RetryPolicy.from_settings(settings)
        self.disable_after = timedelta(seconds=settings.webhook_disable_after_seconds)
        self.flight = timedelta(seconds=settings.webhook_delivery_timeout_seconds
                                + settings.webhook_claim_grace_seconds)
        self.wake = asyncio.Event()
        self.working: dict[str, asyncio.Task[None]] = {}
        self._clients: dict[str, tuple[str, httpx.AsyncClient]] = {}  # endpoint -> (its URL, its own client)
        self._room = asyncio.Semaphore(settings.webhook_max_in_flight)

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
                    wait = min(wait, await self._start_due())
                except Exception as exc:  # the database away: look again shortly
                    log.warning("deliveries: %s", exc)
                await wait_any(stop, self.wake, max(MIN_WAIT, wait))
        finally:
            await self.close()

    async def _start_due(self) -> float:
        """Starts a task for each endpoint with a delivery due and none running here; returns the wait until the
        next one not yet due."""
        async with self.pool.acquire() as conn:
            due = await store.due_endpoints(conn)
        now = datetime.now(UTC)
        wait = self.settings.webhook_scan_seconds
        for endpoint_id, at in due:
            if endpoint_id in self.working:
                continue
            if at <= now:
                task = asyncio.create_task(self._serve(endpoint_id), name=f"webhooks-endpoint-{endpoint_id}")
                self.working[endpoint_id] = task
                task.add_done_callback(functools.partial(self._done, endpoint_id))
            else:
                wait = min(wait, (at - now).total_seconds())
        return wait

    def _done(self, endpoint_id: str, _task: asyncio.Task[None]) -> None:
        self.working.pop(endpoint_id, None)
        self.wake.set()  # what it left not yet due is for the scan to time

    async def _serve(self, endpoint_id: str) -> None:
        """Attempts the endpoint's due deliveries until none may go now."""
        try:
            while True:
                async with self.pool.acquire() as conn, conn.transaction():
                    claimed = await store.claim(conn, endpoint_id, now=datetime.now(UTC),
                                                most=self.settings.webhook_endpoint_concurrency, flight=self.flight)
                if not claimed:
                    return
                await asyncio.gather(*(self._attempt(c) for c in claimed))
        except Exception as exc:  # the database away: the claims run out and the scan starts it again
            log.warning("deliveries to endpoint %s: %s", endpoint_id, exc)

    async def _attempt(self, claimed: store.Claimed) -> None:
        s = self.settings
        async with self._room:
            body = claimed.body
            try:
                endpoint = parse_endpoint_url(claimed.url, allow_private=s.webhook_allow_private)
            except InvalidEndpointUrl:  # judged when it was set; the rules (or the setting) changed since
                report = AttemptReport(domain.AttemptResult(error=domain.AttemptError.ADDRESS_REFUSED))
            else:
                headers = signed_headers(claimed.event_id, datetime.now(UTC), body, claimed.secrets)
                report = await attempt_delivery(self._client(claimed), endpoint, body, headers,
                                                allow_private=s.webhook_allow_private,
                                                timeout=s.webhook_delivery_timeout_seconds,
                                                max_bytes=s.webhook_response_max_bytes)
        attempted = store.Attempted(report.result, report.seconds, report.address, report.body)
        async with self.pool.acquire() as conn, conn.transaction():
            decision = await store.record(conn, claimed, attempted, policy=self.policy,
                                          disable_after=self.disable_after, now=datetime.now(UTC),
                                          draw=random.random())
        self._count(report, decision)

    def _client(self, claimed: store.Claimed) -> httpx.AsyncClient:
        """The endpoint's own client (ssrf.delivery_client says why one each), made again when its URL changed."""
        held = self._clients.get(claimed.endpoint_id)
        if held is not None and held[0] == claimed.url:
            return held[1]
        if held is not None:
            asyncio.get_running_loop().create_task(held[1].aclose())
        client = delivery_client(timeout=self.settings.webhook_delivery_timeout_seconds,
                                 concurrency=self.settings.webhook_endpoint_concurrency)
        self._clients[claimed.endpoint_id] = (claimed.url, client)
        return client

    def _count(self, report: AttemptReport, decision: domain.AttemptDecision | None) -> None:
        if self.metrics is None:
            return
        outcome = domain.judge_attempt(report.result).value
        self.metrics.inc("webhook_attempts_total", outcome=outcome)
        self.metrics.observe("webhook_attempt_seconds", report.seconds, outcome=outcome)
        if decision is not None and decision.disable is not None:
            self.metrics.inc("webhook_endpoints_disabled_total", reason=decision.disable.value)

    async def close(self) -> None:
        """Lets the attempts under way finish (their claims would otherwise run out and send them again), within
        the delivery timeout; closes the clients."""
        tasks = list(self.working.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.webhook_delivery_timeout_seconds)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for _, client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
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
