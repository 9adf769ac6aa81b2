"""`shared.pull.DurablePull` on the real nats-server: each message handed on as soon as it is read (two pulls on one
durable, as two instances of a service), a busy durable handed on in batches, a stop that takes nothing new and
leaves nothing to the ack wait, a durable deleted and made again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from shared.bus import connect
from shared.pull import DurablePull, Source
from shared.settings import CommonSettings
from tests.integration.bushelpers import SETTLE_S, unique
from tests.integration.privatenats import running_private_nats, wait_until_up
from tests.integration.tcprelay import TcpRelay
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


@dataclass
class Handed:
    """What a pull handed on: each message's stream sequence, its pull, and the time it was handed on."""

    calls: list[list[int]] = field(default_factory=list)
    at: dict[int, float] = field(default_factory=dict)
    by: dict[int, str] = field(default_factory=dict)
    count: int = 0

    def deliver(self, name: str):  # type: ignore[no-untyped-def]
        async def deliver(messages: list[Msg]) -> None:
            now = time.monotonic()
            self.calls.append([m.metadata.sequence.stream for m in messages])
            for m in messages:
                seq = m.metadata.sequence.stream
                self.at.setdefault(seq, now)
                self.by[seq] = name
                self.count += 1
                await m.ack()
        return deliver


@dataclass
class Durable:
    stream: str
    name: str
    subject: str


@pytest.fixture
async def durable(nc: NATS) -> AsyncIterator[Durable]:
    js = nc.jetstream()
    stream = unique("PULL").upper()
    subject = f"{stream.lower()}.x"
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    d = Durable(stream, unique("pull"), subject)
    await js.add_consumer(stream, api.ConsumerConfig(durable_name=d.name, ack_policy=api.AckPolicy.EXPLICIT,
                                                     ack_wait=30))
    yield d
    await js.delete_stream(stream)


async def _pulls(prepared: CommonSettings, d: Durable, handed: Handed, n: int, *, batch: int, wait: float
                 ) -> tuple[list[NATS], list[DurablePull]]:
    conns = [await connect(prepared, name=f"pull-{i}") for i in range(n)]
    pulls = [DurablePull(c, Source(d.stream, d.name, [d.subject]), inbox=None, batch=batch, wait=wait,
                         deliver=handed.deliver(f"p{i}")) for i, c in enumerate(conns)]
    for p in pulls:
        p.start()
    return conns, pulls


async def _publish_and_wait(nc: NATS, d: Durable, handed: Handed, n: int, then: int | None = None) -> None:
    """Publishes `n` messages and waits until `then` (default `n`) more have been handed on."""
    before = handed.count
    for _ in range(n):
        await nc.jetstream().publish(d.subject, b"x")
    more = n if then is None else then
    await wait_for(lambda: handed.count, SETTLE_S, f"{more} more handed on", until=lambda c: c >= before + more)


async def _stop(conns: list[NATS], pulls: list[DurablePull], wait: float) -> None:
    await asyncio.gather(*(p.stop(wait + SETTLE_S) for p in pulls))  # each within its requests' wait
    for c in conns:
        await c.close()


async def test_two_pulls_on_one_durable_hand_each_message_on_as_it_is_read(
        nc: NATS, prepared: CommonSettings, durable: Durable) -> None:
    """Pairs of messages a few ms apart, read by two pulls on one durable: each handed on once, none held until its
    pull request ends (nats-py's fetch held some for the rest of its wait: shared/pull.py)."""
    wait, rounds = 4.0, 25
    handed = Handed()
    conns, pulls = await _pulls(prepared, durable, handed, 2, batch=64, wait=wait)
    js = nc.jetstream()
    published: dict[int, float] = {}
    try:
        await asyncio.sleep(0.2)  # both pulls' first requests open
        for _ in range(rounds):
            for gap in (0.005, 0.04):
                ack = await js.publish(durable.subject, b"x")
                published[ack.seq] = time.monotonic()
                await asyncio.sleep(gap)
        await wait_for(lambda: handed.count, SETTLE_S, "every message handed on", until=lambda n: n >= 2 * rounds)
    finally:
        await _stop(conns, pulls, wait)
    assert handed.count == 2 * rounds and sorted(handed.at) == sorted(published)  # each once
    late = {seq: round(handed.at[seq] - published[seq], 3) for seq in published
            if handed.at[seq] - published[seq] >= wait / 2}
    assert not late, f"held toward the end of their pull request ({wait} s): {late}"
    assert set(handed.by.values()) == {"p0", "p1"}, "both pulls take part"


