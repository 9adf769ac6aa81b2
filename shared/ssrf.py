"""The SSRF guard of SPEC 13, shared by what Weir fetches or sends at a developer's URL (webhook deliveries, imports
from a URL): which addresses may be connected to, which URLs are accepted, and the client that connects only to an
address judged (a name is resolved once per attempt, by `resolve`).

Rules (`refused`): loopback, private (RFC 1918, ULA), shared (CGNAT 100.64/10) and other special-purpose networks
are refused unless `allow_private` (development); link-local (the cloud metadata address 169.254.169.254 among
them), multicast, unspecified and reserved addresses are refused always, since no endpoint of a developer's is
there. An IPv6 form that carries an IPv4 address (v4-mapped, v4-compatible, NAT64 64:ff9b::/96, 6to4, Teredo) is
judged by that address too. The tables are Weir's own: Python's `is_private`/`is_global` changed between 3.11 and
3.13 and judge `::ffff:127.0.0.1` and `::127.0.0.1` as neither loopback nor private in 3.11.

Resolution: a name is resolved once per attempt, and the attempt is refused if ANY of its addresses is refused
(else it connects to the first). Picking the first allowed one would let a name that answers both a public and a
private address be steered; refusing such a name outright leaves no choice to play with, and a real endpoint has no
reason to publish a private address beside its public one.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import aiohttp
import httpx
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refusal(StrEnum):
    UNSPECIFIED = "unspecified"  # 0.0.0.0/8, ::  (0.0.0.0 reaches the host itself on Linux)
    LOOPBACK = "loopback"
    PRIVATE = "private"  # RFC 1918, ULA fc00::/7, site-local fec0::/10, local-use NAT64
    SHARED = "shared"  # 100.64/10, carrier-grade NAT
    SPECIAL_PURPOSE = "special_purpose"  # documentation, benchmarking, IETF protocol and others not global
    LINK_LOCAL = "link_local"
    MULTICAST = "multicast"
    RESERVED = "reserved"  # 240/4 with the broadcast, and IPv6 outside global unicast 2000::/3


LIFTED_BY_ALLOW_PRIVATE: frozenset[Refusal] = frozenset(
    {Refusal.LOOPBACK, Refusal.PRIVATE, Refusal.SHARED, Refusal.SPECIAL_PURPOSE})


def _table(*rows: tuple[str, Refusal]) -> tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, Refusal], ...]:
    return tuple((ipaddress.ip_network(net), reason) for net, reason in rows)


_V4 = _table(
    ("0.0.0.0/8", Refusal.UNSPECIFIED),
    ("127.0.0.0/8", Refusal.LOOPBACK),
    ("10.0.0.0/8", Refusal.PRIVATE),
    ("172.16.0.0/12", Refusal.PRIVATE),
    ("192.168.0.0/16", Refusal.PRIVATE),
    ("100.64.0.0/10", Refusal.SHARED),
    ("169.254.0.0/16", Refusal.LINK_LOCAL),
    ("224.0.0.0/4", Refusal.MULTICAST),
    ("240.0.0.0/4", Refusal.RESERVED),
    ("192.0.0.0/24", Refusal.SPECIAL_PURPOSE),
    ("192.0.2.0/24", Refusal.SPECIAL_PURPOSE),
    ("192.88.99.0/24", Refusal.SPECIAL_PURPOSE),
    ("198.18.0.0/15", Refusal.SPECIAL_PURPOSE),
    ("198.51.100.0/24", Refusal.SPECIAL_PURPOSE),
    ("203.0.113.0/24", Refusal.SPECIAL_PURPOSE),
)
_V6 = _table(
    ("::/128", Refusal.UNSPECIFIED),
    ("::1/128", Refusal.LOOPBACK),
    ("fe80::/10", Refusal.LINK_LOCAL),
    ("fc00::/7", Refusal.PRIVATE),
    ("fec0::/10", Refusal.PRIVATE),
    ("ff00::/8", Refusal.MULTICAST),
    ("64:ff9b:1::/48", Refusal.PRIVATE),
    ("100::/64", Refusal.SPECIAL_PURPOSE),
    ("2001::/23", Refusal.SPECIAL_PURPOSE),  # with Teredo 2001::/32
    ("2001:db8::/32", Refusal.SPECIAL_PURPOSE),
)
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def refused(address: IPAddress, allow_private: bool) -> Refusal | None:
    """Why a delivery may not connect to `address`, or None when it may. Of several reasons (an IPv6 form's own and
    the IPv4 address's it carries, in that order from the inside out), the first; in development the first that
    `allow_private` does not lift."""
    reasons = _reasons(address)
    if not allow_private:
        return reasons[0] if reasons else None
    return next((r for r in reasons if r not in LIFTED_BY_ALLOW_PRIVATE), None)


def _reasons(address: IPAddress) -> list[Refusal]:
    if isinstance(address, ipaddress.IPv4Address):
        reason = _lookup(address, _V4) or (None if address.is_global else Refusal.SPECIAL_PURPOSE)
        return [reason] if reason else []
    address = ipaddress.IPv6Address(address.packed)  # without a %scope
    if address.ipv4_mapped is not None:
        return _reasons(address.ipv4_mapped)  # ::ffff:a.b.c.d is a.b.c.d on a dual-stack socket
    if address in _NAT64:
        return _reasons(_embedded(address))  # a v6-only network's route to a.b.c.d
    if address in _V4_COMPATIBLE and int(address) > 1:
        return [*_reasons(_embedded(address)), Refusal.RESERVED]  # deprecated (RFC 4291): never a real endpoint
    reasons = [r for embedded in _tunnelled(address) for r in _reasons(embedded)]
    if (reason := _lookup(address, _V6)) is not None:
        reasons.append(reason)
    elif address not in _GLOBAL_UNICAST:
        reasons.append(Refusal.RESERVED)
    elif not address.is_global:
        reasons.append(Refusal.SPECIAL_PURPOSE)
    return reasons


def _lookup(address: IPAddress, table: Sequence[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, Refusal]],
            ) -> Refusal | None:
    return next((reason for net, reason in table if address in net), None)


def _embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)


def _tunnelled(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses a 6to4 or Teredo address leads to (Teredo: its server and its client)."""
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    return ()


# ------------------------------------------------------------------------------------------------ endpoint URLs


class InvalidEndpointUrl(ValueError):
    """An endpoint URL Weir will not deliver to; `reason` is a stable word for the problem body."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class EndpointUrl:
    url: httpx.URL
    host: str  # ASCII (IDNA) name or IP literal, as resolved, sent as Host and as the TLS server name
    port: int

    @property
    def host_header(self) -> str:
        """The `Host` header: the name, with the port when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.url.port is None else f"{host}:{self.port}"


_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\.?$){_LABEL}(?:\.{_LABEL})*\.?")  # IDNA already applied by httpx


