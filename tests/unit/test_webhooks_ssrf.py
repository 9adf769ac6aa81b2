"""The SSRF guard of SPEC 13 without a socket: every refused range and IPv6 form, the endpoint URL rules, the choice
among a name's addresses, the URL and headers built to connect as resolved, the log's word for each failure and the
client's settings. The adapter itself runs on real sockets in tests/integration/test_webhook_sender.py."""

from __future__ import annotations

import ipaddress

import aiohttp
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.webhooks.domain import AttemptError
from services.webhooks.ssrf import (
    LIFTED_BY_ALLOW_PRIVATE,
    USER_AGENT,
    AddressRefused,
    EndpointUrl,
    InvalidEndpointUrl,
    IPAddress,
    NameNotResolved,
    Refusal,
    attempt_error,
    choose_address,
    connect_url,
    delivery_client,
    delivery_headers,
    parse_endpoint_url,
    refused,
)

HOOK = "https://hooks.example.com/weir"
PUBLIC_V4, PUBLIC_V6 = "93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"  # never connected to


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


# ------------------------------------------------------------------------------------------------ address rules

CASES: list[tuple[str, Refusal | None]] = [
    # IPv4
    ("127.0.0.1", Refusal.LOOPBACK), ("127.255.255.254", Refusal.LOOPBACK),
    ("10.0.0.1", Refusal.PRIVATE), ("172.16.0.1", Refusal.PRIVATE), ("172.31.255.255", Refusal.PRIVATE),
    ("192.168.1.1", Refusal.PRIVATE),
    ("100.64.0.1", Refusal.SHARED), ("100.127.255.254", Refusal.SHARED),
    ("169.254.169.254", Refusal.LINK_LOCAL), ("169.254.0.1", Refusal.LINK_LOCAL),
    ("224.0.0.1", Refusal.MULTICAST), ("239.255.255.250", Refusal.MULTICAST),
    ("0.0.0.0", Refusal.UNSPECIFIED), ("0.1.2.3", Refusal.UNSPECIFIED),
    ("255.255.255.255", Refusal.RESERVED), ("240.0.0.1", Refusal.RESERVED),
    ("192.0.2.1", Refusal.SPECIAL_PURPOSE), ("198.51.100.1", Refusal.SPECIAL_PURPOSE),
    ("203.0.113.1", Refusal.SPECIAL_PURPOSE), ("198.18.0.1", Refusal.SPECIAL_PURPOSE),
    ("192.0.0.8", Refusal.SPECIAL_PURPOSE), ("192.88.99.1", Refusal.SPECIAL_PURPOSE),
    (PUBLIC_V4, None), ("8.8.8.8", None), ("172.15.255.255", None), ("172.32.0.0", None), ("100.63.255.255", None),
    ("100.128.0.0", None), ("11.0.0.1", None), ("223.255.255.254", None),
    # IPv6
    ("::1", Refusal.LOOPBACK), ("::", Refusal.UNSPECIFIED),
    ("fe80::1", Refusal.LINK_LOCAL), ("fe80::1%eth0", Refusal.LINK_LOCAL), ("febf::1", Refusal.LINK_LOCAL),
    ("fc00::1", Refusal.PRIVATE), ("fd12:3456:789a::1", Refusal.PRIVATE), ("fec0::1", Refusal.PRIVATE),
    ("64:ff9b:1::1", Refusal.PRIVATE),
    ("ff02::1", Refusal.MULTICAST), ("ff0e::1", Refusal.MULTICAST),
    ("2001:db8::1", Refusal.SPECIAL_PURPOSE), ("100::1", Refusal.SPECIAL_PURPOSE),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", Refusal.SPECIAL_PURPOSE),  # Teredo to a public client: not global
    ("4000::1", Refusal.RESERVED), ("::ffff:0:808:808", Refusal.RESERVED),  # outside 2000::/3 (SIIT in ::/8)
    (PUBLIC_V6, None), ("2a00:1450:4001::1", None),
    # IPv6 carrying IPv4: judged by the IPv4 address
    ("::ffff:127.0.0.1", Refusal.LOOPBACK), ("::ffff:10.0.0.1", Refusal.PRIVATE),
    ("::ffff:169.254.169.254", Refusal.LINK_LOCAL), ("::ffff:100.64.0.1", Refusal.SHARED),
    ("::ffff:0.0.0.0", Refusal.UNSPECIFIED), (f"::ffff:{PUBLIC_V4}", None),
    ("::127.0.0.1", Refusal.LOOPBACK), ("::10.0.0.1", Refusal.PRIVATE),
    (f"::{PUBLIC_V4}", Refusal.RESERVED),  # IPv4-compatible: deprecated, never a real endpoint
    ("64:ff9b::127.0.0.1", Refusal.LOOPBACK), ("64:ff9b::192.168.0.1", Refusal.PRIVATE),
    (f"64:ff9b::{PUBLIC_V4}", None),  # NAT64 to a public address: how an IPv6-only network reaches it
    ("2002:7f00:1::1", Refusal.LOOPBACK), ("2002:a00:1::", Refusal.PRIVATE), ("2002:a9fe:a9fe::", Refusal.LINK_LOCAL),
    ("2002:5db8:d70e::1", None),  # 6to4 of a public address
    ("2001:0:7f00:1::f7f7:f7f7", Refusal.LOOPBACK),  # Teredo whose server is 127.0.0.1 (its client 8.8.8.8)
]


