"""The lean NATS connection (shared/natswire.py) against real nats-server: interoperation with nats-py both ways,
queue groups, batching, no responders, timeouts, PINGs, credentials, and a server that goes away and comes back."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.bus import subscriptions_in_place
from shared.natswire import (
    Batch,
    WireClosed,
    WireConnection,
    WireError,
    WireNoResponders,
    WireTimeout,
    open_wire,
    servers_of,
)
from shared.settings import CommonSettings
from tests.integration.privatenats import PrivateNats


@pytest.fixture
async def wire(prepared: CommonSettings) -> AsyncIterator[WireConnection]:
    w = await open_wire(prepared.nats_url, name="test")
    assert w is not None and w.is_connected
    try:
        yield w
    finally:
        await w.close()


def responder(w: WireConnection, seen: list[int]) -> None:
    """Answers each request with its payload reversed, recording each read's batch size."""

    def handle(batch: Batch) -> None:
        seen.append(len(batch))
        for reply, payload in batch:
            w.publish(reply, payload[::-1])

    w.subscribe("wiretest.reverse", handle, queue="q")


async def test_requests_over_the_wire_reach_a_nats_py_responder(wire: WireConnection, nc: NATS) -> None:
    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("wiretest.echo", cb=echo)
    await subscriptions_in_place(nc)
    # empty, small, and larger than one read (the parser must join pieces)
    for payload in (b"", b"x", bytes(range(256)) * 1024):
        assert await wire.request("wiretest.echo", payload, timeout=5) == payload
    payloads = [str(i).encode() * (i % 7 + 1) for i in range(500)]
    answers = await asyncio.gather(*(wire.request("wiretest.echo", p, timeout=5) for p in payloads))
    assert answers == payloads
    # over the server's max_payload: refused here, as nats-py does; sent, the server would drop the connection
    with pytest.raises(WireError):
        await wire.request("wiretest.echo", b"x" * (nc.max_payload + 1), timeout=5)
    assert wire.is_connected and await wire.request("wiretest.echo", b"still", timeout=5) == b"still"


async def test_a_wire_subscriber_answers_nats_py_requests_in_batches(wire: WireConnection, nc: NATS) -> None:
    seen: list[int] = []
    responder(wire, seen)
    await wire.flush()
    payloads = [f"request {i}".encode() for i in range(500)]
    answers = await asyncio.gather(*(nc.request("wiretest.reverse", p, timeout=5) for p in payloads))
    assert [a.data for a in answers] == [p[::-1] for p in payloads]
    assert sum(seen) == len(payloads)  # each once
    assert max(seen) > 1  # nats-py sent them together: they came in reads of several, handed over together


async def test_a_queue_group_of_wire_subscribers_shares_the_requests(prepared: CommonSettings, nc: NATS) -> None:
    wires = [await open_wire(prepared.nats_url, name=f"q{i}") for i in range(2)]
    try:
        seen: list[list[int]] = [[], []]
        for w, s in zip(wires, seen, strict=True):
            assert w is not None
            responder(w, s)
            await w.flush()
        n = 400
        answers = await asyncio.gather(*(nc.request("wiretest.reverse", b"%d" % i, timeout=5) for i in range(n)))
        assert len(answers) == n
        assert sum(map(sum, seen)) == n  # answered once each, across the group
        assert all(sum(s) > 0 for s in seen)
    finally:
        for w in wires:
            if w is not None:
                await w.close()


