"""Reading a slice of a stream once, as `weir replay`, `weir dlq` and `weir rebuild` do: an ephemeral pull consumer
(no acks, in memory, gone a minute after its reader) from a sequence or a time, up to the last message stored when
the read began, so a live stream does not extend the slice."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from datetime import datetime

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api


async def stream_batches(
    js: JetStreamContext, stream: str, subjects: Sequence[str], *, last_seq: int, from_seq: int | None = None,
    since: datetime | None = None, batch: int = 256,
) -> AsyncGenerator[tuple[list[Msg], int], None]:
    """(messages, how many the slice holds) per fetch, in stream order, of the stream's messages on `subjects` from
    `from_seq` (or the time `since`, or the start) through `last_seq`; ends at the first message past it."""
    if from_seq is not None:
        if from_seq > last_seq:
            return
        start: dict[str, object] = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": from_seq}
    elif since is not None:
        start = {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "opt_start_time": since}
    else:
        start = {"deliver_policy": api.DeliverPolicy.ALL}
    sub = await js.pull_subscribe(subjects[0], stream=stream, config=api.ConsumerConfig(
        filter_subjects=list(subjects) if len(subjects) > 1 else None, ack_policy=api.AckPolicy.NONE,
        inactive_threshold=60.0, mem_storage=True, **start))  # type: ignore[arg-type]
    try:
        total = (await sub.consumer_info()).num_pending or 0
        seen = 0
        while seen < total:
            try:
                msgs = await sub.fetch(min(batch, total - seen), timeout=2.0)
            except TimeoutError:
                return
            seen += len(msgs)
            within = [m for m in msgs if m.metadata.sequence.stream <= last_seq]
            if within:
                yield within, total
            if len(within) < len(msgs):
                return
    finally:
        await sub.unsubscribe()


async def stream_messages(
    js: JetStreamContext, stream: str, subjects: Sequence[str], *, last_seq: int, from_seq: int | None = None,
    since: datetime | None = None, batch: int = 256,
) -> AsyncGenerator[Msg, None]:
    """`stream_batches`' messages one by one. A reader that stops early closes this (`contextlib.aclosing`), which
    closes the batches in turn: their consumer is unsubscribed then, not by the loop after the connection is gone."""
    async with aclosing(stream_batches(js, stream, subjects, last_seq=last_seq, from_seq=from_seq, since=since,
                                       batch=batch)) as batches:
        async for msgs, _ in batches:
            for msg in msgs:
                yield msg
