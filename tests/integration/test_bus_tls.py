"""TLS on the bus: a nats-server that speaks TLS only and requires a client certificate (`verify: true`), with Weir's
generated NKEY authorization, its certificate authority and certificates made at test time (trustme). Every kind of
Weir connection goes through it with WEIR_NATS_TLS_CA/CERT/KEY (shared/natsconn.py): a service's broker, a tool's
broker (`weir streams apply`), `shared.bus.connect`, and a real service process; and what cannot work fails at once
with the reason: no CA to verify the server by, a client certificate from another CA, none at all, TLS files that are
not what their settings say, and (with `require_tls`) a server that does not offer TLS at all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from faststream.nats import NatsBroker

from shared.bus import connect, subscriptions_in_place
from shared.messaging import make_broker, tool_broker
from shared.metrics import Metrics
from shared.natsconn import (
    BusConfigError,
    ConnectionRefused,
    ConnectionWatch,
    _tls_failure,
    connect_options,
    request,
    require_tls,
    tls_in_use,
    tls_probe,
)
from shared.settings import CommonSettings
from shared.streams import STREAMS, apply_streams
from tests.integration.apihelpers import run_services
from tests.integration.identityhelpers import IdentityServer, identity_server
from tests.integration.privatenats import wait_until_up
from tests.integration.tlshelpers import TlsServer, authority, tls_server

pytestmark = pytest.mark.timeout(120)
SLOW_REFUSAL = 20.0  # a refusal that may need a few handshakes to be told from a cut connection (see its test)
FAST = 3.0  # what "fails at once" means here: far below any connect timeout or retry loop


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    with tls_server(tmp_path_factory.mktemp("bus-tls")) as started:
        yield started


@pytest.fixture(scope="module")
async def ready(server: TlsServer) -> TlsServer:
    await wait_until_up(server.url, **server.client_options("operator"))
    return server


@contextlib.asynccontextmanager
async def connected_broker(settings: CommonSettings, name: str,
                           **kwargs: Any) -> AsyncIterator[tuple[NatsBroker, ConnectionWatch]]:
    """A service's broker (shared/messaging.py) as the service connects it: through its ConnectionWatch."""
    watch = ConnectionWatch(name, Metrics(name))
    broker = make_broker(settings, name=name, watch=watch, **kwargs)
    try:
        await watch.connected(broker.connect())
        yield broker, watch
    finally:
        await broker.stop()


async def refusal(settings: CommonSettings, name: str = "media") -> tuple[str, float]:
    """What refusing the connection says, and how long it took."""
    watch = ConnectionWatch(name, Metrics(name))
    broker = make_broker(settings, name=name, watch=watch)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionRefused) as refused:
            await asyncio.wait_for(watch.connected(broker.connect()), 30)
    finally:
        await broker.stop()
    return str(refused.value), time.monotonic() - started


def is_tls(broker: NatsBroker) -> bool:
    """The connection's socket is a TLS one."""
    return tls_in_use(broker.connection)


# ------------------------------------------------------------------------------------------------ what works


async def test_a_service_broker_connects_over_tls_and_a_request_is_answered(ready: TlsServer) -> None:
    async with connected_broker(ready.settings("auth"), "auth") as (auth, _), \
            connected_broker(ready.settings("api"), "api") as (api, watch):

        @auth.subscriber("auth.check", queue="auth")
        async def answer(body: dict[str, int]) -> dict[str, object]:
            return {"allowed": True, "asked": body["n"]}

        await auth.start()
        await subscriptions_in_place(auth.connection)  # before api's request, on another connection
        assert is_tls(auth) and is_tls(api)
        reply = await request(watch, api.connection, "auth.check", b'{"n":1}', timeout=5)
        assert json.loads(reply.data) == {"allowed": True, "asked": 1}
        assert reply.subject.startswith("_INBOX.api.")  # on api's own inbox, over TLS
        answered = await api.request({"n": 2}, "auth.check", timeout=5)  # FastStream's own request, the same way
        assert await answered.decode() == {"allowed": True, "asked": 2}
        assert watch.last_violation == {}
        require_tls(ready.settings("api"), api.connection)  # nothing to object to


async def test_a_tool_broker_applies_the_streams_over_tls(ready: TlsServer) -> None:
    """`weir streams apply`: the CLI's broker (tool_broker), as `operator`, over TLS with its client certificate."""
    settings = ready.settings("operator")
    async with tool_broker(settings, "cli") as broker:
        assert is_tls(broker)
        done = await apply_streams(broker.connection.jetstream(), settings)
    assert sorted(line.split()[1] for line in done) == sorted(spec.name for spec in STREAMS)
    async with tool_broker(settings, "cli", fail_fast=True) as broker:
        info = await broker.connection.jetstream().stream_info(STREAMS[0].name)
        assert info.config.name == STREAMS[0].name


