"""The delivery adapter of SPEC 13 (services/webhooks/ssrf.py) on real sockets: `attempt_delivery` with a real
`delivery_client` and the real resolver, against a real HTTP receiver (tests/webhookreceiver.py) on loopback.
What each answer, silence, trickle, closed port and unknown name becomes; what the SSRF guard refuses before any
connection is made, and what development lets through; and each delivery's signature, checked by the
`standardwebhooks` package and by hand; https against a certificate authority of the test's own (the TLS server name
and the certificate checked against the endpoint's name, not the address); and the exception aiohttp raises for each
failure, as the delivery log words it."""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import hmac
import ipaddress
import json
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import aiohttp
import httpx
import pytest
import trustme
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from services.webhooks.domain import AttemptError, AttemptResult, Outcome, judge_attempt
from services.webhooks.settings import WebhookSettings
from services.webhooks.signing import (
    ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    new_secret,
    secret_key,
    signed_headers,
)
from services.webhooks.ssrf import (
    USER_AGENT,
    AttemptReport,
    EndpointUrl,
    InvalidEndpointUrl,
    IPAddress,
    Resolver,
    attempt_delivery,
    connect_url,
    delivery_client,
    delivery_headers,
    parse_endpoint_url,
)
from shared.devstack.ports import free_port
from tests.waiting import wait_for
from tests.webhookreceiver import (
    Received,
    Status,
    WebhookReceiver,
    big,
    fail_then_ok,
    gone,
    hang,
    ok,
    raw,
    redirect,
    reset,
    status,
    trickle,
)

SETTINGS = WebhookSettings()
CAP = SETTINGS.webhook_response_max_bytes
FULL_TIMEOUT = SETTINGS.webhook_delivery_timeout_seconds
TIMEOUT = FULL_TIMEOUT / 20  # shrunk for the tests that wait for the timeout itself; the others keep the setting,
# so a loaded machine's stall cannot turn their answer into a timeout
WAIT = FULL_TIMEOUT  # the longest any wait for the receiver may take
SECRET = new_secret(SETTINGS.webhook_secret_bytes)


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as started:
        yield started


def envelope() -> tuple[str, bytes]:
    event_id = str(uuid.uuid4())
    return event_id, json.dumps({"id": event_id, "type": "video.ready", "data": {"video_id": "v1"}}).encode()


async def deliver(url: str | EndpointUrl, *, allow_private: bool = True, timeout: float = FULL_TIMEOUT,
                  secrets: tuple[str, ...] = (SECRET,), client: aiohttp.ClientSession | None = None,
                  max_bytes: int = CAP, resolver: Resolver | None = None,
                  ) -> tuple[AttemptReport, str, bytes]:
    """One signed attempt, with the real resolver unless `resolver`; its report, the event id and the body sent."""
    endpoint = url if isinstance(url, EndpointUrl) else parse_endpoint_url(url, allow_private=allow_private)
    event_id, body = envelope()
    headers = signed_headers(event_id, datetime.now(UTC), body, secrets)
    extra = {} if resolver is None else {"resolver": resolver}
    if client is not None:
        return await attempt_delivery(client, endpoint, body, headers, allow_private=allow_private, timeout=timeout,
                                      max_bytes=max_bytes, **extra), event_id, body
    async with delivery_client() as own:
        return await attempt_delivery(own, endpoint, body, headers, allow_private=allow_private, timeout=timeout,
                                      max_bytes=max_bytes, **extra), event_id, body


def fixed(*addresses: str) -> Resolver:
    """A name's addresses as a resolver would answer them (a name of the test's, on loopback)."""
    async def resolver(host: str, port: int) -> list[IPAddress]:
        return [ipaddress.ip_address(a) for a in addresses]
    return resolver


def hand_signatures(request: Received) -> list[str]:
    """The `webhook-signature` entries as Standard Webhooks defines them, computed here without the package."""
    signatures = []
    for entry in request.headers[SIGNATURE_HEADER].split(" "):
        version, _, signature = entry.partition(",")
        assert version == "v1"
        signatures.append(signature)
    return signatures


