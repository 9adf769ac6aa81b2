"""The `auth.check` batcher's scheduling: every message gets its answer, however its arrival meets a batch's end.

Pure scheduling logic (no broker): the checker is a stand-in that answers each payload with itself. The subscription
and the answers' publishes are tested on the real nats-server (tests/integration/test_auth_messaging.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from services.auth.batched import CheckBatcher


class Echo:
    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]:
        await asyncio.sleep(0)
        return payloads


class FakeMsg:
    """A request as nats-py hands it over: a reply subject and a payload; `respond` records answers."""

    sent: ClassVar[dict[str, FakeMsg]] = {}

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reply = f"_INBOX.t.{len(FakeMsg.sent)}"
        self.answered = asyncio.Event()
        self.answer: bytes | None = None
        FakeMsg.sent[self.reply] = self

    @staticmethod
    async def respond(answers: list[tuple[str, bytes]]) -> None:
        for subject, body in answers:
            msg = FakeMsg.sent[subject]
            msg.answer = body
            msg.answered.set()


def batcher(in_flight: int) -> CheckBatcher:
    checker: Any = Echo()
    return CheckBatcher(checker, max_batch=8, respond=FakeMsg.respond, in_flight=in_flight)


def add(b: CheckBatcher, *msgs: FakeMsg) -> None:
    b.add_many([(m.reply, m.data) for m in msgs])


@pytest.mark.parametrize("in_flight", [1, 2, 4])
async def test_a_message_arriving_as_a_batch_ends_is_still_answered(in_flight: int) -> None:
    """One at a time: each message arrives just after the previous one's answer, while its task is ending."""
    b = batcher(in_flight)
    for i in range(200):
        msg = FakeMsg(str(i).encode())
        add(b, msg)
        async with asyncio.timeout(2):  # not wait_for: its extra task would hide the moment this test is about
            await msg.answered.wait()
        assert msg.answer == msg.data


@pytest.mark.parametrize("in_flight", [1, 4])
async def test_a_burst_is_answered_in_full(in_flight: int) -> None:
    b = batcher(in_flight)
    msgs = [FakeMsg(str(i).encode()) for i in range(1000)]
    for m in msgs:
        add(b, m)
    await asyncio.wait_for(asyncio.gather(*(m.answered.wait() for m in msgs)), timeout=5)
    assert [m.answer for m in msgs] == [m.data for m in msgs]


class Broken:
    async def check_payloads(self, payloads: list[bytes]) -> list[bytes]:
        raise RuntimeError("a bug")


async def test_a_batch_that_fails_is_answered_with_an_error_at_once() -> None:
    checker: Any = Broken()
    b = CheckBatcher(checker, max_batch=8, respond=FakeMsg.respond, in_flight=1)
    msgs = [FakeMsg(b"x") for _ in range(3)]
    add(b, *msgs)
    async with asyncio.timeout(2):
        for m in msgs:
            await m.answered.wait()
    assert all(m.answer is not None and b'"code":"unavailable"' in m.answer for m in msgs)