async def test_shared_bus_connect_works_over_tls(ready: TlsServer) -> None:
    nc = await connect(ready.settings("media"), name="media")
    try:
        assert nc.is_connected
        assert nc.new_inbox().startswith("_INBOX.media.")
        await nc.jetstream().account_info()  # media's /readyz question, answered over TLS
    finally:
        await nc.close()


async def test_a_service_process_is_ready_over_tls(ready: TlsServer, stack_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """`python -m services.media` with its seed and WEIR_NATS_TLS_CA/CERT/KEY: /readyz answers 200 (its NATS check
    asks JetStream over the TLS connection)."""
    env = {**stack_env, "WEIR_NATS_NKEY_SEED_DIR": "", **ready.env("media")}
    with run_services(env, tmp_path, names=("media",)) as services:
        async with httpx.AsyncClient(timeout=5) as http:
            answer = await http.get(f"{services.urls['media']}/readyz")
        assert answer.status_code == 200, answer.text
        assert answer.json()["checks"] == {"nats": "ok", "database": "ok", "storage": "ok"}


# ------------------------------------------------------------------------------------------------ what does not


async def test_without_the_ca_the_connection_fails_at_once_and_says_why(ready: TlsServer) -> None:
    """No WEIR_NATS_TLS_CA: nats-py tries the system's authorities, which do not know the test's CA. A service would
    otherwise retry for ever; it is refused at once, naming the setting."""
    text, took = await refusal(ready.settings("media", ca=False))
    assert "certificate is not trusted" in text and "WEIR_NATS_TLS_CA" in text, text
    assert took < FAST
    # the CLI's broker the same way (it would otherwise wait for ever too)
    started = time.monotonic()
    with pytest.raises(ConnectionRefused, match="WEIR_NATS_TLS_CA"):
        async with tool_broker(ready.settings("operator", ca=False), "cli"):
            pass
    assert time.monotonic() - started < FAST


async def test_a_client_certificate_from_another_ca_is_refused(ready: TlsServer, tmp_path: Path) -> None:
    other = authority(tmp_path, "other")
    intruder = other.issue(tmp_path, "intruder", "weir-client")
    text, took = await refusal(ready.settings("media", client=intruder))
    assert "refused this client's TLS certificate" in text and "WEIR_NATS_TLS_CERT" in text, text
    # the server's alert races its close: a handshake that saw only the close (EOF, as a cut connection would) is
    # tried again, 0.5 s later, until one reads the alert; on a loaded machine that took up to ~10 s
    assert took < SLOW_REFUSAL
    deadline = time.monotonic() + 5
    while "certificate signed by unknown authority" not in ready.log_text():  # and the server says why
        assert time.monotonic() < deadline, ready.log_text()[-2000:]
        await asyncio.sleep(0.05)


async def test_the_probe_reads_the_servers_verdict_on_a_certificate(ready: TlsServer, tmp_path: Path) -> None:
    """A handshake that only reads is never reset ahead of the server's alert: it hears the verdict every time."""
    intruder = authority(tmp_path, "other").issue(tmp_path, "intruder", "weir-client")
    refused = ready.settings("media", client=intruder)
    unsent = ready.settings("media").model_copy(update={"nats_tls_cert": "", "nats_tls_key": ""})
    for settings, wanted in ((refused, "refused this client's TLS certificate"),
                             (unsent, "asks for a client certificate")):
        probe = tls_probe(settings, settings.nats_url)
        assert probe is not None
        for _ in range(3):
            said = await probe()
            assert said is not None and wanted in (_tls_failure(said) or ""), said
    good = tls_probe(ready.settings("media"), ready.settings("media").nats_url, timeout=0.5)
    assert good is not None and await good() is None  # accepted: the server waits for CONNECT
    assert tls_probe(ready.settings("media").model_copy(update={"nats_tls_ca": "", "nats_tls_cert": "",
                                                                "nats_tls_key": ""}), "nats://127.0.0.1:1") is None


async def test_a_connection_cut_before_the_first_one_is_diagnosed_by_the_probe(ready: TlsServer,
                                                                              tmp_path: Path) -> None:
    """What the watch does when the server's reset overtook its alert (here: nats-py saw only a reset)."""
    intruder = authority(tmp_path, "other").issue(tmp_path, "intruder", "weir-client")
    settings = ready.settings("media", client=intruder)
    watch = ConnectionWatch("media", Metrics("media"), probe=tls_probe(settings, settings.nats_url))
    await watch.error_cb(ConnectionResetError(104, "Connection reset by peer"))
    await asyncio.wait_for(watch.refused.wait(), FAST)
    assert "refused this client's TLS certificate" in watch.reason and "WEIR_NATS_TLS_CERT" in watch.reason

    quiet = ConnectionWatch("media", Metrics("media"), probe=tls_probe(ready.settings("media"), settings.nats_url,
                                                                   timeout=0.5))
    await quiet.error_cb(ConnectionResetError(104, "Connection reset by peer"))
    probing = quiet._probing
    assert probing is not None
    await probing
    assert not quiet.refused.is_set()  # a good certificate: a cut connection is only a cut connection


async def test_no_client_certificate_is_refused(ready: TlsServer) -> None:
    settings = ready.settings("media").model_copy(update={"nats_tls_cert": "", "nats_tls_key": ""})
    text, took = await refusal(settings)
    assert "asks for a client certificate" in text and "WEIR_NATS_TLS_CERT" in text, text
    assert took < SLOW_REFUSAL  # the server's alert races its close, as for another CA's certificate below


async def test_the_right_certificate_with_an_unknown_seed_is_still_refused(ready: TlsServer, tmp_path: Path) -> None:
    """TLS is not authentication of an identity: the seed still decides who connects."""
    from shared.natsauth import new_seed

    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(new_seed())
    text, took = await refusal(ready.settings("media", nats_nkey_seed=str(stranger)))
    assert "authorization violation" in text, text
    assert took < FAST


def encrypted_copy(key: Path, to: Path) -> Path:
    from cryptography.hazmat.primitives import serialization

    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    to.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"passphrase")))
    return to