def hand_signature(secret: str, request: Received) -> str:
    signed = f"{request.headers[ID_HEADER]}.{request.headers[TIMESTAMP_HEADER]}.".encode() + request.body
    return base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode("ascii")


# ---------------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("code", [200, 202, 204])
async def test_a_2xx_is_delivered_signed_to_the_name_and_address_resolved(receiver: WebhookReceiver,
                                                                          code: int) -> None:
    receiver.route("/hook", status(code))
    url = receiver.url("/hook").replace(receiver.host, "localhost")
    report, event_id, body = await deliver(url)
    assert report.result == AttemptResult(status=code) and judge_attempt(report.result) is Outcome.DELIVERED
    assert report.address == receiver.host  # the real resolver's answer for localhost, connected to as resolved
    [request] = receiver.wait_requests(1, WAIT, "/hook")
    assert request.method == "POST" and request.body == body
    assert request.headers["host"] == f"localhost:{receiver.port}"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["user-agent"] == USER_AGENT
    assert request.headers["accept-encoding"] == "identity"
    assert request.headers[ID_HEADER] == event_id
    assert json.loads(body) == Webhook(SECRET).verify(request.body, request.headers)
    assert hand_signatures(request) == [hand_signature(SECRET, request)]


async def test_a_failing_endpoint_is_delivered_once_it_answers_2xx(receiver: WebhookReceiver) -> None:
    failures = 2
    flaky = receiver.route("/flaky", fail_then_ok(failures))
    endpoint = parse_endpoint_url(receiver.url("/flaky"), allow_private=True)
    event_id, body = envelope()
    statuses = []
    async with delivery_client() as client:
        for _ in range(failures + 1):  # the service's retries, without the waits between them
            headers = signed_headers(event_id, datetime.now(UTC), body, [SECRET])
            report = await attempt_delivery(client, endpoint, body, headers, allow_private=True,
                                            timeout=FULL_TIMEOUT, max_bytes=CAP)
            statuses.append(report.result.status)
    assert statuses == [flaky.fail_code] * failures + [flaky.ok_code]
    requests = receiver.wait_requests(failures + 1, WAIT, "/flaky")
    assert {r.headers[ID_HEADER] for r in requests} == {event_id}  # a retry is the same delivery to the receiver
    assert [r.monotonic for r in requests] == sorted(r.monotonic for r in requests)
    assert len({r.connection for r in requests}) == 1  # a 500 does not cost the connection
    for request in requests:
        Webhook(SECRET).verify(request.body, request.headers)


async def test_410_says_the_endpoint_is_gone(receiver: WebhookReceiver) -> None:
    receiver.route("/gone", gone())
    report, _, _ = await deliver(receiver.url("/gone"))
    assert report.result == AttemptResult(status=410) and judge_attempt(report.result) is Outcome.GONE


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
async def test_a_redirect_is_reported_and_not_followed(receiver: WebhookReceiver, code: int) -> None:
    moved = receiver.route("/moved", redirect("/elsewhere", code))
    receiver.route("/elsewhere", ok())
    report, _, _ = await deliver(receiver.url("/moved"))
    assert report.result == AttemptResult(status=code) and judge_attempt(report.result) is Outcome.FAILED
    assert moved.served == 1 and receiver.count("/elsewhere") == 0


async def test_an_answer_over_the_cap_is_read_up_to_the_cap_only(receiver: WebhookReceiver) -> None:
    huge = receiver.route("/big", big(CAP * 256))  # far more than the loopback's socket buffers hold
    report, _, _ = await deliver(receiver.url("/big"))
    assert report.result == AttemptResult(status=200)
    assert len(report.body) == CAP and set(report.body) == {ord("x")}
    await wait_for(lambda: receiver.connections_open, WAIT, "the connection closed by the sender",
                   until=lambda n: n == 0)
    assert huge.sent < huge.size  # the rest was never read: the sender closed the connection


