"""The DLQ stream through the operator's rights: read parked messages (an ephemeral, filtered consumer, as `weir
replay` reads), re-drive one to its consumer's replay subject, remove one, purge."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import HDR_MSG_ID, HDR_ORIGINAL_SUBJECT, HDR_REPROCESS, HDR_TYPE, HDR_VERSION, sender_version
from shared.contracts import DLQ_STREAM, DLQ_SUBJECTS, REPLAY_STREAM, dlq_subject, replay_durable, replay_subject
from shared.publishers import publish_acked
from shared.streamread import stream_messages
from weir.deadletters import Parked, original_of


async def parked_messages(js: JetStreamContext, *, event_type: str | None = None, since: datetime | None = None,
                          from_seq: int | None = None, batch: int = 256) -> AsyncIterator[Parked]:
    """The DLQ's messages (of one type; from a time or a sequence), in stream order, up to the last one stored when
    the read began (parking goes on meanwhile)."""
    info = await js.stream_info(DLQ_STREAM)
    if info.state.messages == 0:
        return
    subjects = [dlq_subject(event_type) if event_type else DLQ_SUBJECTS]
    async for msg in stream_messages(js, DLQ_STREAM, subjects, last_seq=info.state.last_seq, from_seq=from_seq,
                                     since=since, batch=batch):
        yield Parked(seq=msg.metadata.sequence.stream, subject=msg.subject, time=msg.metadata.timestamp,
                     headers=dict(msg.headers or {}), data=msg.data)


async def parked_message(js: JetStreamContext, seq: int) -> Parked | None:
    """The parked message of this sequence (None: there is none, or it was removed)."""
    async for parked in parked_messages(js, from_seq=seq, batch=1):
        return parked if parked.seq == seq else None
    return None


async def has_replay_durable(js: JetStreamContext, consumer: str) -> bool:
    """Whether the consumer reads its replay subject (its `<name>_replay` durable exists): a copy for a consumer
    without one would wait in REPLAY for nobody."""
    try:
        await js.consumer_info(REPLAY_STREAM, replay_durable(consumer))
    except NotFoundError:
        return False
    return True


async def redrive(js: JetStreamContext, parked: Parked, consumer: str, run_id: str, *, timeout: float) -> None:
    """A copy of the parked event on `replay.<consumer>.<type>` (JetStream-acknowledged), with the headers a replay
    copy has: handled as a first delivery (the inbox has no record of a parked event), from its original subject."""
    headers = {HDR_MSG_ID: f"redrive-{run_id}-{parked.seq}", HDR_TYPE: parked.event_type, HDR_REPROCESS: "0",
               HDR_ORIGINAL_SUBJECT: original_of(parked), HDR_VERSION: sender_version(parked.headers)}
    await publish_acked(js, replay_subject(consumer, parked.event_type), parked.data, headers, stream=REPLAY_STREAM,
                        timeout=timeout)


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
