"""Webhook deliveries through the SSRF guard of SPEC 13 (shared/ssrf.py): one attempt resolves the endpoint's name
once, judges the addresses, POSTs to the one judged, and reads at most a capped answer."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from shared.release import VERSION
from shared.ssrf import (
    LIFTED_BY_ALLOW_PRIVATE,
    AddressRefused,
    EndpointUrl,
    InvalidEndpointUrl,
    IPAddress,
    NameNotResolved,
    Refusal,
    Resolver,
    choose_address,
    connect_url,
    guarded_client,
    parse_endpoint_url,
    refused,
    resolve,
)

from .domain import AttemptError, AttemptResult

__all__ = [
    "LIFTED_BY_ALLOW_PRIVATE", "USER_AGENT", "AddressRefused", "AttemptReport", "EndpointUrl", "IPAddress",
    "InvalidEndpointUrl", "NameNotResolved", "Refusal", "Resolver", "attempt_delivery", "attempt_error",
    "choose_address", "connect_url", "delivery_client", "delivery_headers", "finish", "parse_endpoint_url",
    "read_capped", "refused", "resolve",
]

USER_AGENT = f"Weir-Webhooks/{VERSION}"


def delivery_headers(endpoint: EndpointUrl, headers: dict[str, str]) -> dict[str, str]:
    """The POST's headers: the caller's (the signature's), `Host` the endpoint's name (the connection goes to the
    address), no compression asked for (the cap counts the bytes on the wire: nothing to inflate)."""
    return {**headers, "Host": endpoint.host_header, "Content-Type": "application/json",
            "Accept-Encoding": "identity", "User-Agent": USER_AGENT}


@dataclass(frozen=True)
class AttemptReport:
    """One attempt: its result, the first bytes of the answer (at most the cap), the address it connected to."""

    result: AttemptResult
    body: bytes = b""
    address: str = ""
    seconds: float = 0.0


async def attempt_delivery(client: aiohttp.ClientSession, endpoint: EndpointUrl, body: bytes,
                           headers: dict[str, str], *, allow_private: bool, timeout: float, max_bytes: int,
                           resolver: Resolver = resolve) -> AttemptReport:
    """Resolve, judge, POST to the address judged (no second resolution that could answer differently), read at
    most `max_bytes` of the answer: all within `timeout` (per-read timeouts would let an endpoint that trickles bytes
    outlast them). For https the endpoint's name is the TLS server name (`server_hostname`), against which the
    certificate is also verified. No redirect followed."""
    started = time.monotonic()
    address = ""

    def report(result: AttemptResult, answer: bytes = b"") -> AttemptReport:
        return AttemptReport(result, answer, address, time.monotonic() - started)

    try:
        async with asyncio.timeout(timeout):
            chosen = choose_address(await resolver(endpoint.host, endpoint.port), allow_private)
            address = str(chosen)
            response = await client.post(
                connect_url(endpoint, chosen), data=body, headers=delivery_headers(endpoint, headers),
                allow_redirects=False,
                server_hostname=endpoint.host if endpoint.url.scheme == "https" else None)
            try:
                answer = await read_capped(response, max_bytes)
            except BaseException:
                response.close()  # cut off mid-answer (a timeout, a cancellation): the connection is not reused
                raise
            finish(response)
            return report(AttemptResult(status=response.status), answer)
    except TimeoutError:
        return report(AttemptResult(error=AttemptError.TIMEOUT))
    except AddressRefused as exc:
        address = str(exc.address)  # the log shows which address the name pointed at
        return report(AttemptResult(error=AttemptError.ADDRESS_REFUSED))
    except (NameNotResolved, aiohttp.ClientError, OSError) as exc:
        return report(AttemptResult(error=attempt_error(exc)))


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The answer's first `max_bytes` bytes, read until the cap or the end of the answer; the rest is never read."""
    kept = bytearray()
    while len(kept) < max_bytes:
        chunk = await response.content.read(max_bytes - len(kept))
        if not chunk:
            break
        kept += chunk
    return bytes(kept)


def finish(response: aiohttp.ClientResponse) -> None:
    """The connection back to the endpoint's pool when its answer was read to the end; closed when it was not (past
    the cap the rest would have to be read, or would arrive later, on a connection reused for the next attempt)."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


def attempt_error(exc: BaseException) -> AttemptError:
    """The delivery log's word for what stopped an attempt. aiohttp raises, on real sockets (tests/integration/
    test_webhook_sender.py): ClientConnectorError for a refused or failed connect, its ClientConnectorSSLError and
    ClientConnectorCertificateError for TLS; ClientOSError for a reset; ClientResponseError for an answer that is
    not HTTP or a malformed status line; ServerDisconnectedError for a close before the answer's end (headers), and
    ClientPayloadError for one in its body."""
    if isinstance(exc, AddressRefused):
        return AttemptError.ADDRESS_REFUSED
    if isinstance(exc, NameNotResolved):
        return AttemptError.DNS_FAILED
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return AttemptError.TIMEOUT
    if isinstance(exc, aiohttp.ClientResponseError | aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError
                  | HttpProcessingError):
        return AttemptError.PROTOCOL_ERROR
    return AttemptError.CONNECT_FAILED


def delivery_client(*, concurrency: int = 1, tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """The HTTP client of ONE endpoint (shared/ssrf.py `guarded_client` says why one each)."""
    return guarded_client(concurrency=concurrency, tls=tls)
