"""The edge's `auth.check` sender (shared/authclient.py CheckSender) on a real nats-server of the test's own: replies
reach their own checks, checks nobody answers fail after the timeout (not much later, not sooner, all of them), a
reply that comes too late is dropped, and the sender works on after all of that."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.aio.msg import Msg

from shared.authcheck import CHECK_SUBJECT, CheckReply
from shared.authclient import CheckSender
from shared.bus import subscriptions_in_place
from tests.integration.privatenats import running_private_nats, wait_until_up

TIMEOUT = 0.3
LATE = min(0.1, TIMEOUT / 10)  # CheckSender's expiry comes back at most this much after a deadline
SLACK = 0.5  # a busy machine's scheduling


def reply_for(payload: bytes) -> bytes:
    """The responder's answer: its client_address says which request it answers."""
    return CheckReply(allowed=True, status=200, client_address=payload.decode()).model_dump_json().encode()


async def test_replies_reach_their_checks_and_silence_times_out_in_bounds() -> None:
    with running_private_nats() as server:
        await wait_until_up(server.url)
        edge = await nats.connect(server.url)
        auth = await nats.connect(server.url)
        try:
            answering = asyncio.Event()
            answering.set()
            held: list[Msg] = []

            async def respond(msg: Msg) -> None:
                if answering.is_set():
                    await auth.publish(msg.reply, reply_for(msg.data))
                else:
                    held.append(msg)  # answered only after its check gave up

            await auth.subscribe(CHECK_SUBJECT, cb=respond)
            await subscriptions_in_place(auth)
            sender = CheckSender(lambda: edge, timeout=TIMEOUT)

            # many at once, each gets its own answer
            names = [f"10.0.0.{i}" for i in range(50)]
            replies = await asyncio.gather(*(sender.check(name.encode()) for name in names))
            assert [r.client_address for r, _ in replies] == names

            # nobody answers: every check fails with TimeoutError after TIMEOUT, within its bound
            answering.clear()
            started = time.monotonic()
            silent = await asyncio.wait_for(  # never a hang: a check with no expiry fails the test here
                asyncio.gather(*(sender.check(b"10.0.1.1") for _ in range(20)), return_exceptions=True), 10)
            waited = time.monotonic() - started
            assert all(isinstance(r, TimeoutError) for r in silent), silent
            assert TIMEOUT <= waited < TIMEOUT + LATE + SLACK, waited

            # the late answers arrive and are dropped; new checks are answered as before
            answering.set()
            for msg in held:
                await auth.publish(msg.reply, reply_for(b"late"))
            await subscriptions_in_place(auth)
            again = await asyncio.gather(*(sender.check(f"10.0.2.{i}".encode()) for i in range(5)))
            assert [r.client_address for r, _ in again] == [f"10.0.2.{i}" for i in range(5)]
            assert sender._waiting == {}  # nothing left behind
        finally:
            await edge.close()
            await auth.close()
