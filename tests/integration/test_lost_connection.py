"""A request in flight when the edge's NATS connection drops (SPEC 15): on a real nats-server of the test's own, the
edge's connection goes through a TCP relay that resets it, as a dying node resets its clients', while the responder
(auth, encode) stays connected. The replies in flight are lost; at the reconnect each check still waiting is sent
once more on the new connection and answered within its own budget, not failed after it. Checks made while the
connection is away wait for the new one and are sent once more too (nats-py may have written them to the dead
socket: `connection_number`), and sent a last time a quarter of the budget later if still unanswered; a check
none of whose sendings is answered fails at its first deadline; a read through
`natsconn.request(resend_if_lost=True)` is sent once more, and one without it is not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.api.settings import ApiSettings
from shared.authcheck import CHECK_SUBJECT, CheckReply
from shared.authclient import CheckSender
from shared.bus import subscriptions_in_place
from shared.metrics import Metrics
from shared.natsconn import ConnectionWatch, request
from tests.integration.privatenats import running_private_nats, wait_until_up
from tests.integration.tcprelay import TcpRelay
from tests.waiting import wait_for

TIMEOUT = ApiSettings().auth_timeout_ms / 1000  # the api's budget for one auth.check
LATE = min(0.1, TIMEOUT / 10)  # CheckSender's expiry comes back at most this much after a deadline
SLACK = 0.5  # a busy machine's scheduling
RECONNECT_WAIT = 0.05  # nats-py's pause before trying a server again (the services use 0.5 s; the test hurries)
READ = "test.status"  # a read another service answers (encode.status)
IN_FLIGHT = 20
WHILE_AWAY = 10


@dataclass
class Responder:
    """auth (or encode) on its own connection, which never drops: answers each request with its payload, or, while
    `swallowing`, keeps it unanswered (its reply is lost, as with the edge's old connection)."""

    nc: NATS
    swallowing: bool = False
    swallowed: list[Msg] = field(default_factory=list)
    answered: int = 0

    async def on_request(self, msg: Msg) -> None:
        if self.swallowing:
            self.swallowed.append(msg)
            return
        self.answered += 1
        await self.nc.publish(msg.reply, CheckReply(allowed=True, status=200, client_address=msg.data.decode())
                              .model_dump_json().encode())


@dataclass
class Edge:
    """The api's side: its connection (through the relay), its watch, its metrics and its CheckSender."""

    nc: NATS
    relay: TcpRelay
    watch: ConnectionWatch
    metrics: Metrics
    sender: CheckSender
    responder: Responder

    def retried(self, subject: str) -> float:
        return self.metrics.value("nats_requests_retried_total", subject=subject)

    async def drop(self, *, away: bool = False) -> None:
        """Reset the edge's connection; with `away`, keep it from connecting again until `back`."""
        if away:
            await self.relay.refuse()
        reconnects = self.nc.stats["reconnects"]
        assert self.relay.cut() == 1
        if away:
            await wait_for(lambda: self.nc.is_reconnecting, 10, "the edge to see its connection gone", interval=0.005)
        else:
            await wait_for(lambda: self.nc.stats["reconnects"] > reconnects and self.nc.is_connected, 10,
                           "the edge to reconnect", interval=0.005)

    async def back(self) -> None:
        reconnects = self.nc.stats["reconnects"]
        await self.relay.accept()
        await wait_for(lambda: self.nc.stats["reconnects"] > reconnects and self.nc.is_connected, 10,
                       "the edge to reconnect", interval=0.005)


async def _quiet(exc: Exception) -> None:
    """The responder's error callback: nothing happens to its connection here."""


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    with running_private_nats() as server:
        await wait_until_up(server.url)
        relay = TcpRelay("127.0.0.1", server.port)
        await relay.accept()
        metrics = Metrics("api")
        watch = ConnectionWatch("api", metrics)
        nc = await nats.connect(relay.url, name="weir-api", error_cb=watch.error_cb,
                                reconnected_cb=watch.reconnected_cb, max_reconnect_attempts=-1,
                                reconnect_time_wait=RECONNECT_WAIT)
        watch.attach(nc)
        auth = await nats.connect(server.url, error_cb=_quiet)
        try:
            responder = Responder(auth)
            await auth.subscribe(CHECK_SUBJECT, cb=responder.on_request)
            await auth.subscribe(READ, cb=responder.on_request)
            await subscriptions_in_place(auth)
            sender = CheckSender(lambda: nc, timeout=TIMEOUT, watch=lambda: watch)
            reply, _ = await sender.check(b"10.0.0.0")  # its reply inbox subscribed before anything is dropped
            assert reply.client_address == "10.0.0.0"
            yield Edge(nc, relay, watch, metrics, sender, responder)
        finally:
            await nc.close()
            await auth.close()
            await relay.close()


async def _swallowed(responder: Responder, count: int) -> None:
    await wait_for(lambda: len(responder.swallowed) >= count, 10, f"{count} requests to reach the responder",
                   interval=0.005)


async def test_checks_in_flight_on_a_dropped_connection_are_answered_on_the_new_one(edge: Edge) -> None:
    responder = edge.responder
    responder.swallowing = True  # their replies will be lost with the connection
    started = time.monotonic()
    in_flight = [asyncio.create_task(edge.sender.check(f"10.0.1.{i}".encode())) for i in range(IN_FLIGHT)]
    await _swallowed(responder, IN_FLIGHT)
    responder.swallowing = False
    await edge.drop(away=True)
    # made while the connection is away: nats-py holds them for the new one, and the reconnect sends them once more
    while_away = [asyncio.create_task(edge.sender.check(f"10.0.2.{i}".encode())) for i in range(WHILE_AWAY)]
    await asyncio.sleep(0)  # each publishes into nats-py's buffer before the connection comes back
    await edge.back()
    answers = await asyncio.wait_for(asyncio.gather(*in_flight, *while_away), TIMEOUT + SLACK)
    took = time.monotonic() - started

    assert [r.client_address for r, _ in answers] == (
        [f"10.0.1.{i}" for i in range(IN_FLIGHT)] + [f"10.0.2.{i}" for i in range(WHILE_AWAY)])
    assert took < TIMEOUT, f"answered after {took:.2f} s: the checks waited out their budget"
    # each in flight sent once more (its reply was lost); one made while away only if nats-py's replay of it was not
    # answered before the reconnect callback looked; none a last time
    retried = edge.retried(CHECK_SUBJECT)
    assert IN_FLIGHT <= retried <= IN_FLIGHT + WHILE_AWAY
    # the responder answers the first check, each in flight once (its first sending was swallowed), each made while
    # away once, and once more each of those the reconnect sent again (a clean-clone run had none: 31 answered);
    # those second answers may come after their first ones were taken
    answered = 1 + IN_FLIGHT + WHILE_AWAY + (retried - IN_FLIGHT)
    await wait_for(lambda: responder.answered >= answered, SLACK, "the second sendings answered", interval=0.005)
    await asyncio.sleep(LATE)
    assert responder.answered == answered
    assert edge.sender._waiting == {}


async def test_a_check_whose_later_sendings_are_lost_too_fails_at_its_first_deadline(edge: Edge) -> None:
    responder = edge.responder
    responder.swallowing = True  # no sending is answered
    started = time.monotonic()
    checks = asyncio.gather(*(edge.sender.check(f"10.0.3.{i}".encode()) for i in range(IN_FLIGHT)),
                            return_exceptions=True)
    await _swallowed(responder, IN_FLIGHT)
    await edge.drop()
    await _swallowed(responder, 2 * IN_FLIGHT)  # sent once more on the new connection
    await _swallowed(responder, 3 * IN_FLIGHT)  # and a last time, a quarter of the budget later
    failed = await asyncio.wait_for(checks, TIMEOUT + LATE + SLACK)  # never a fresh timeout from the resend
    waited = time.monotonic() - started

    assert all(isinstance(r, TimeoutError) for r in failed), failed
    assert TIMEOUT <= waited < TIMEOUT + LATE + SLACK, waited
    assert edge.retried(CHECK_SUBJECT) == 2 * IN_FLIGHT
    await edge.drop()  # a second drop sends none of them again: they are over
    assert len(responder.swallowed) == 3 * IN_FLIGHT
    assert edge.sender._waiting == {}


async def test_a_read_is_sent_once_more_only_when_asked(edge: Edge) -> None:
    responder = edge.responder
    responder.swallowing = True
    asked = asyncio.create_task(request(None, edge.nc, READ, b"again", timeout=TIMEOUT, resend_if_lost=True))
    plain = asyncio.create_task(request(None, edge.nc, READ, b"once", timeout=TIMEOUT))
    await _swallowed(responder, 2)
    responder.swallowing = False
    await edge.drop()

    reply = await asyncio.wait_for(asked, TIMEOUT)
    assert CheckReply.model_validate_json(reply.data).client_address == "again"
    with pytest.raises(TimeoutError):  # its reply was lost, and nothing sent it again
        await plain
    assert edge.retried(READ) == 1
    assert responder.answered == 2  # the first check, and the read sent again
