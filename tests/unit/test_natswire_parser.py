"""The lean NATS connection's parser: what the server sends, however TCP cuts it, parses to the same messages."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.natswire import Parser, WireUnsupported, no_responders, servers_of

subjects = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=20)
payloads = st.binary(max_size=300)  # any bytes, "\r\n" included: sizes, not delimiters, end a payload


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, tuple[object, ...]]:
    """One server frame and what the parser must make of it."""
    kind = draw(st.sampled_from(["MSG", "MSG+reply", "HMSG", "PING", "PONG", "INFO", "+OK", "-ERR"]))
    sid = draw(st.integers(1, 10**6))
    subject = draw(subjects).encode()
    payload = draw(payloads)
    if kind == "MSG":
        return b"MSG %s %d %d\r\n%s\r\n" % (subject, sid, len(payload), payload), ("msg", sid, subject, b"", b"",
                                                                                    payload)
    if kind == "MSG+reply":
        reply = b"_INBOX.x." + draw(subjects).encode()
        return (b"MSG %s %d %s %d\r\n%s\r\n" % (subject, sid, reply, len(payload), payload),
                ("msg", sid, subject, reply, b"", payload))
    if kind == "HMSG":
        headers = b"NATS/1.0\r\nK: " + draw(subjects).encode() + b"\r\n\r\n"
        total = len(headers) + len(payload)
        return (b"HMSG %s %d %d %d\r\n%s%s\r\n" % (subject, sid, len(headers), total, headers, payload),
                ("msg", sid, subject, b"", headers, payload))
    if kind == "INFO":
        info = {"server_id": draw(subjects), "max_payload": draw(st.integers(1, 10**7))}
        return b"INFO " + json.dumps(info).encode() + b"\r\n", ("info", info)
    if kind == "-ERR":
        return b"-ERR 'Authorization Violation'\r\n", ("err", "Authorization Violation")
    return kind.encode() + b"\r\n", (kind.lower(),)


def parse(pieces: list[bytes]) -> list[tuple[object, ...]]:
    parser = Parser()
    out: list[tuple[object, ...]] = []
    for piece in pieces:
        parsed = parser.feed(piece)
        # the order between kinds is not kept within one feed; within a kind it is
        out += [("msg", *m) for m in parsed.messages]
        out += [("ping",)] * parsed.pings + [("pong",)] * parsed.pongs
        out += [("info", i) for i in parsed.infos] + [("err", e) for e in parsed.errors]
    assert not parser.buf, "everything sent was consumed"
    return out


def _by_kind(items: list[tuple[object, ...]]) -> dict[object, list[tuple[object, ...]]]:
    kinds: dict[object, list[tuple[object, ...]]] = {}
    for item in items:
        kinds.setdefault(item[0], []).append(item)
    return kinds


@given(st.lists(frames(), max_size=12), st.lists(st.integers(0, 5000), max_size=20))
def test_any_cut_of_the_stream_parses_to_the_same_frames(
    sent: list[tuple[bytes, tuple[object, ...]]], cuts: list[int]
) -> None:
    stream = b"".join(raw for raw, _ in sent)
    points = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(points)]
    expected = [want for _, want in sent if want[0] != "+ok"]
    assert _by_kind(parse(pieces)) == _by_kind(expected)
    assert _by_kind(parse([bytes([b]) for b in stream])) == _by_kind(expected)  # one byte at a time


def test_a_malformed_message_line_is_an_error_not_a_guess() -> None:
    with pytest.raises(ValueError):
        Parser().feed(b"MSG only-a-subject\r\n")


def test_no_responders_is_the_servers_503_status() -> None:
    assert no_responders(b"NATS/1.0 503\r\n\r\n")
    assert not no_responders(b"NATS/1.0\r\nK: v\r\n\r\n")


def test_server_urls() -> None:
    a, b, c = servers_of("nats://127.0.0.1:4222, nats://u:p%40ss@h2:5000,tok@h3")
    assert (a.host, a.port, a.user, a.password, a.token) == ("127.0.0.1", 4222, None, None, None)
    assert (b.host, b.port, b.user, b.password, b.token) == ("h2", 5000, "u", "p@ss", None)
    assert (c.host, c.port, c.user, c.password, c.token) == ("h3", 4222, None, None, "tok")
    with pytest.raises(WireUnsupported):
        servers_of("tls://h:4222")