async def test_a_hanging_endpoint_times_out_within_the_timeout_and_the_client_still_delivers(
        receiver: WebhookReceiver) -> None:
    receiver.route("/hang", hang())
    receiver.route("/ok", ok())
    async with delivery_client() as client:  # one connection, as for one endpoint
        started = time.monotonic()
        report, _, _ = await deliver(receiver.url("/hang"), client=client, timeout=TIMEOUT)
        elapsed = time.monotonic() - started
        assert report.result == AttemptResult(error=AttemptError.TIMEOUT)
        assert TIMEOUT <= elapsed < 2 * TIMEOUT and report.seconds < 2 * TIMEOUT
        assert len(receiver.wait_requests(1, WAIT, "/hang")) == 1  # the answer never came, not the connection
        after, _, _ = await deliver(receiver.url("/ok"), client=client)  # the timed-out connection was let go
    assert after.result == AttemptResult(status=ok().code)
    await wait_for(lambda: receiver.connections_open, WAIT, "the hanging connection closed by the sender",
                   until=lambda n: n == 0)


async def test_an_endpoint_that_trickles_is_cut_off_by_the_whole_attempts_timeout(
        receiver: WebhookReceiver) -> None:
    interval = TIMEOUT / 10  # each byte well within any per-read timeout
    slow = receiver.route("/trickle", trickle(interval))
    report, _, _ = await deliver(receiver.url("/trickle"), timeout=TIMEOUT)
    assert report.result == AttemptResult(error=AttemptError.TIMEOUT)
    assert TIMEOUT <= report.seconds < 2 * TIMEOUT
    assert slow.sent > 1 and slow.sent < slow.size  # bytes kept coming: only the whole attempt's limit stopped it


async def test_a_short_answer_is_kept_whole_and_a_zero_cap_keeps_nothing(receiver: WebhookReceiver) -> None:
    receiver.route("/boom", status(500, b"boom"))
    receiver.route("/ok", status(200, b"ok"))
    report, _, _ = await deliver(receiver.url("/boom"))
    assert report.result == AttemptResult(status=500) and report.body == b"boom"
    report, _, _ = await deliver(receiver.url("/ok"), max_bytes=0)
    assert report.result == AttemptResult(status=200) and report.body == b""


async def test_a_compressed_answer_is_kept_as_sent(receiver: WebhookReceiver) -> None:
    packed = gzip.compress(b"{}" * 1000)
    receiver.route("/gz", Status(200, packed, {"content-encoding": "gzip"}))
    report, _, _ = await deliver(receiver.url("/gz"))
    assert report.result == AttemptResult(status=200) and report.body == packed[:CAP]


@pytest.mark.parametrize(("answer", "aiohttp_raises"), [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "ClientResponseError"),  # not HTTP
    (b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n", "ClientResponseError"),  # a malformed status line
    (b"HTTP/1.1 200 OK\r\ncontent-le", "ServerDisconnectedError"),  # closed within the headers
    (b"", "ServerDisconnectedError"),  # closed without a byte
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc", "ClientPayloadError"),  # closed within the body
])
async def test_an_answer_that_is_not_http_or_cut_short_is_a_protocol_error(
        receiver: WebhookReceiver, answer: bytes, aiohttp_raises: str) -> None:
    receiver.route("/garbage", raw(answer))
    report, _, _ = await deliver(receiver.url("/garbage"))
    assert report.result == AttemptResult(error=AttemptError.PROTOCOL_ERROR)
    assert await raised(receiver.url("/garbage")) == aiohttp_raises  # what attempt_error words so


async def raised(url: str, client: aiohttp.ClientSession | None = None) -> str:
    """The name of the exception aiohttp raises for one POST to `url` (as the adapter sends it), or "" for none."""
    endpoint = parse_endpoint_url(url, allow_private=True)
    address = ipaddress.ip_address("127.0.0.1")
    async with delivery_client() if client is None else contextlib.nullcontext(client) as session:
        try:
            async with session.post(connect_url(endpoint, address), data=b"{}", allow_redirects=False,
                                    headers=delivery_headers(endpoint, {}),
                                    server_hostname=endpoint.host if url.startswith("https:") else None) as answer:
                await answer.read()
        except aiohttp.ClientError as exc:
            return type(exc).__name__
    return ""


