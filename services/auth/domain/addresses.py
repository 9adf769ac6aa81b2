"""The client address a request is limited by: the TCP peer, or behind trusted proxies the rightmost untrusted hop."""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Sequence
from typing import Final, TypeAlias

_ASCII_SPACE = " \t\r\n"

IpAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
ProxyNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

IPV6_CLIENT_PREFIX: Final = 64
"""One host controls a whole /64, so an IPv6 client is its /64."""


def _normalise(address: IpAddress) -> IpAddress:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            return ipaddress.IPv6Address(address.packed)
    return address


def parse_address(text: str) -> IpAddress | None:
    """An address as proxies write it: bare, `v4:port`, `[v6]` or `[v6]:port`; None for anything else."""
    value = text.strip(_ASCII_SPACE + '"')
    candidate = value
    if value.startswith("["):
        inside, bracket, port = value[1:].partition("]")
        if bracket and (not port or (port.startswith(":") and port[1:].isdigit())):
            candidate = inside
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
        if port.isdigit():
            candidate = host
    try:
        return _normalise(ipaddress.ip_address(candidate))
    except ValueError:
        return None


def parse_trusted_proxies(setting: str) -> tuple[ProxyNetwork, ...]:
    """WEIR_TRUSTED_PROXIES: addresses and CIDRs separated by commas or spaces. A bad entry is an error, not ignored."""
    networks: list[ProxyNetwork] = []
    for entry in re.split(r"[,\s]+", setting.strip()):
        if not entry:
            continue
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(f"WEIR_TRUSTED_PROXIES: {entry!r} is not an address or a network") from None
        if isinstance(network, ipaddress.IPv6Network) and network.prefixlen == 128:
            mapped = network.network_address.ipv4_mapped
            if mapped is not None:
                network = ipaddress.IPv4Network(mapped)
        networks.append(network)
    return tuple(networks)


def address_key(address: IpAddress) -> str:
    """The limit subject for an address: IPv4 in full, IPv6 as its /64 (e.g. `2001:db8:1:2::/64`)."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


def _trusted(address: IpAddress, trusted_proxies: Sequence[ProxyNetwork]) -> bool:
    return any(address in network for network in trusted_proxies)


@functools.lru_cache(maxsize=65536)  # pure, and the same peers and headers come back request after request
def client_address(peer: str, forwarded_for: str | None, trusted_proxies: Sequence[ProxyNetwork]) -> str:
    """The address a request is limited by. `forwarded_for` is every X-Forwarded-For header joined with commas.

    The walk goes right to left and stops at the first untrusted hop, or at an unreadable one (left of it may be the
    client's own words: the nearest hop known is the address); if every hop is trusted, the leftmost is."""
    peer_address = parse_address(peer)
    if peer_address is None:
        return peer.strip(_ASCII_SPACE) or "unknown"
    if not forwarded_for or not _trusted(peer_address, trusted_proxies):
        return address_key(peer_address)
    nearest = peer_address
    for hop in reversed(forwarded_for.split(",")):
        hop_address = parse_address(hop)
        if hop_address is None:
            break
        if not _trusted(hop_address, trusted_proxies):
            return address_key(hop_address)
        nearest = hop_address
    return address_key(nearest)
