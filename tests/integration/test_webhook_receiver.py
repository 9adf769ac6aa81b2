"""The test receiver of webhook deliveries (tests/webhookreceiver.py) itself: both ways of running it, keep-alive,
records and counts, its waits, and a stop that closes even a connection left hanging."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.webhooks.settings import WebhookSettings
from tests.waiting import TimedOut
from tests.webhookreceiver import WebhookReceiver, fail_then_ok, hang, ok

SETTINGS = WebhookSettings()
WAIT = SETTINGS.webhook_delivery_timeout_seconds
SHORT = WAIT / 50


def test_a_sync_test_posts_and_reads_the_records_in_order() -> None:
    posts = 5
    with WebhookReceiver({"/hook": ok()}) as receiver, httpx.Client() as client:
        answers = [client.post(receiver.url(f"/hook?n={n}"), content=str(n).encode()).status_code
                   for n in range(posts)]
        records = receiver.wait_requests(posts, WAIT, "/hook")
    assert answers == [ok().code] * posts
    assert [r.body for r in records] == [str(n).encode() for n in range(posts)]
    assert [r.target for r in records] == [f"/hook?n={n}" for n in range(posts)]
    assert [r.monotonic for r in records] == sorted(r.monotonic for r in records)
    assert {r.connection for r in records} == {1} and receiver.connections_opened == 1  # kept alive


async def test_an_async_test_runs_it_on_its_own_loop() -> None:
    failures = 1
    flaky = fail_then_ok(failures)
    async with WebhookReceiver({"/flaky": flaky}) as receiver, httpx.AsyncClient() as client:
        first = await client.post(receiver.url("/flaky"), content=b"{}")
        second = await client.post(receiver.url("/flaky"), content=b"{}")
        unrouted = await client.post(receiver.url("/nowhere"), content=b"{}")
        await receiver.wait_requests_async(failures + 2, WAIT)
    assert (first.status_code, second.status_code) == (flaky.fail_code, flaky.ok_code)
    assert unrouted.status_code == httpx.codes.NOT_FOUND
    assert receiver.count("/flaky") == failures + 1 and receiver.count("/nowhere") == 1


def test_without_records_it_still_counts() -> None:
    with WebhookReceiver(default=ok(), record=False) as receiver, httpx.Client() as client:
        client.post(receiver.url("/a"), content=b"{}")
        assert receiver.wait_requests(1, WAIT) == [] and receiver.count("/a") == 1


def test_a_wait_that_is_not_met_fails_at_its_deadline() -> None:
    with WebhookReceiver() as receiver, pytest.raises(TimedOut):
        receiver.wait_requests(1, SHORT)


@pytest.mark.parametrize("threaded", [True, False])
async def test_stopping_closes_a_connection_left_hanging(threaded: bool) -> None:
    receiver = WebhookReceiver({"/hang": hang()})
    async with httpx.AsyncClient(timeout=WAIT) as client:
        if threaded:
            receiver.__enter__()
        else:
            await receiver.__aenter__()
        pending = asyncio.create_task(client.post(receiver.url("/hang"), content=b"{}"))
        await receiver.wait_requests_async(1, WAIT, "/hang")
        if threaded:
            receiver.__exit__(None, None, None)
        else:
            await receiver.__aexit__(None, None, None)
        with pytest.raises(httpx.RemoteProtocolError):  # the server disconnected, long before the client's timeout
            await asyncio.wait_for(pending, WAIT / 2)
    assert receiver.connections_open == 0
