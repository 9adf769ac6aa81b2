"""The `wal` transport's pure parts: an event's frame read back as the outbox row it stands for, and pgoutput's
messages (protocol version 1) read as whole transactions of one schema's events."""

from __future__ import annotations

import struct
import uuid

from shared.events import Envelope, VideoCreated, new_event
from shared.outbox import WAL_PREFIX, bus_subject, read_wal_frame, wal_frame
from shared.walrelay import _start_of, parse

PREFIX = WAL_PREFIX + "api"


def event() -> Envelope:
    vid = str(uuid.uuid4())
    return new_event(VideoCreated(video_id=vid, app_id=vid, account_id=vid), source="test", subject=vid)


def begin() -> bytes:
    return b"B" + struct.pack(">qqi", 100, 0, 7)


def message(prefix: str, content: bytes, transactional: bool = True) -> bytes:
    head = b"M" + struct.pack(">bq", int(transactional), 5) + prefix.encode() + b"\0"
    return head + struct.pack(">i", len(content)) + content


def commit(end_lsn: int) -> bytes:
    return b"C" + struct.pack(">bqqq", 0, end_lsn - 8, end_lsn, 0)


def test_a_frame_reads_back_as_the_row_of_its_event() -> None:
    ev = event()
    row = read_wal_frame(wal_frame(ev))
    assert row == {"id": ev.id, "subject": "video.created", "bus_subject": bus_subject(ev),
                   "traceparent": None, "payload": ev.to_bytes()}


def test_a_frame_of_another_version_or_shape_is_not_read() -> None:
    assert read_wal_frame(b"weir2\0a\0b\0c\0d\0{}") is None
    assert read_wal_frame(b"weir1\0too\0few") is None


def test_transactions_come_whole_with_their_schemas_events_in_order() -> None:
    first, second, third = event(), event(), event()
    messages = [
        begin(), message(PREFIX, wal_frame(first)), message(WAL_PREFIX + "media", wal_frame(second)),
        message(PREFIX, wal_frame(second)), commit(1000),
        begin(), commit(2000),  # nothing of this schema: still a transaction the slot moves past
        begin(), message(PREFIX, b"weir9\0later"), message(PREFIX, wal_frame(third)), commit(3000),
        begin(), message(PREFIX, wal_frame(event())),  # not ended in this read: left for the next
    ]
    done, consumed, unreadable = parse(messages, PREFIX)
    assert [t.end_lsn for t in done] == [1000, 2000, 3000]
    assert consumed == len(messages) - 2  # the last transaction's begin and event wait for the rest
    assert [[e["id"] for e in t.events] for t in done] == [[first.id, second.id], [], [third.id]]
    assert unreadable == 1


def test_a_prefix_that_begins_like_this_schemas_is_another_schemas() -> None:
    done, _, _ = parse([begin(), message(PREFIX + "_v2", wal_frame(event())), commit(10)], PREFIX)
    assert done[0].events == ()


def test_a_failed_transaction_is_kept_from_its_begin_on() -> None:
    first, second = [begin(), message(PREFIX, wal_frame(event())), commit(10)], [begin(), commit(20)]
    rest = [begin(), message(PREFIX, wal_frame(event()))]
    messages = first + second + rest
    assert _start_of(messages, 0) == 0
    assert _start_of(messages, 1) == len(first)
    assert _start_of(messages, 2) == len(first + second)