def parse_endpoint_url(text: str, *, allow_private: bool, https_only: bool = True) -> EndpointUrl:
    """An endpoint URL checked as the api accepts it: http or https only, https when `https_only` unless
    `allow_private` (a webhook's: the signature proves who sent an event, not who reads it: on the internet it
    travels encrypted; a file to import may come over http, as Mux's and api.video's do), no user:password
    (credentials in a URL end up in logs), a port from 1 to 65535, no fragment. An IP literal is judged here
    already; a name is judged at each attempt, by what it resolves to then. Parsed by httpx, whose encoded form is
    what is sent (`connect_url`), so the check and the request never read the URL differently."""
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise InvalidEndpointUrl("malformed", f"not a URL: {exc}") from None
    if url.scheme not in _DEFAULT_PORTS:
        raise InvalidEndpointUrl("scheme", "the URL must be http or https")
    if url.scheme != "https" and https_only and not allow_private:
        raise InvalidEndpointUrl("scheme", "the URL must be https")
    if url.userinfo:
        raise InvalidEndpointUrl("userinfo", "the URL may not carry a user or password")
    if url.fragment:
        raise InvalidEndpointUrl("fragment", "the URL may not have a #fragment (it is never sent)")
    host = url.raw_host.decode("ascii")
    literal = _ip_literal(host)
    if not host:
        raise InvalidEndpointUrl("host", "the URL has no host")
    if literal is None and not _HOSTNAME.fullmatch(host):
        raise InvalidEndpointUrl("host", "the host is not a domain name or an IP address")
    if literal is None and _NUMERIC_LABEL.fullmatch(host.rstrip(".").rpartition(".")[2]):
        # `127.1`, `2130706433`, `0x7f000001`: a resolver reads them as IPv4, so they are judged at each attempt
        # only; as names they would be accepted here and then fail every delivery (WHATWG: a host ending in a
        # number is an IPv4 address)
        raise InvalidEndpointUrl("host", "write an IPv4 address as four decimal numbers (a.b.c.d)")
    port = url.port if url.port is not None else _DEFAULT_PORTS[url.scheme]
    if not 1 <= port <= 65535:
        raise InvalidEndpointUrl("port", "the port must be from 1 to 65535")
    if literal is not None and (reason := refused(literal, allow_private)) is not None:
        raise InvalidEndpointUrl("address", f"connections to {reason} addresses are refused")
    return EndpointUrl(url=url, host=host, port=port)


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------- the adapter


