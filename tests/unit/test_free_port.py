"""`free_port`: the one way tests, benches and `weir up` choose a port for a server they start. It must come from
below the kernel's ephemeral range (an outgoing connection can be handed an ephemeral port between the check and the
server's bind), be bindable now, and not be handed out twice by one process while its server may still be binding it."""

from __future__ import annotations

import socket
import time

import pytest

from shared.devstack import ports
from shared.devstack.ports import claim_port, ephemeral_range, free_port, port_is_free

MANY = 200


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(MANY)]
    assert len(set(ports)) == MANY
    assert [p for p in ports if low <= p <= high] == []
    assert [p for p in ports if not port_is_free(p)] == []


def test_a_port_in_use_is_never_handed_out() -> None:
    low, _ = ephemeral_range()
    with socket.socket() as listening:
        for port in range(low - 1, low - 1 - MANY, -1):  # a port free_port has not claimed, taken behind its back
            try:
                listening.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        listening.listen()
        taken = listening.getsockname()[1]
        assert not port_is_free(taken)
        assert claim_port(taken) != taken  # asked for by name (a restart's old port), it is passed over


def test_a_port_claimed_long_ago_and_free_again_is_handed_to_a_restart_that_asks_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart asks for its previous ports by name: a claim this process made for some earlier server, long gone,
    does not keep it from them (a test worker holds hundreds of such claims)."""
    earlier = free_port()
    assert claim_port(earlier) != earlier  # just handed out: its server may be about to bind it
    later = ports.CLAIM_HOLD_S + 1
    real = time.monotonic
    monkeypatch.setattr(ports.time, "monotonic", lambda: real() + later)
    assert claim_port(earlier) == earlier