async def test_a_reset_connection_is_a_failed_connection(receiver: WebhookReceiver) -> None:
    receiver.route("/reset", reset())
    report, _, _ = await deliver(receiver.url("/reset"))
    assert report.result == AttemptResult(error=AttemptError.CONNECT_FAILED)
    assert await raised(receiver.url("/reset")) == "ClientOSError"


async def test_no_cookie_is_sent_back_and_no_proxy_is_taken_from_the_environment(
        receiver: WebhookReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    receiver.route("/hook", Status(200, headers={"set-cookie": "session=abc; Path=/"}))
    async with delivery_client() as client:
        for _ in range(2):
            report, _, _ = await deliver(receiver.url("/hook"), client=client)
            assert report.result == AttemptResult(status=200)
    requests = receiver.wait_requests(2, WAIT, "/hook")
    assert all("cookie" not in r.headers for r in requests)


async def test_an_endpoint_that_drops_its_idle_connection_gets_the_next_attempt_on_a_new_one(
        receiver: WebhookReceiver) -> None:
    answered = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"  # then closed, without `connection: close`
    receiver.route("/drops", raw(answered))
    async with delivery_client() as client:
        first, _, _ = await deliver(receiver.url("/drops"), client=client)
        await wait_for(lambda: receiver.connections_open, WAIT, "the endpoint's close", until=lambda n: n == 0)
        second, _, _ = await deliver(receiver.url("/drops"), client=client)
    assert first.result == second.result == AttemptResult(status=httpx.codes.OK)
    assert [r.connection for r in receiver.requests("/drops")] == [1, 2]


async def test_a_closed_port_is_a_failed_connection() -> None:
    port = free_port()
    report, _, _ = await deliver(f"http://127.0.0.1:{port}/hook")
    assert report.result == AttemptResult(error=AttemptError.CONNECT_FAILED) and report.address == "127.0.0.1"


@pytest.mark.parametrize("url", ["https://no-such-endpoint.invalid/hook", "http://no-such-endpoint.invalid:8080/"])
async def test_a_name_that_does_not_resolve_is_a_dns_failure(url: str) -> None:
    report, _, _ = await deliver(url, allow_private=url.startswith("http:"))
    assert report.result == AttemptResult(error=AttemptError.DNS_FAILED) and report.address == ""


# ------------------------------------------------------------------------------------------------- the SSRF guard


def literal_endpoint(host: str, port: int) -> EndpointUrl:
    """An http EndpointUrl made without `parse_endpoint_url` (which refuses it): what the adapter must refuse on
    its own, should such a URL ever reach it (an older row, a bug upstream)."""
    bracketed = f"[{host}]" if ":" in host else host
    return EndpointUrl(url=httpx.URL(f"http://{bracketed}:{port}/hook"), host=host, port=port)


async def test_a_name_on_loopback_is_refused_before_any_connection(receiver: WebhookReceiver) -> None:
    receiver.route("/hook", ok())
    https = f"https://localhost:{receiver.port}/hook"  # https passes the URL rules: the resolver's answer decides
    plain = EndpointUrl(url=httpx.URL(f"http://localhost:{receiver.port}/hook"), host="localhost", port=receiver.port)
    for endpoint in (parse_endpoint_url(https, allow_private=False), plain):
        report, _, _ = await deliver(endpoint, allow_private=False)
        assert report.result == AttemptResult(error=AttemptError.ADDRESS_REFUSED)
        assert report.address in {"127.0.0.1", "::1"}
    assert receiver.connections_opened == 0 and receiver.count() == 0


async def test_development_delivers_to_a_name_on_loopback(receiver: WebhookReceiver) -> None:
    receiver.route("/hook", ok())
    report, event_id, _ = await deliver(f"http://localhost:{receiver.port}/hook", allow_private=True)
    assert report.result == AttemptResult(status=ok().code)
    [request] = receiver.wait_requests(1, WAIT, "/hook")
    assert request.headers[ID_HEADER] == event_id


LITERALS = ["127.0.0.1", "::1", "::ffff:127.0.0.1"]


@pytest.mark.parametrize("host", LITERALS)
def test_a_loopback_literal_is_refused_by_the_url_rules(host: str) -> None:
    bracketed = f"[{host}]" if ":" in host else host
    port = free_port()
    with pytest.raises(InvalidEndpointUrl) as plain:
        parse_endpoint_url(f"http://{bracketed}:{port}/", allow_private=False)
    assert plain.value.reason == "scheme"  # plain http is refused first, outside development
    with pytest.raises(InvalidEndpointUrl) as secure:
        parse_endpoint_url(f"https://{bracketed}:{port}/", allow_private=False)
    assert secure.value.reason == "address"
    assert parse_endpoint_url(f"http://{bracketed}:{port}/", allow_private=True).port == port  # development


@pytest.mark.parametrize("host", [pytest.param(h, marks=needs_ipv6) if h == "::1" else h for h in LITERALS])
async def test_the_adapter_refuses_a_loopback_literal_that_got_past_the_url_rules(host: str) -> None:
    listen = "::1" if host == "::1" else "127.0.0.1"
    with WebhookReceiver({"/hook": ok()}, host=listen) as target:
        report, _, _ = await deliver(literal_endpoint(host, target.port), allow_private=False)
        assert report.result == AttemptResult(error=AttemptError.ADDRESS_REFUSED)
        assert target.connections_opened == 0
        developed, _, _ = await deliver(literal_endpoint(host, target.port), allow_private=True)
        assert developed.result == AttemptResult(status=ok().code)  # the address does reach the receiver
        assert target.count("/hook") == 1


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001", "017700000001", "0x7f.1"])
async def test_a_loopback_address_spelt_as_a_name_is_refused_when_resolved(receiver: WebhookReceiver,
                                                                           host: str) -> None:
    """httpx does not read these as IPv4, getaddrinfo reads them as 127.0.0.1: the URL rules refuse them (a host
    ending in a number), and the adapter, should one reach it, refuses what they resolve to."""
    receiver.route("/hook", ok())
    with pytest.raises(InvalidEndpointUrl) as refused:
        parse_endpoint_url(f"https://{host}:{receiver.port}/hook", allow_private=True)
    assert refused.value.reason == "host"
    endpoint = EndpointUrl(url=httpx.URL(f"https://{host}:{receiver.port}/hook"), host=host, port=receiver.port)
    report, _, _ = await deliver(endpoint, allow_private=False)
    assert report.result == AttemptResult(error=AttemptError.ADDRESS_REFUSED) and report.address == receiver.host
    assert receiver.connections_opened == 0


async def test_the_unspecified_address_is_refused_even_in_development(receiver: WebhookReceiver) -> None:
    """0.0.0.0 (here spelt `0`, a name to the URL rules) connects to the host itself on Linux."""
    receiver.route("/hook", ok())
    report, _, _ = await deliver(literal_endpoint("0", receiver.port), allow_private=True)
    assert report.result == AttemptResult(error=AttemptError.ADDRESS_REFUSED) and report.address == "0.0.0.0"
    assert receiver.connections_opened == 0


@pytest.mark.parametrize("addresses", [("127.0.0.1",), ("::1",), ("::ffff:127.0.0.1",), ("93.184.215.14", "10.1.2.3"),
                                       ("169.254.169.254",), ("127.0.0.1", "93.184.215.14")])
async def test_a_name_that_resolves_to_a_refused_address_is_never_connected_to(
        receiver: WebhookReceiver, addresses: tuple[str, ...]) -> None:
    receiver.route("/hook", ok())
    endpoint = parse_endpoint_url(f"https://hooks.weir.test:{receiver.port}/hook", allow_private=False)
    report, _, _ = await deliver(endpoint, allow_private=False, resolver=fixed(*addresses))
    assert report.result == AttemptResult(error=AttemptError.ADDRESS_REFUSED)
    refused_ = ipaddress.ip_address(report.address)
    assert refused_ in {ipaddress.ip_address(a) for a in addresses}
    assert str(refused_) != "93.184.215.14"  # the log shows the refused one
    assert receiver.connections_opened == 0


# ------------------------------------------------------------------------------------------------------ https

NAME = "hooks.weir.test"


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA(organization_name="weir webhooks test")


def client_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@contextlib.contextmanager
def https_receiver(ca: trustme.CA, *names: str) -> Iterator[tuple[WebhookReceiver, list[str | None]]]:
    """A receiver answering https only, with a certificate for `names` (and not for its address); the TLS server
    names the senders asked for."""
    asked: list[str | None] = []
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(server)
    server.sni_callback = lambda _conn, name, _ctx: asked.append(name)  # type: ignore[assignment]
    with WebhookReceiver({"/hook": ok()}, tls=server) as started:
        yield started, asked


async def test_https_connects_to_the_address_and_verifies_the_certificate_against_the_name(
        authority: trustme.CA) -> None:
    with https_receiver(authority, NAME) as (target, asked):
        endpoint = parse_endpoint_url(f"https://{NAME}:{target.port}/hook", allow_private=True)
        async with delivery_client(tls=client_tls(authority)) as client:
            report, event_id, _ = await deliver(endpoint, client=client, resolver=fixed("127.0.0.1"))
        assert report.result == AttemptResult(status=ok().code) and report.address == "127.0.0.1"
        [request] = target.wait_requests(1, WAIT, "/hook")
        assert request.headers["host"] == f"{NAME}:{target.port}" and request.headers[ID_HEADER] == event_id
        assert asked == [NAME]  # the certificate names no address: only the name's check can have passed


async def test_https_to_a_certificate_for_another_name_is_a_failed_connection(authority: trustme.CA) -> None:
    with https_receiver(authority, "other.weir.test", "127.0.0.1") as (target, asked):
        endpoint = parse_endpoint_url(f"https://{NAME}:{target.port}/hook", allow_private=True)
        async with delivery_client(tls=client_tls(authority)) as client:
            report, _, _ = await deliver(endpoint, client=client, resolver=fixed("127.0.0.1"))
            assert report.result == AttemptResult(error=AttemptError.CONNECT_FAILED)
            assert await raised(str(endpoint.url), client) == "ClientConnectorCertificateError"
        assert asked == [NAME, NAME] and target.count() == 0


async def test_https_to_an_http_endpoint_is_a_failed_connection(receiver: WebhookReceiver) -> None:
    receiver.route("/hook", ok())
    url = receiver.url("/hook").replace("http:", "https:")
    report, _, _ = await deliver(url)
    assert report.result == AttemptResult(error=AttemptError.CONNECT_FAILED)
    assert await raised(url) in {"ClientConnectorError", "ClientConnectorSSLError"}
    assert receiver.count() == 0


# ------------------------------------------------------------------------------------------------- signatures


async def test_during_a_rotation_each_secret_verifies_the_delivery(receiver: WebhookReceiver) -> None:
    receiver.route("/hook", ok())
    new, old, stranger = (new_secret(SETTINGS.webhook_secret_bytes) for _ in range(3))
    report, _, body = await deliver(receiver.url("/hook"), secrets=(new, old))
    assert report.result == AttemptResult(status=ok().code)
    [request] = receiver.wait_requests(1, WAIT, "/hook")
    for secret in (new, old):
        assert Webhook(secret).verify(request.body, request.headers) == json.loads(body)
    assert hand_signatures(request) == [hand_signature(new, request), hand_signature(old, request)]  # new first
    with pytest.raises(WebhookVerificationError):
        Webhook(stranger).verify(request.body, request.headers)
    with pytest.raises(WebhookVerificationError):  # the signature covers the body
        Webhook(new).verify(request.body + b" ", request.headers)
