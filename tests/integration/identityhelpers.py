"""A private nats-server with Weir's generated authorization (every identity's NKEY, its permissions), and clients that
connect as one identity and record the permission violations the server reports to them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

from shared.identities import IDENTITIES, Identity, connect_options
from shared.natsauth import authorization_config, ensure_seeds, public_keys
from shared.settings import CommonSettings
from shared.streams import apply_streams
from tests.integration.privatenats import PrivateNats, wait_until_up


@dataclass
class IdentityServer:
    """A started nats-server (JetStream on) whose only users are the identities, each with its seed file."""

    server: PrivateNats
    seeds: dict[str, Path]
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return self.server.url

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def client_options(self, name: str) -> dict[str, object]:
        """nats.connect's options for a plain client connecting as the identity `name` (its seed, its inbox)."""
        return {**connect_options(name, str(self.seeds[name])), **self.transport_options()}

    def transport_options(self) -> dict[str, object]:
        """What a client needs beyond its identity to reach this server (none here; TLS for a TlsServer)."""
        return {}


@contextlib.contextmanager
def identity_server(tmp: Path, extra: Iterable[Identity] = ()) -> Iterator[IdentityServer]:
    """Seeds under `tmp/nats` (as `weir up` makes them under .weir/nats), the configuration from the declaration
    (plus `extra` identities), and the server started on it; stopped by its own pid on exit."""
    extra = list(extra)
    seeds = ensure_seeds(tmp / "nats", [*IDENTITIES, *(i.name for i in extra)])
    config = tmp / "nats-server.conf"
    config.write_text(authorization_config(public_keys(seeds), extra=extra))
    log = tmp / "nats-server.log"
    server = PrivateNats(tmp / "data", "-c", str(config), "-l", str(log))
    server.start()
    try:
        yield IdentityServer(server=server, seeds=seeds, config=config, log=log)
    finally:
        server.stop()


@dataclass
class Client:
    """One identity's connection and the errors the server sent it (lower case, as nats-py passes them on)."""

    name: str
    nc: NATS
    errors: list[str] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())
        self._arrived.set()

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e]

    async def violation(self, what: str, subject: str, timeout: float = 5.0) -> str:
        """The server's `Permissions Violation for <what> to "<subject>"`, waited for (it comes asynchronously)."""
        wanted = f'permissions violation for {what.lower()} to "{subject.lower()}"'
        deadline = time.monotonic() + timeout
        while True:
            for e in self.errors:
                if wanted in e:
                    return e
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.name}: no {wanted!r}; the errors were {self.errors}")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    async def settled(self) -> list[str]:
        """The violations so far, once the server has answered everything sent before (a PING round trip)."""
        await self.nc.flush()
        await self.nc.flush()
        return self.violations()


async def connect_as(url: str, name: str, seed: Path, **kwargs: object) -> Client:
    """`nats.connect(url, nkeys_seed=seed, inbox_prefix=_INBOX.<name>)`, recording the server's errors."""
    holder: list[Client] = []

    async def error_cb(exc: Exception) -> None:
        if holder:
            await holder[0].on_error(exc)

    nc = await nats.connect(url, name=f"weir-{name}", error_cb=error_cb, allow_reconnect=False, connect_timeout=2,
                            **connect_options(name, str(seed)), **kwargs)
    client = Client(name=name, nc=nc)
    holder.append(client)
    return client


@contextlib.asynccontextmanager
async def connected(server: IdentityServer, name: str) -> AsyncIterator[Client]:
    client = await connect_as(server.url, name, server.seeds[name], **server.transport_options())
    try:
        yield client
    finally:
        await client.nc.close()


async def wait_until_ready(server: IdentityServer) -> list[str]:
    """Once the server admits the operator and its JetStream answers, every stream applied by the operator (as `weir
    up` does), who must be refused nothing; returns what apply_streams did."""
    await wait_until_up(server.url, **server.client_options("operator"))
    async with connected(server, "operator") as operator:
        done = await apply_streams(operator.nc.jetstream(), CommonSettings(stream_replicas=1))
        assert await operator.settled() == []
    return done