def test_a_reason_development_does_not_lift_wins_over_one_it_does() -> None:
    teredo = ip("2001:0:7f00:1::")  # server 127.0.0.1, client 255.255.255.255
    assert refused(teredo, allow_private=False) is Refusal.LOOPBACK
    assert refused(teredo, allow_private=True) is Refusal.RESERVED
    assert refused(ip("::169.254.169.254"), allow_private=True) is Refusal.LINK_LOCAL


@pytest.mark.parametrize(("address", "reason"), CASES)
def test_each_address_is_judged(address: str, reason: Refusal | None) -> None:
    assert refused(ip(address), allow_private=False) is reason


@pytest.mark.parametrize(("address", "reason"), CASES)
def test_allow_private_lifts_loopback_private_shared_and_special_purpose_only(
        address: str, reason: Refusal | None) -> None:
    expected = None if reason is None or reason in LIFTED_BY_ALLOW_PRIVATE else reason
    assert refused(ip(address), allow_private=True) is STILL_REFUSED_IN_DEVELOPMENT.get(address, expected)


# IPv4-compatible forms carry a lifted address in a form refused always, so development refuses them still
STILL_REFUSED_IN_DEVELOPMENT = {"::127.0.0.1": Refusal.RESERVED, "::10.0.0.1": Refusal.RESERVED}


def test_every_reason_is_tested_and_link_local_stays_refused() -> None:
    assert {reason for _, reason in CASES} == {*Refusal, None}
    assert LIFTED_BY_ALLOW_PRIVATE == {Refusal.LOOPBACK, Refusal.PRIVATE, Refusal.SHARED, Refusal.SPECIAL_PURPOSE}


V4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)


@given(V4, st.booleans())
def test_any_v4_address_is_judged_alike_in_every_v6_form_that_carries_it(
        address: ipaddress.IPv4Address, allow_private: bool) -> None:
    reason = refused(address, allow_private)
    mapped = ipaddress.IPv6Address(f"::ffff:{address}")
    nat64 = ipaddress.IPv6Address(f"64:ff9b::{address}")
    assert refused(mapped, allow_private) is reason
    assert refused(nat64, allow_private) is reason
    sixtofour = ipaddress.IPv6Address((0x2002 << 112) | (int(address) << 80) | 1)
    if reason is not None:
        assert refused(sixtofour, allow_private) is reason


