"""The client address a request is limited by, behind trusted proxies or not."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.addresses import client_address, parse_address, parse_trusted_proxies
from tests.unit.authfixtures import ADDRESS

PROXIES = parse_trusted_proxies("10.0.0.0/8, 2001:db8:ffff::/48")


@pytest.mark.parametrize(
    "forwarded_for",
    [None, "", "1.1.1.1", "1.1.1.1, 10.0.0.1", "10.0.0.1", "2001:db8::1", "garbage", "1.1.1.1,,,", ADDRESS],
)
def test_an_untrusted_peer_is_the_address_whatever_it_forwards(forwarded_for: str | None) -> None:
    assert client_address("192.0.2.33", forwarded_for, PROXIES) == "192.0.2.33"
    assert client_address("192.0.2.33", forwarded_for, ()) == "192.0.2.33"


@pytest.mark.parametrize(
    ("forwarded_for", "expected"),
    [
        ("192.0.2.1", "192.0.2.1"),
        ("192.0.2.1, 10.1.2.3", "192.0.2.1"),
        ("192.0.2.1,10.1.2.3,10.9.9.9", "192.0.2.1"),
        ("6.6.6.6, 192.0.2.1", "192.0.2.1"),  # a spoofed leftmost entry
        ("6.6.6.6, 7.7.7.7, 192.0.2.1, 10.1.2.3", "192.0.2.1"),
        ("10.1.1.1, 10.2.2.2", "10.1.1.1"),  # every hop trusted: the leftmost
        ("6.6.6.6, garbage, 10.1.2.3", "10.1.2.3"),  # unreadable hop: the nearest known one, never left of it
        ("6.6.6.6, unknown", "10.0.0.2"),
        ("6.6.6.6, ", "10.0.0.2"),
        ("   ", "10.0.0.2"),
        ("", "10.0.0.2"),
        (None, "10.0.0.2"),
        ("192.0.2.1:5555", "192.0.2.1"),
        ('"192.0.2.1"', "192.0.2.1"),
        ("[2001:db8:1:2::99]:443", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:aaaa::1, 2001:db8:ffff::7", "2001:db8:1:2::/64"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("::ffff:10.1.1.1", "10.1.1.1"),  # mapped: trusted like its IPv4, and the only hop
    ],
)
def test_a_trusted_peer_forwards_the_rightmost_untrusted_hop(forwarded_for: str | None, expected: str) -> None:
    assert client_address("10.0.0.2", forwarded_for, PROXIES) == expected


def test_ipv6_clients_are_their_64_and_ipv4_the_full_address() -> None:
    assert client_address("2001:db8:1:2:3:4:5:6", None, ()) == "2001:db8:1:2::/64"
    assert client_address("2001:db8:1:2:ffff::", None, ()) == client_address("2001:db8:1:2::1", None, ())
    assert client_address("2001:db8:1:3::1", None, ()) != client_address("2001:db8:1:2::1", None, ())
    assert client_address("fe80::1%eth0", None, ()) == "fe80::/64"
    assert client_address("192.0.2.1", None, ()) != client_address("192.0.2.2", None, ())


def test_ipv4_mapped_peers_are_ipv4_for_trust_and_for_the_address() -> None:
    assert client_address("::ffff:192.0.2.1", None, ()) == "192.0.2.1"
    assert client_address("::ffff:10.0.0.2", "192.0.2.1", PROXIES) == "192.0.2.1"


def test_an_unreadable_peer_is_kept_as_given() -> None:
    assert client_address("testclient", "192.0.2.1", PROXIES) == "testclient"
    assert client_address("", None, PROXIES) == "unknown"


def test_parse_trusted_proxies() -> None:
    assert parse_trusted_proxies("") == ()
    assert parse_trusted_proxies("  ") == ()
    nets = parse_trusted_proxies("10.0.0.1, 172.16.0.0/12 2001:db8::/32,::ffff:192.0.2.9,10.1.2.3/8")
    assert nets == (
        ipaddress.ip_network("10.0.0.1/32"),
        ipaddress.ip_network("172.16.0.0/12"),
        ipaddress.ip_network("2001:db8::/32"),
        ipaddress.ip_network("192.0.2.9/32"),
        ipaddress.ip_network("10.0.0.0/8"),
    )
    for bad in ("10.0.0.0/33", "proxy.internal", "10.0.0.1, nope"):
        with pytest.raises(ValueError, match="WEIR_TRUSTED_PROXIES"):
            parse_trusted_proxies(bad)


def test_parse_address_forms() -> None:
    assert parse_address("[2001:db8::1]") == ipaddress.ip_address("2001:db8::1")
    for bad in ("[2001:db8::1", "[::1]x", "[::1]:", "1.2.3.4:", "1.2.3.4:http", "999.1.1.1", "", "a,b"):
        assert parse_address(bad) is None, bad


_untrusted_v4 = st.ip_addresses(v=4).filter(lambda a: not any(a in n for n in PROXIES))
_trusted_v4 = st.integers(min_value=0, max_value=2**24 - 1).map(lambda i: ipaddress.IPv4Address((10 << 24) + i))


@given(_untrusted_v4, st.text(max_size=200))
def test_an_untrusted_peer_never_yields_an_address_from_the_header(peer: ipaddress.IPv4Address, xff: str) -> None:
    assert client_address(str(peer), xff, PROXIES) == str(peer)


@given(st.text(max_size=200), _untrusted_v4, st.lists(_trusted_v4, max_size=4), _trusted_v4)
def test_a_client_can_never_pick_its_own_address(
    client_words: str, real: ipaddress.IPv4Address, hops: list[ipaddress.IPv4Address], peer: ipaddress.IPv4Address
) -> None:
    # whatever the client wrote, each trusted proxy appended the address it saw
    xff = ", ".join([client_words, str(real), *map(str, hops)])
    assert client_address(str(peer), xff, PROXIES) == str(real)
