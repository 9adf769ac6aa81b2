"""The client address through real HTTP (SPEC 3 and 4): the api's HTTP server hands Weir the TCP peer, and only
auth's WEIR_TRUSTED_PROXIES decides whose X-Forwarded-For is read; no server default or variable changes that."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from tests.integration.apihelpers import Services, run_services
from tests.integration.authhelpers import LONG_WINDOW, fresh_address

pytestmark = pytest.mark.asyncio(loop_scope="session")
ADDRESS_LIMIT = 6  # small: each test spends it a few times over
LIMITS = {"limit_address_per_minute": str(ADDRESS_LIMIT), "limit_window_seconds": str(LONG_WINDOW)}


@asynccontextmanager
async def from_peer(services: Services, peer: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client whose TCP connections come from `peer` (any 127.0.0.0/8 address is this machine's)."""
    transport = httpx.AsyncHTTPTransport(local_address=peer)
    async with httpx.AsyncClient(base_url=services.api_url, transport=transport, timeout=30) as http:
        yield http


def spoofed() -> dict[str, str]:
    return {"X-Forwarded-For": f"192.0.2.{random.randrange(1, 255)}, {fresh_address()}"}


async def statuses(http: httpx.AsyncClient, n: int, headers: dict[str, str] | None = None) -> list[int]:
    """`n` requests without a credential, each with a new X-Forwarded-For unless `headers` are given."""
    return [(await http.get("/v1/videos", headers=headers or spoofed())).status_code for _ in range(n)]


async def test_forwarded_for_from_an_untrusted_loopback_peer_changes_nothing(
    bus_env: dict[str, str], tmp_path: Path
) -> None:
    """No trusted proxies: the peer is the address, whatever X-Forwarded-For says, with uvicorn's defaults in the
    environment (it trusts 127.0.0.1) and with FORWARDED_ALLOW_IPS='*' (often set in container images)."""
    with run_services(bus_env, tmp_path, names=("auth",), trusted_proxies="", **LIMITS), \
            run_services(bus_env, tmp_path, names=("api",), trusted_proxies="", **LIMITS) as plain, \
            run_services(bus_env, tmp_path, names=("api",), extra_env={"FORWARDED_ALLOW_IPS": "*"},
                         trusted_proxies="", **LIMITS) as star:
        for services, peer in ((plain, "127.0.0.1"), (star, "127.0.0.3")):
            async with from_peer(services, peer) as http:
                seen = await statuses(http, ADDRESS_LIMIT + 2)
                assert seen == [401] * ADDRESS_LIMIT + [429] * 2, (peer, seen)
                refused = (await http.get("/v1/videos", headers=spoofed())).json()
                assert refused["rule"] == "address" and refused["code"] == "rate_limited"
            # the budget was the peer's: another peer still has its own
            async with from_peer(services, "127.0.0.4" if peer == "127.0.0.1" else "127.0.0.5") as other:
                assert await statuses(other, 1) == [401]


async def test_behind_a_trusted_proxy_the_rightmost_untrusted_hop_is_the_client(
    bus_env: dict[str, str], tmp_path: Path
) -> None:
    with run_services(bus_env, tmp_path, names=("auth", "api"), trusted_proxies="127.0.0.0/8",
                      internal_token="", **LIMITS) as services:
        client, other = fresh_address(), fresh_address()
        async with from_peer(services, "127.0.0.6") as http:
            assert await statuses(http, ADDRESS_LIMIT, {"X-Forwarded-For": client}) == [401] * ADDRESS_LIMIT
            # the hops left of the rightmost untrusted one are the client's to write: they change nothing
            assert await statuses(http, 1, {"X-Forwarded-For": f"{other}, {client}"}) == [429]
            # trusted hops on the right (more proxies of ours) are walked past
            assert await statuses(http, 1, {"X-Forwarded-For": f"{other}, {client}, 127.0.0.9"}) == [429]
            assert await statuses(http, 1, {"X-Forwarded-For": f"{client}, {other}"}) == [401]
            assert await statuses(http, 1, {"X-Forwarded-For": "not an address"}) == [401]  # the peer then
        # with no internal token configured, nobody may read a service's settings: the route is not served
        async with httpx.AsyncClient() as plain:
            for url in services.urls.values():
                r = await plain.get(f"{url}/settings", headers={"X-Weir-Internal-Token": ""})
                assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
