"""`shared.natsconn.pub_commands`: the bytes nats-py's own `pub_cmd` writes for each message, and its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.errors import BadSubjectError, MaxPayloadError
from nats.protocol.command import pub_cmd

from shared.natsconn import pub_commands

_TOKEN = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF, exclude_characters="."), min_size=1,
                 max_size=12)
_SUBJECT = st.lists(_TOKEN, min_size=1, max_size=5).map(".".join)


@given(st.lists(st.tuples(_SUBJECT, st.binary(max_size=300)), min_size=1, max_size=20))
def test_the_command_is_nats_pys_for_each_message(messages: list[tuple[str, bytes]]) -> None:
    command, size = pub_commands(messages, 1 << 20)
    assert command == b"".join(pub_cmd(subject, "", payload) for subject, payload in messages)
    assert size == sum(len(payload) for _, payload in messages)


@pytest.mark.parametrize("bad", ["", "a b", "a\tb", "a\r", "\nb"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_subject_nats_py_refuses_refuses_the_batch(bad: str, where: int) -> None:
    messages = [("_INBOX.a.1", b"x"), ("_INBOX.a.2", b"y"), ("_INBOX.a.3", b"z")]
    messages[where] = (bad, b"x")
    with pytest.raises(BadSubjectError):
        pub_commands(messages, 1 << 20)


def test_a_payload_over_the_servers_limit_refuses_the_batch() -> None:
    with pytest.raises(MaxPayloadError):
        pub_commands([("a", b"x" * 10), ("b", b"x" * 11)], 10)
    assert pub_commands([("a", b"x" * 10)], 10)[1] == 10