@pytest.mark.parametrize(("network", "reason"), [
    ("127.0.0.0/8", Refusal.LOOPBACK), ("10.0.0.0/8", Refusal.PRIVATE), ("172.16.0.0/12", Refusal.PRIVATE),
    ("192.168.0.0/16", Refusal.PRIVATE), ("100.64.0.0/10", Refusal.SHARED), ("169.254.0.0/16", Refusal.LINK_LOCAL),
    ("224.0.0.0/4", Refusal.MULTICAST), ("240.0.0.0/4", Refusal.RESERVED), ("0.0.0.0/8", Refusal.UNSPECIFIED),
    ("fc00::/7", Refusal.PRIVATE), ("fe80::/10", Refusal.LINK_LOCAL), ("ff00::/8", Refusal.MULTICAST),
])
@given(offset=st.integers(0, 2**128 - 1))
def test_every_address_of_a_refused_network_is_refused(network: str, reason: Refusal, offset: int) -> None:
    net = ipaddress.ip_network(network)
    assert refused(net[offset % net.num_addresses], allow_private=False) is reason


# ------------------------------------------------------------------------------------------------- endpoint URLs


@pytest.mark.parametrize(("url", "host", "port", "host_header"), [
    ("https://hooks.example.com/weir", "hooks.example.com", 443, "hooks.example.com"),
    ("https://Hooks.Example.COM:8443/a?b=c", "hooks.example.com", 8443, "hooks.example.com:8443"),
    ("https://bücher.example/x", "xn--bcher-kva.example", 443, "xn--bcher-kva.example"),
    (f"https://[{PUBLIC_V6}]/x", PUBLIC_V6, 443, f"[{PUBLIC_V6}]"),
    (f"https://{PUBLIC_V4}:444/", PUBLIC_V4, 444, f"{PUBLIC_V4}:444"),
])
def test_https_urls_are_accepted_with_their_host_and_port(url: str, host: str, port: int, host_header: str) -> None:
    endpoint = parse_endpoint_url(url, allow_private=False)
    assert (endpoint.host, endpoint.port, endpoint.host_header) == (host, port, host_header)


@pytest.mark.parametrize(("url", "reason"), [
    ("http://hooks.example.com/", "scheme"),  # plain http only in development
    ("ftp://hooks.example.com/", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("gopher://hooks.example.com/", "scheme"),
    ("hooks.example.com/x", "scheme"),
    ("https://user:pw@hooks.example.com/", "userinfo"),
    ("https://user@hooks.example.com/", "userinfo"),
    ("https://hooks.example.com/#frag", "fragment"),
    ("https:///path", "host"),
    ("https://hooks.example.com:0/", "port"),
    ("https://hooks.example.com:65536/", "port"),
    ("https://127.0.0.1/", "address"),
    ("https://[::1]/", "address"),
    ("https://[::ffff:127.0.0.1]/", "address"),
    ("https://169.254.169.254/latest/meta-data", "address"),
    ("https://10.0.0.1/", "address"),
    ("https://exa mple.com/", "host"),  # httpx would send exa%20mple.com
    ("https://-hooks.example.com/", "host"),
    ("https://hooks..example.com/", "host"),
    ("https://" + "a" * 64 + ".example.com/", "host"),
    ("https://[::1/", "malformed"),
    ("https://hooks.example.com:abc/", "malformed"),
])
def test_urls_weir_will_not_deliver_to_are_refused(url: str, reason: str) -> None:
    with pytest.raises(InvalidEndpointUrl) as caught:
        parse_endpoint_url(url, allow_private=False)
    assert caught.value.reason == reason


@pytest.mark.parametrize("url", ["http://127.0.0.1:8081/hook", "http://[::1]:8081/", "https://10.0.0.1/",
                                 "http://localhost:9000/"])
def test_development_allows_plain_http_and_private_literals(url: str) -> None:
    assert parse_endpoint_url(url, allow_private=True).url == httpx.URL(url)


def test_development_still_refuses_link_local_literals() -> None:
    with pytest.raises(InvalidEndpointUrl):
        parse_endpoint_url("http://169.254.169.254/", allow_private=True)


# ------------------------------------------------------------------------------------------ choosing the address


def test_the_first_address_is_used_when_none_is_refused() -> None:
    assert choose_address([ip(PUBLIC_V6), ip(PUBLIC_V4)], allow_private=False) == ip(PUBLIC_V6)


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["::1"], ["::ffff:127.0.0.1"], [PUBLIC_V4, "10.0.0.1"],
                                       ["10.0.0.1", PUBLIC_V4], [PUBLIC_V6, "fd00::1"]])