class AddressRefused(Exception):
    def __init__(self, address: IPAddress, reason: Refusal) -> None:
        super().__init__(f"{address} is {reason}")
        self.address = address
        self.reason = reason


class NameNotResolved(Exception):
    pass


def choose_address(addresses: Sequence[IPAddress], allow_private: bool) -> IPAddress:
    """The address to connect to, from one resolution: the first, if none of them is refused (see the module's
    docstring for why one refused address refuses the name)."""
    if not addresses:
        raise NameNotResolved("the name resolved to no address")
    for address in addresses:
        if (reason := refused(address, allow_private)) is not None:
            raise AddressRefused(address, reason)
    return addresses[0]


Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]


# getaddrinfo blocks a thread until the name's servers answer or the libc resolver gives up (seconds), and an
# attempt's timeout does not stop that thread. In asyncio's default pool (a handful of threads, shared with every
# other to_thread) a few endpoints whose name servers never answer would hold up every other endpoint's lookup;
# lookups get threads of their own, enough that it takes that many dead names at once (each endpoint has one
# attempt at a time) to make another endpoint wait.
RESOLVER_THREADS = 32
_resolver = ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="ssrf-resolve")


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every TCP address of `host`, in the resolver's order of preference, by one getaddrinfo."""
    try:
        infos = await asyncio.get_running_loop().run_in_executor(
            _resolver, functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM,
                                         proto=socket.IPPROTO_TCP))
    except (socket.gaierror, UnicodeError) as exc:
        raise NameNotResolved(str(exc)) from None
    seen: dict[IPAddress, None] = {}
    for _family, _type, _proto, _name, sockaddr in infos:
        seen.setdefault(ipaddress.ip_address(str(sockaddr[0]).partition("%")[0]), None)
    return list(seen)


def connect_url(endpoint: EndpointUrl, address: IPAddress) -> yarl.URL:
    """The URL the POST goes to: the endpoint's, its host replaced by `address` (always with the port, which the
    `Host` header leaves out when it is the scheme's default). The path and query are httpx's encoded form, sent
    verbatim (`encoded=True`): the URL is read once, by httpx, when it is checked."""
    host = f"[{address}]" if address.version == 6 else str(address)
    return yarl.URL(f"{endpoint.url.scheme}://{host}:{endpoint.port}{endpoint.url.raw_path.decode('ascii')}",
                    encoded=True)


class NoResolver(AbstractResolver):
    """The connector's resolver, never asked: the URL's host is always the address judged (aiohttp resolves no
    address literal). Should a name ever reach it, the connection fails rather than resolve it a second time."""

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET,
                      ) -> list[ResolveResult]:
        raise OSError(f"{host} is not resolved by the connector: only an address judged is connected to")

    async def close(self) -> None:
        pass


def guarded_client(*, concurrency: int = 1, tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """The HTTP client of ONE endpoint, at most `concurrency` connections. One per endpoint because aiohttp pools
    connections by the address connected to (the URL's host is the address): a shared client could send one
    endpoint's event over a TLS connection made (and verified) for another name at the same address (shared
    hosting). aiohttp 3.14 also keys its pool by the TLS server name, the 3.9 of pyproject's range does not; and a
    per-endpoint limit needs a pool per endpoint anyway. `tls`: the context for https (one shared by every client:
    making one loads the CA file, ~75 ms of the loop's CPU), else a default one. No redirects (per request); no
    proxy from the environment (it would connect where the guard did not look); no cookies kept (an endpoint's
    Set-Cookie is never sent back); no decompression. No timeouts of aiohttp's own: the attempt's whole
    `asyncio.timeout` bounds it (a second timer per attempt would only cost)."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency,
                                     ssl=tls if tls is not None else ssl.create_default_context(),
                                     resolver=NoResolver(), use_dns_cache=False)
    return aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                                 auto_decompress=False, timeout=aiohttp.ClientTimeout())
