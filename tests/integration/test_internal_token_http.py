"""The post-mortem's fix where it lives (shared/reference, SPEC 2 and 3): the internal token through the api's HTTP
server to `/internal/v1/...`, with the seed's three cases at its numbers -- a limiter set to allow 5 an address:
20 requests with the real internal token all answered; ordinary requests from one address, the first 5 answered and
the rest refused; forged tokens counted and refused the same way, and the internal route answers them 401."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import nats
import pytest

from shared.authcheck import AppCreated
from shared.authclient import create_account_with_app
from tests.integration.apihelpers import Services, run_services
from tests.integration.authhelpers import TEST_SECRETS, fresh_address

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADDRESS_LIMIT = 5  # the seed's limiter: "set to allow 5"
SENT = 20  # the seed's 20 requests
# rejected credentials have a budget of their own (auth_failure); high here, so that what refuses a forged token is
# the address budget every ordinary request spends, as the post-mortem says
LIMITS = {"limit_address_per_minute": str(ADDRESS_LIMIT), "limit_auth_failure_per_minute": str(SENT * 10)}
INTERNAL = "X-Weir-Internal-Token"


@pytest.fixture(scope="module")
def services(bus_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(bus_env, tmp_path_factory.mktemp("logs"), **LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
async def app(services: Services, bus_env: dict[str, str]) -> AppCreated:
    nc = await nats.connect(bus_env["WEIR_NATS_URL"])  # the module's own server: no identities
    try:
        _, created = await create_account_with_app(nc, "internal-token")
    finally:
        await nc.close()
    return created


@pytest.fixture(scope="module")
async def video_id(services: Services, app: AppCreated) -> str:
    """A real video to look up (made with the secret key, which spends no address budget)."""
    async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as http:
        r = await http.post("/v1/videos", json={"name": "edge lookup"},
                            headers={"Authorization": f"Bearer {app.secret_key}", "X-Forwarded-For": fresh_address()})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


async def internal_lookups(http: httpx.AsyncClient, video_id: str, address: str, token: str, n: int
                           ) -> list[httpx.Response]:
    return [await http.get(f"/internal/v1/videos/{video_id}", headers={INTERNAL: token, "X-Forwarded-For": address})
            for _ in range(n)]


async def test_the_real_internal_token_is_never_counted_against_the_address(
        http: httpx.AsyncClient, video_id: str) -> None:
    """Seed case 1: 20 requests with the internal token through a limiter that allows 5 an address: all answered."""
    answers = await internal_lookups(http, video_id, fresh_address(), TEST_SECRETS["internal_token"], SENT)
    assert [r.status_code for r in answers] == [200] * SENT, [r.text for r in answers if r.status_code != 200]
    assert {r.json()["id"] for r in answers} == {video_id}


async def test_ordinary_requests_from_one_address_get_the_limit_and_no_more(
        http: httpx.AsyncClient, app: AppCreated) -> None:
    """Seed case 2: ordinary requests (a publishable key: accepted, and counted by address) from one address: the
    first 5 answered, every one after refused 429 by the address rule, with Retry-After."""
    address = fresh_address()
    answers = [await http.post("/sdk/v1/videos", json={"name": f"from a browser {i}"},
                               headers={"Authorization": f"Bearer {app.publishable_key}", "X-Forwarded-For": address})
               for i in range(SENT)]
    assert [r.status_code for r in answers] == [201] * ADDRESS_LIMIT + [429] * (SENT - ADDRESS_LIMIT)
    refused = answers[-1]
    assert refused.json()["code"] == "rate_limited" and refused.json()["rule"] == "address"
    assert int(refused.headers["Retry-After"]) > 0


async def test_a_forged_internal_token_is_counted_refused_and_401(http: httpx.AsyncClient, video_id: str) -> None:
    """Seed case 3: forged tokens get no pass: each is an ordinary request that counts against its address and a
    rejected credential, the internal route answers it 401, and past the address limit it is refused 429 like any
    other request."""
    address = fresh_address()
    answers = await internal_lookups(http, video_id, address, secrets.token_urlsafe(32), SENT)
    assert [r.status_code for r in answers] == [401] * ADDRESS_LIMIT + [429] * (SENT - ADDRESS_LIMIT)
    assert answers[-1].json()["rule"] == "address"
    assert all(video_id not in r.text for r in answers)


async def test_weirs_own_traffic_gets_through_an_address_others_exhausted(
        http: httpx.AsyncClient, video_id: str) -> None:
    """The post-mortem's production case: Weir's edge shares an address with everyone it serves. Once ordinary
    requests from that address are refused, the edge's requests with the real token are still answered, while a
    forged token from the same address is refused at once."""
    shared = fresh_address()
    forged = await internal_lookups(http, video_id, shared, secrets.token_urlsafe(32), ADDRESS_LIMIT + 1)
    assert forged[-1].status_code == 429
    real = await internal_lookups(http, video_id, shared, TEST_SECRETS["internal_token"], SENT)
    assert [r.status_code for r in real] == [200] * SENT
    assert (await internal_lookups(http, video_id, shared, "", 1))[0].status_code == 429



async def test_a_401_says_how_to_authenticate(http: httpx.AsyncClient, video_id: str) -> None:
    """Every 401 carries its challenge (RFC 9110 requires one; RFC 6750's terms): a credential sent and refused is
    an `invalid_token`; the internal route, asked with none, names the header it takes."""
    none = await http.get("/v1/videos", headers={"X-Forwarded-For": fresh_address()})
    assert none.status_code == 401 and none.json()["code"] == "missing_credential", none.text
    assert none.headers["WWW-Authenticate"] == 'Bearer realm="weir"'
    forged = await http.get("/v1/videos", headers={"Authorization": "Bearer wsk_" + secrets.token_hex(16),
                                                   "X-Forwarded-For": fresh_address()})
    assert forged.status_code == 401 and forged.json()["code"] == "invalid_credential", forged.text
    assert forged.headers["WWW-Authenticate"] == 'Bearer realm="weir", error="invalid_token"'
    internal = await http.get(f"/internal/v1/videos/{video_id}", headers={"X-Forwarded-For": fresh_address()})
    assert internal.status_code == 401 and INTERNAL in internal.json()["detail"], internal.text
    assert "Authorization" not in internal.json()["detail"]