def test_a_name_is_refused_if_any_of_its_addresses_is(addresses: list[str]) -> None:
    with pytest.raises(AddressRefused):
        choose_address([ip(a) for a in addresses], allow_private=False)


def test_a_name_with_no_address_is_not_resolved() -> None:
    with pytest.raises(NameNotResolved):
        choose_address([], allow_private=False)


def test_development_connects_to_loopback() -> None:
    assert choose_address([ip("::1"), ip("127.0.0.1")], allow_private=True) == ip("::1")


# ---------------------------------------------------------------------------------- the request, as resolved


@pytest.mark.parametrize(("url", "address", "connect_url_", "host_header"), [
    ("https://hooks.example.com/weir?x=1", PUBLIC_V4, f"https://{PUBLIC_V4}/weir?x=1", "hooks.example.com"),
    ("https://hooks.example.com:8443/w", PUBLIC_V6, f"https://[{PUBLIC_V6}]:8443/w", "hooks.example.com:8443"),
    ("http://receiver.local:8081/h", "127.0.0.1", "http://127.0.0.1:8081/h", "receiver.local:8081"),
    ("https://hooks.example.com/a%20b/%C3%BC?q=%2F", PUBLIC_V4, f"https://{PUBLIC_V4}/a%20b/%C3%BC?q=%2F",
     "hooks.example.com"),
])
def test_the_request_connects_to_the_address_and_names_the_host(url: str, address: str, connect_url_: str,
                                                                host_header: str) -> None:
    endpoint = parse_endpoint_url(url, allow_private=True)
    target = connect_url(endpoint, ip(address))
    assert str(target) == connect_url_ and target.raw_host == address and target.port == endpoint.port
    assert target.raw_path_qs == endpoint.url.raw_path.decode()  # sent as httpx encoded it, not read again
    headers = delivery_headers(endpoint, {"webhook-id": "e1"})
    assert headers == {"webhook-id": "e1", "Host": host_header, "Content-Type": "application/json",
                       "Accept-Encoding": "identity", "User-Agent": USER_AGENT}


# --------------------------------------------------------------------------------------------- the adapter
# On real sockets: tests/integration/test_webhook_sender.py (each answer, failure and guarantee, its exceptions).


@pytest.mark.parametrize(("exc", "error"), [
    (aiohttp.ClientOSError(104, "Connection reset by peer"), AttemptError.CONNECT_FAILED),
    (ConnectionRefusedError(), AttemptError.CONNECT_FAILED),
    (aiohttp.ServerTimeoutError(), AttemptError.TIMEOUT),
    (aiohttp.ConnectionTimeoutError(), AttemptError.TIMEOUT),
    (TimeoutError(), AttemptError.TIMEOUT),
    (aiohttp.ServerDisconnectedError(), AttemptError.PROTOCOL_ERROR),
    (aiohttp.ClientPayloadError("x"), AttemptError.PROTOCOL_ERROR),
    (NameNotResolved("x"), AttemptError.DNS_FAILED),
    (AddressRefused(ip("127.0.0.1"), Refusal.LOOPBACK), AttemptError.ADDRESS_REFUSED),
])
def test_each_failure_has_its_word_in_the_log(exc: BaseException, error: AttemptError) -> None:
    assert attempt_error(exc) is error


async def test_the_client_keeps_no_cookie_decompresses_nothing_and_reads_no_proxy_from_the_environment() -> None:
    async with delivery_client(concurrency=3) as client:
        assert isinstance(client.cookie_jar, aiohttp.DummyCookieJar)
        assert client.trust_env is False and client.auto_decompress is False
        assert isinstance(client.connector, aiohttp.TCPConnector) and client.connector.limit == 3


def test_an_endpoint_url_keeps_the_parsed_url() -> None:
    endpoint = parse_endpoint_url(HOOK, allow_private=False)
    assert isinstance(endpoint, EndpointUrl) and endpoint.url == httpx.URL(HOOK)
