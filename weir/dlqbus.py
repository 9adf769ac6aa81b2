"""The DLQ stream through the operator's rights: read parked messages (an ephemeral, filtered consumer, as `weir
replay` reads), re-drive one to its consumer's replay subject, remove one, purge."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import HDR_MSG_ID, HDR_ORIGINAL_SUBJECT, HDR_REPROCESS, HDR_TYPE, HDR_VERSION, sender_version
from shared.contracts import DLQ_STREAM, DLQ_SUBJECTS, REPLAY_STREAM, dlq_subject, replay_durable, replay_subject
from shared.publishers import publish_acked
from shared.streamread import stream_messages
from weir.deadletters import Parked, original_of


async def parked_messages(js: JetStreamContext, *, event_type: str | None = None, since: datetime | None = None,
                          from_seq: int | None = None, batch: int = 256) -> AsyncGenerator[Parked, None]:
    """The DLQ's messages (of one type; from a time or a sequence), in stream order, up to the last one stored when
    the read began (parking goes on meanwhile)."""
    info = await js.stream_info(DLQ_STREAM)
    if info.state.messages == 0:
        return
    subjects = [dlq_subject(event_type) if event_type else DLQ_SUBJECTS]
    # closed with this generator: a reader that stops early has the read's consumer unsubscribed at once
    async with aclosing(stream_messages(js, DLQ_STREAM, subjects, last_seq=info.state.last_seq, from_seq=from_seq,
                                        since=since, batch=batch)) as messages:
        async for msg in messages:
            yield Parked(seq=msg.metadata.sequence.stream, subject=msg.subject, time=msg.metadata.timestamp,
                         headers=dict(msg.headers or {}), data=msg.data)


async def parked_message(js: JetStreamContext, seq: int) -> Parked | None:
    """The parked message of this sequence (None: there is none, or it was removed)."""
    # closed here, while connected: left to the loop, the read's unsubscribe would come after the drain and fail
    async with aclosing(parked_messages(js, from_seq=seq, batch=1)) as found:
        async for parked in found:
            return parked if parked.seq == seq else None
    return None


async def last_parked_seq(js: JetStreamContext) -> int:
    """The DLQ's last sequence: what is parked after it is newer than now."""
    return int((await js.stream_info(DLQ_STREAM)).state.last_seq)


async def replay_readers(js: JetStreamContext) -> set[str]:
    """The consumers that read their replay subject (a `<name>_replay` durable on REPLAY): where a copy can go."""
    suffix = replay_durable("")
    return {name.removesuffix(suffix) for info in await js.consumers_info(REPLAY_STREAM)
            if (name := info.config.durable_name or info.name or "").endswith(suffix)}


async def settled_through(js: JetStreamContext, consumer: str) -> int:
    """The REPLAY sequence up to which the consumer's replay durable has acked everything (0: no durable). The
    consumer acks a copy only after its inbox commit or its park was stored, so what is past it is final there."""
    try:
        info = await js.consumer_info(REPLAY_STREAM, replay_durable(consumer))
    except NotFoundError:
        return 0
    return int(info.ack_floor.stream_seq) if info.ack_floor else 0


async def redrive(js: JetStreamContext, parked: Parked, consumer: str, run_id: str, *, timeout: float) -> int:
    """A copy of the parked event on `replay.<consumer>.<type>` (JetStream-acknowledged), with the headers a replay
    copy has: handled as a first delivery (the inbox has no record of a parked event), from its original subject.
    Returns the copy's REPLAY sequence."""
    headers = {HDR_MSG_ID: f"redrive-{run_id}-{parked.seq}", HDR_TYPE: parked.event_type, HDR_REPROCESS: "0",
               HDR_ORIGINAL_SUBJECT: original_of(parked), HDR_VERSION: sender_version(parked.headers)}
    ack = await publish_acked(js, replay_subject(consumer, parked.event_type), parked.data, headers,
                              stream=REPLAY_STREAM, timeout=timeout)
    return int(ack.seq)


async def remove(js: JetStreamContext, seq: int) -> bool:
    """Remove one parked message (False: it was gone already)."""
    try:
        return bool(await js.delete_msg(DLQ_STREAM, seq))
    except NotFoundError:
        return False


async def purge(js: JetStreamContext, event_type: str | None) -> int:
    """Remove every parked message (of one type); returns how many were there."""
    before = (await js.stream_info(DLQ_STREAM)).state.messages
    await js.purge_stream(DLQ_STREAM, subject=dlq_subject(event_type) if event_type else None)
    return before - (await js.stream_info(DLQ_STREAM)).state.messages


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