def test_tls_files_that_are_not_what_their_settings_say_stop_the_process_at_once(server: TlsServer,
                                                                                  tmp_path: Path) -> None:
    """Each is a BusConfigError naming its setting (shared/runtime.py main() exits 3 with it), before any connect:
    not ssl's own error out of nats-py, and not a passphrase prompt a service would hang on."""
    other = authority(tmp_path, "other").issue(tmp_path, "other", "weir-client")
    cases = {
        "WEIR_NATS_TLS_CA": {"nats_tls_ca": str(server.client.key)},  # a key, not a certificate
        "WEIR_NATS_TLS_CERT and WEIR_NATS_TLS_KEY": {"nats_tls_key": str(other.key)},  # another certificate's key
        "encrypted key": {"nats_tls_key": str(encrypted_copy(server.client.key, tmp_path / "encrypted.key"))},
        "WEIR_NATS_TLS_CERT/KEY need WEIR_NATS_TLS_CA": {"nats_tls_ca": ""},
        "both WEIR_NATS_TLS_CERT and WEIR_NATS_TLS_KEY": {"nats_tls_key": ""},
        "WEIR_NATS_TLS_KEY names": {"nats_tls_key": str(tmp_path / "missing.key")},
    }
    for says, change in cases.items():
        settings = server.settings("media").model_copy(update=change)
        with pytest.raises(BusConfigError, match=re.escape(says)):
            make_broker(settings, name="media")
        with pytest.raises(BusConfigError, match=re.escape(says)):
            connect_options(settings, "media")


@pytest.fixture(scope="module")
async def plain(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[IdentityServer]:
    """A server with the identities but without TLS."""
    with identity_server(tmp_path_factory.mktemp("bus-plain")) as started:
        await wait_until_up(started.url, **started.client_options("operator"))
        yield started


def tls_settings_for(server: TlsServer, plain: IdentityServer, name: str) -> CommonSettings:
    """`name`'s TLS settings (CA, client certificate) and its seed, pointed at the server without TLS."""
    return server.settings(name).model_copy(update={"nats_url": plain.url, "nats_nkey_seed": str(plain.seeds[name])})


async def test_with_the_ca_set_a_server_without_tls_is_not_talked_to_in_plaintext(server: TlsServer,
                                                                                   plain: IdentityServer) -> None:
    """nats-py starts TLS only when the server's INFO asks for it: with WEIR_NATS_TLS_CA set and a server that does
    not, it connects in plaintext without a word. `require_tls` is the check that refuses that."""
    settings = tls_settings_for(server, plain, "media")
    nc = await nats.connect(servers=[settings.nats_url], **connect_options(settings, "media"))
    try:
        assert not tls_in_use(nc)  # what nats-py does on its own
        with pytest.raises(BusConfigError, match=r"WEIR_NATS_TLS_CA is set, but the NATS server at .* did not offer"):
            require_tls(settings, nc)
    finally:
        await nc.close()
    with pytest.raises(BusConfigError, match="did not offer TLS"):  # and Weir's own connect makes that check
        await connect(settings, name="media")


async def test_a_tool_with_the_ca_set_refuses_a_server_without_tls(server: TlsServer, plain: IdentityServer) -> None:
    with pytest.raises(BusConfigError, match="did not offer TLS"):
        async with tool_broker(tls_settings_for(server, plain, "operator"), "cli"):
            pass