async def test_messages_held_back_by_the_durable_are_handed_on_as_each_is_let_go(
        nc: NATS, prepared: CommonSettings) -> None:
    """A durable that lets one message out at a time (`max_ack_pending` 1), two pulls, each message acknowledged a
    little after it is handed on: every message comes as soon as the one before is acknowledged. (With nats-py's
    fetch the server answered a pull's first, no-wait request "408 Requests Pending" while the other pull's request
    waited, and the message then let go sat in the fetch until its request expired: 30 messages took over a
    minute.)"""
    js = nc.jetstream()
    stream = unique("PULL").upper()
    subject = f"{stream.lower()}.x"
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    d = Durable(stream, unique("pull"), subject)
    await js.add_consumer(stream, api.ConsumerConfig(durable_name=d.name, ack_policy=api.AckPolicy.EXPLICIT,
                                                     ack_wait=30, max_ack_pending=1))
    wait, total, work = 4.0, 30, 0.02
    handed: dict[int, float] = {}
    published: dict[int, float] = {}
    acks: set[asyncio.Task[None]] = set()

    async def deliver(messages: list[Msg]) -> None:
        for m in messages:
            handed[m.metadata.sequence.stream] = time.monotonic()
            task = asyncio.create_task(_ack_after(m, work))  # as a consumer acks: after its transaction
            acks.add(task)
            task.add_done_callback(acks.discard)

    conns = [await connect(prepared, name=f"pull-{i}") for i in range(2)]
    pulls = [DurablePull(c, Source(d.stream, d.name, [d.subject]), inbox=None, batch=64, wait=wait, deliver=deliver)
             for c in conns]
    try:
        for p in pulls:
            p.start()
        for _ in range(total):
            ack = await js.publish(subject, b"x")
            published[ack.seq] = time.monotonic()
            await asyncio.sleep(0.005)
        await wait_for(lambda: len(handed), SETTLE_S, "every message handed on", until=lambda n: n >= total)
    finally:
        await _stop(conns, pulls, wait)
        await js.delete_stream(stream)
    assert sorted(handed) == sorted(published)
    late = {seq: round(handed[seq] - published[seq], 3) for seq in published
            if handed[seq] - published[seq] >= wait / 2}
    assert not late, f"held toward the end of their pull request ({wait} s): {late}"


async def _ack_after(m: Msg, seconds: float) -> None:
    await asyncio.sleep(seconds)
    await m.ack()


async def test_a_busy_durable_is_handed_on_in_batches(nc: NATS, prepared: CommonSettings, durable: Durable) -> None:
    """Messages waiting on the durable are read a batch at a time and handed on together, in the stream's order."""
    js = nc.jetstream()
    batch, total = 32, 400
    for _ in range(total):
        await js.publish(durable.subject, b"x")
    handed = Handed()
    conns, pulls = await _pulls(prepared, durable, handed, 1, batch=batch, wait=1.0)
    try:
        await wait_for(lambda: handed.count, SETTLE_S, "every message handed on", until=lambda n: n >= total)
    finally:
        await _stop(conns, pulls, 1.0)
    order = [seq for call in handed.calls for seq in call]
    assert order == list(range(1, total + 1))
    assert max(len(c) for c in handed.calls) <= batch
    assert len(handed.calls) <= total / 4, f"{len(handed.calls)} hand-ons for {total} messages"


async def test_a_stopped_pull_takes_nothing_new_and_leaves_nothing_to_the_ack_wait(
        nc: NATS, prepared: CommonSettings, durable: Durable) -> None:
    js = nc.jetstream()
    handed = Handed()
    wait = 0.5
    conns, pulls = await _pulls(prepared, durable, handed, 1, batch=16, wait=wait)
    try:
        await _publish_and_wait(nc, durable, handed, 3)
        await pulls[0].stop(wait + SETTLE_S)
        assert pulls[0].task is not None and pulls[0].task.done()
        for _ in range(5):
            await js.publish(durable.subject, b"x")
        await asyncio.sleep(wait)
        info = await js.consumer_info(durable.stream, durable.name)
        assert (info.num_pending, info.num_ack_pending, handed.count) == (5, 0, 3)
    finally:
        await _stop(conns, pulls, wait)


async def test_a_durable_deleted_and_made_again_is_pulled_again(
        nc: NATS, prepared: CommonSettings, durable: Durable) -> None:
    js = nc.jetstream()
    handed = Handed()
    wait = 0.3
    conns, pulls = await _pulls(prepared, durable, handed, 1, batch=16, wait=wait)
    try:
        await _publish_and_wait(nc, durable, handed, 1)
        config = (await js.consumer_info(durable.stream, durable.name)).config
        await js.delete_consumer(durable.stream, durable.name)
        await asyncio.sleep(3 * wait)  # its requests end; new ones find no durable
        await js.add_consumer(durable.stream, config)  # made again: it reads the stream from the start
        await _publish_and_wait(nc, durable, handed, 1, then=2)  # the first again, and the new one
    finally:
        await _stop(conns, pulls, wait)
    assert sorted(handed.at) == [1, 2]


async def test_a_pull_whose_connection_was_cut_goes_on_once_connected_again(prepared: CommonSettings) -> None:
    """Every connection of the pull reset (as when its NATS node dies): once nats-py has connected again, a message
    published is handed on well within the pull's wait."""
    wait = 6.0
    with running_private_nats() as server:
        await wait_until_up(server.url)
        relay = TcpRelay("127.0.0.1", server.port)
        await relay.accept()
        admin = await nats.connect(server.url)
        puller = await nats.connect(relay.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        handed = Handed()
        d = Durable("CUT", "cut", "cut.x")
        js = admin.jetstream()
        await js.add_stream(name=d.stream, subjects=["cut.>"])
        await js.add_consumer(d.stream, api.ConsumerConfig(durable_name=d.name, ack_policy=api.AckPolicy.EXPLICIT))
        pull = DurablePull(puller, Source(d.stream, d.name, [d.subject]), inbox=None, batch=16, wait=wait,
                           deliver=handed.deliver("p"))
        pull.start()
        try:
            await _publish_and_wait(admin, d, handed, 1)
            assert relay.cut() == 1
            await wait_for(lambda: puller.stats["reconnects"], SETTLE_S, "connected again", until=lambda n: n >= 1)
            start = time.monotonic()
            await _publish_and_wait(admin, d, handed, 1)
            assert time.monotonic() - start < wait / 2, "waited for requests the server no longer held"
        finally:
            await pull.stop(wait + SETTLE_S)
            await puller.close()
            await admin.close()
            await relay.close()