async def test_no_responders_and_timeouts_are_told_apart(wire: WireConnection) -> None:
    t0 = time.monotonic()
    with pytest.raises(WireNoResponders):
        await wire.request("wiretest.nobody", b"x", timeout=5)
    assert time.monotonic() - t0 < 1  # the server said so: no waiting for the timeout
    wire.subscribe("wiretest.silent", lambda batch: None)
    await wire.flush()
    t0 = time.monotonic()
    with pytest.raises(WireTimeout):
        await wire.request("wiretest.silent", b"x", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2


@pytest.fixture
def own_nats() -> Iterator[PrivateNats]:
    with tempfile.TemporaryDirectory(prefix="weir-wire-nats-") as tmp:
        conf = Path(tmp) / "nats.conf"
        conf.write_text('ping_interval: "200ms"\nping_max: 2\n')  # a client that ignores PINGs is dropped in 0.6 s
        server = PrivateNats(Path(tmp), "-c", str(conf))
        server.start()
        try:
            yield server
        finally:
            server.stop()


async def _connect_when_up(url: str, states: list[bool] | None = None) -> WireConnection:
    deadline = time.monotonic() + 15
    while True:
        w = WireConnection(servers_of(url), name="test", ping_interval=0.1, reconnect_wait=0.05,
                           on_state=None if states is None else states.append)
        try:
            await w.connect()
            return w
        except WireClosed:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _nats_py(url: str) -> NATS:
    deadline = time.monotonic() + 15
    while True:
        try:
            return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _until(condition: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_server_pings_are_answered_so_the_connection_stays(own_nats: PrivateNats) -> None:
    w = await _connect_when_up(own_nats.url)
    w.ping_interval = 60  # only the server pings now
    try:
        seen: list[int] = []
        responder(w, seen)
        await w.flush()
        nc = await _nats_py(own_nats.url)
        try:
            await asyncio.sleep(1.5)  # many server PINGs; unanswered, the server would have dropped us by 0.6 s
            assert w.is_connected and w.connects == 1
            assert (await nc.request("wiretest.reverse", b"abc", timeout=5)).data == b"cba"
        finally:
            await nc.close()
    finally:
        await w.close()


async def test_a_server_restart_fails_what_waits_then_reconnects_and_subscribes_again(tmp_path: Path) -> None:
    server = PrivateNats(tmp_path)
    server.start()
    states: list[bool] = []
    try:
        w = await _connect_when_up(server.url, states)
        try:
            seen: list[int] = []
            responder(w, seen)
            w.subscribe("wiretest.silent", lambda batch: None)
            await w.flush()
            waiting = asyncio.ensure_future(w.request("wiretest.silent", b"x", timeout=30))
            await asyncio.sleep(0.1)
            server.stop()
            with pytest.raises(WireClosed):  # at once, not after 30 s: the answer cannot come on a lost connection
                await asyncio.wait_for(waiting, timeout=5)
            with pytest.raises(WireClosed):
                await w.request("wiretest.reverse", b"x", timeout=1)  # not connected: said at once
            server.start()  # same port
            await _until(lambda: w.is_connected)
            assert w.connects == 2
            assert states == [True, False, True]  # what the gauge weir_nats_lean_connected shows
            nc = await _nats_py(server.url)
            try:  # the subscription was made again on the new connection
                assert (await nc.request("wiretest.reverse", b"abc", timeout=5)).data == b"cba"
            finally:
                await nc.close()
        finally:
            await w.close()
    finally:
        server.stop()


async def test_a_frozen_server_is_noticed_by_unanswered_pings(tmp_path: Path) -> None:
    server = PrivateNats(tmp_path)
    server.start()
    try:
        w = await _connect_when_up(server.url)
        try:
            server.freeze(True)
            await _until(lambda: not w.is_connected, timeout=5)  # 3 PINGs of 0.1 s unanswered
            server.freeze(False)
            await _until(lambda: w.is_connected)
            assert w.connects == 2
        finally:
            await w.close()
    finally:
        with contextlib.suppress(Exception):
            server.freeze(False)
        server.stop()


async def test_credentials_from_the_url(tmp_path: Path) -> None:
    server = PrivateNats(tmp_path, "--user", "weir", "--pass", "s3cret")
    server.start()
    try:
        host = f"127.0.0.1:{server.port}"
        w = await _connect_when_up(f"nats://weir:s3cret@{host}")
        try:
            responder(w, [])
            await w.flush()
            assert await w.request("wiretest.reverse", b"abc", timeout=5) == b"cba"
        finally:
            await w.close()
        bad = WireConnection(servers_of(f"nats://weir:wrong@{host}"), name="test")
        with pytest.raises(WireClosed):
            await bad.connect()
        await bad.close()
    finally:
        server.stop()
