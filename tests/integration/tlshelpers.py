"""A nats-server with TLS (client certificates required) and Weir's generated NKEY authorization, its certificate
authority and certificates made at test time (trustme), and the settings a Weir process connects to it with."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trustme

from shared.identities import IDENTITIES
from shared.natsauth import authorization_config, ensure_seeds, public_keys
from shared.settings import CommonSettings
from tests.integration.identityhelpers import IdentityServer
from tests.integration.privatenats import PrivateNats

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Pem:
    """A certificate and its key as files (what WEIR_NATS_TLS_CERT/KEY name)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A certificate authority of the test's own: its certificate file, and certificates it issued."""

    ca: trustme.CA
    ca_file: Path

    def issue(self, directory: Path, name: str, *identities: str) -> Pem:
        issued = self.ca.issue_cert(*(identities or (name,)))
        pem = Pem(directory / f"{name}.crt", directory / f"{name}.key")
        issued.cert_chain_pems[0].write_to_path(str(pem.cert))
        issued.private_key_pem.write_to_path(str(pem.key))
        pem.key.chmod(0o600)
        return pem


def authority(directory: Path, name: str) -> Authority:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name=f"weir test {name}")
    ca_file = directory / f"{name}-ca.crt"
    ca.cert_pem.write_to_path(str(ca_file))
    return Authority(ca, ca_file)


@dataclass
class TlsServer(IdentityServer):
    """An IdentityServer that speaks TLS only and requires a client certificate from `ca`."""

    ca: Authority
    server_pem: Pem
    client: Pem  # a client certificate the server accepts (issued by `ca`)
    certs: Path  # where the certificates are (a test may issue more)

    def settings(self, name: str, *, ca: bool = True, client: Pem | None = None, seed: bool = True,
                 **more: object) -> CommonSettings:
        """The settings of a process connecting as `name` (its seed, the CA, the client certificate)."""
        pem = client or self.client
        values: dict[str, object] = {
            "nats_url": self.url, "stream_replicas": 1, "nats_identity": name,
            "nats_nkey_seed": str(self.seeds[name]) if seed else "",
            "nats_tls_ca": str(self.ca.ca_file) if ca else "",
            "nats_tls_cert": str(pem.cert) if ca else "", "nats_tls_key": str(pem.key) if ca else "",
        }
        return CommonSettings(**(values | more))  # type: ignore[arg-type]

    def env(self, name: str) -> dict[str, str]:
        """The same as WEIR_* variables, for a process of its own."""
        return {
            "WEIR_NATS_URL": self.url, "WEIR_NATS_NKEY_SEED": str(self.seeds[name]), "WEIR_NATS_IDENTITY": name,
            "WEIR_NATS_TLS_CA": str(self.ca.ca_file), "WEIR_NATS_TLS_CERT": str(self.client.cert),
            "WEIR_NATS_TLS_KEY": str(self.client.key),
        }

    def transport_options(self) -> dict[str, object]:
        return {"tls": self.context()}

    def context(self, client: Pem | None = None) -> ssl.SSLContext:
        """A plain nats-py client's TLS: the server verified by the CA, with a client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca.ca_file))
        pem = client or self.client
        context.load_cert_chain(str(pem.cert), str(pem.key))
        return context


def tls_config(server_pem: Pem, ca_file: Path) -> str:
    return "\n".join([
        "# TLS only; every client shows a certificate issued by the test's CA",
        "tls {",
        f'  cert_file: "{server_pem.cert}"',
        f'  key_file: "{server_pem.key}"',
        f'  ca_file: "{ca_file}"',
        "  verify: true",
        "  timeout: 2",
        "}",
        "",
    ])


@contextlib.contextmanager
def tls_server(tmp: Path) -> Iterator[TlsServer]:
    """A CA, the server's certificate for 127.0.0.1 and a client certificate (all made now), the identities' seeds
    and the generated authorization, and nats-server started on them; stopped by its own pid on exit."""
    certs = tmp / "certs"
    ca = authority(certs, "weir")
    server_pem = ca.issue(certs, "server", HOST)
    client = ca.issue(certs, "client", "weir-client")
    seeds = ensure_seeds(tmp / "nats", list(IDENTITIES))
    config = tmp / "nats-server.conf"
    config.write_text(tls_config(server_pem, ca.ca_file) + authorization_config(public_keys(seeds)))
    log = tmp / "nats-server.log"
    server = PrivateNats(tmp / "data", "-c", str(config), "-l", str(log))
    server.start()
    try:
        yield TlsServer(server=server, seeds=seeds, config=config, log=log, ca=ca, server_pem=server_pem,
                        client=client, certs=certs)
    finally:
        server.stop()
