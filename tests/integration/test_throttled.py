"""Who is throttled, through what its users meet: 429s caused through the api's HTTP server with a secret key, a
publishable key, an upload token, no credential, a rejected key and Weir's internal token (carried with a secret key
whose budget is spent: the only way internal traffic meets a 429, since the address limit never counts it); then
auth's /metrics by caller class and rule, the internal-traffic alert's expression evaluated on those samples (no
promtool here), auth's /throttled for operators only, and `weir status` naming the most refused account and app."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import httpx
import nats
import pytest

from services.auth.domain.rules import RuleId
from services.auth.domain.throttled import CallerClass
from services.auth.settings import AuthSettings
from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH
from tests.integration.apihelpers import Services, run_services
from tests.integration.authhelpers import LONG_WINDOW, TEST_SECRETS, fresh_address
from tests.integration.test_status import weir_status
from tests.promrules import INTERNAL_ALERT, alerts, load_rules, matching, selectors

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMITS = AuthSettings(limit_key_per_minute=3, limit_upload_token_per_minute=3, limit_address_per_minute=4,
                      limit_auth_failure_per_minute=2, limit_owner_per_minute=1000, limit_window_seconds=LONG_WINDOW)
SETTINGS = {name: str(getattr(LIMITS, name)) for name in (
    "limit_key_per_minute", "limit_upload_token_per_minute", "limit_address_per_minute",
    "limit_auth_failure_per_minute", "limit_owner_per_minute", "limit_window_seconds")}
OVER = 3  # the secret key's refusals past its limit: more than any other caller's, so it tops the list
SPRAYED = 2  # refusals of one address sending a made-up key each time, past auth_failure: one caller (< OVER)
INTERNAL = "X-Weir-Internal-Token"


@pytest.fixture(scope="module")
def services(bus_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with run_services(bus_env, tmp_path_factory.mktemp("logs"), **SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
async def apps(services: Services, bus_env: dict[str, str]) -> dict[str, tuple[AccountCreated, AppCreated]]:
    """An account and app per caller that spends a key's budget: the secret key's, the upload token's maker, the
    internal edge's."""
    nc = await nats.connect(bus_env["WEIR_NATS_URL"])  # the module's own server: no identities
    try:
        return {name: await create_account_with_app(nc, f"throttled-{name}") for name in ("keyed", "uploads", "edge")}
    finally:
        await nc.close()


async def metrics_text(services: Services) -> str:
    async with httpx.AsyncClient(timeout=30) as plain:
        r = await plain.get(f"{services.urls['auth']}/metrics")
        r.raise_for_status()
        return r.text


def refusals(exposition: str) -> dict[tuple[str, str], float]:
    """weir_limit_refusals_total by (caller, rule)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["caller"], s.labels["rule"]): s.value for f in text_string_to_metric_families(exposition)
            for s in f.samples if s.name == "weir_limit_refusals_total"}


async def statuses(http: httpx.AsyncClient, method: str, path: str, n: int, headers: dict[str, str]) -> list[int]:
    return [(await http.request(method, path, headers=headers)).status_code for _ in range(n)]


async def test_refusals_by_caller_class_and_rule_on_metrics_the_alert_and_weir_status(
    http: httpx.AsyncClient, services: Services, apps: dict[str, tuple[AccountCreated, AppCreated]],
    bus_env: dict[str, str]
) -> None:
    rules = load_rules()
    alert = alerts(rules)[INTERNAL_ALERT]
    (selector,) = selectors(alert["expr"])
    before = await metrics_text(services)
    # auth keeps the internal series at 0 from its start, one per rule: the alert's increase() sees the first 429
    internal_before = matching(before, selector)
    assert {dict(labels)["rule"] for labels in internal_before} == {r.value for r in RuleId}
    assert set(internal_before.values()) == {0.0}

    key, address, failures = (LIMITS.limit_key_per_minute, LIMITS.limit_address_per_minute,
                              LIMITS.limit_auth_failure_per_minute)
    (account, keyed), (_, uploads), (_, edge) = apps["keyed"], apps["uploads"], apps["edge"]

    # the upload token's video and token: two of its maker's key budget, from an address of its own
    maker = {"Authorization": f"Bearer {uploads.secret_key}", "X-Forwarded-For": fresh_address()}
    video = (await http.post("/v1/videos", json={"name": "throttled"}, headers=maker)).json()
    token = video["upload_token"]

    # a secret key: its budget, then OVER refusals by `key`
    seen = await statuses(http, "GET", "/v1/videos", key + OVER,
                          {"Authorization": f"Bearer {keyed.secret_key}", "X-Forwarded-For": fresh_address()})
    assert seen == [200] * key + [429] * OVER
    # a publishable key on a secret route: refused 401 while its address has budget, then 429 by `address`
    seen = await statuses(http, "GET", "/v1/videos", address + 1,
                          {"Authorization": f"Bearer {keyed.publishable_key}", "X-Forwarded-For": fresh_address()})
    assert seen == [401] * address + [429]
    # an upload token on its video: its own budget, then `upload_token`
    seen = await statuses(http, "GET", f"/sdk/v1/videos/{video['id']}", LIMITS.limit_upload_token_per_minute + 1,
                          {"Authorization": f"Bearer {token}", "X-Forwarded-For": fresh_address()})
    assert seen == [200] * LIMITS.limit_upload_token_per_minute + [429]
    # no credential: 401 while the address has budget, then `address`
    seen = await statuses(http, "GET", "/v1/videos", address + 1, {"X-Forwarded-For": fresh_address()})
    assert seen == [401] * address + [429]
    # guessed keys, a new one each time, from one address: rejected credentials past `auth_failure` (below the
    # address limit here)
    spraying = fresh_address()
    seen = [(await http.get("/v1/videos", headers={"Authorization": f"Bearer wsk_{secrets.token_hex(16)}",
                                                   "X-Forwarded-For": spraying})).status_code
            for _ in range(failures + SPRAYED)]
    assert seen == [401] * failures + [429] * SPRAYED
    # Weir's own edge, with the real internal token and a customer's secret key, from one shared address: never
    # counted by address, but the key's budget is the key's
    shared_address = fresh_address()
    seen = await statuses(http, "GET", f"/internal/v1/videos/{video['id']}", key + 1, {
        INTERNAL: TEST_SECRETS["internal_token"], "Authorization": f"Bearer {edge.secret_key}",
        "X-Forwarded-For": shared_address})
    assert seen == [200] * key + [429]

    after = refusals(await metrics_text(services))
    expected = {
        (CallerClass.SECRET_KEY, RuleId.KEY): OVER,
        (CallerClass.PUBLISHABLE_KEY, RuleId.ADDRESS): 1,
        (CallerClass.UPLOAD_TOKEN, RuleId.UPLOAD_TOKEN): 1,
        (CallerClass.NO_CREDENTIAL, RuleId.ADDRESS): 1,
        (CallerClass.REJECTED, RuleId.AUTH_FAILURE): SPRAYED,
        (CallerClass.INTERNAL, RuleId.KEY): 1,
    }
    assert {k: v for k, v in after.items() if v} == {(c.value, r.value): n for (c, r), n in expected.items()}

    # the alert's expression on the samples before and after: increase() over them is above 0 for the internal
    # series of `key` alone, so the alert fires, naming the rule
    now = matching(await metrics_text(services), selector)
    increases = {dict(labels)["rule"]: value - internal_before.get(labels, 0.0) for labels, value in now.items()}
    firing = {rule for rule, increase in increases.items() if increase > 0}
    assert firing == {RuleId.KEY.value}

    # /throttled is for operators: without the internal token, 401
    async with httpx.AsyncClient(timeout=30) as plain:
        r = await plain.get(f"{services.urls['auth']}/throttled")
        assert r.status_code == 401 and r.json()["code"] == "invalid_credential", r.text

    # `weir status` (the CLI, as an operator runs it) names the most refused account and app, and warns of the
    # internal traffic refused; nothing secret is printed
    env = {**bus_env, "WEIR_INTERNAL_TOKEN": TEST_SECRETS["internal_token"]}
    args = ("--service", f"auth={services.urls['auth']}", "--service", f"api={services.api_url}",
            "--stack", "no-stack.json")
    _, doc = await weir_status(env, *args)
    top = doc["throttled"]["top"]
    assert top[0] == {"caller": "secret_key", "rule": "key", "account_id": account.account_id, "app_id": keyed.id,
                      "key_prefix": keyed.secret_key[:KEY_PREFIX_MAX_LENGTH], "address": None, "refused": OVER,
                      "error": 0}
    by_caller = {(c["caller"], c["rule"]): c for c in top}
    assert {(c.value, r.value) for c, r in expected} == set(by_caller)
    assert by_caller[("internal", "key")]["app_id"] == edge.id
    assert by_caller[("upload_token", "upload_token")]["app_id"] == uploads.id
    assert by_caller[("no_credential", "address")]["address"] is not None
    # the made-up keys are one caller, the address: their characters (the sender's choice) are not shown
    sprayer = by_caller[("rejected", "auth_failure")]
    assert (sprayer["key_prefix"], sprayer["address"], sprayer["refused"]) == (None, spraying, SPRAYED), sprayer
    assert any("internal traffic was refused 429" in w and "by rule key" in w for w in doc["warnings"])
    printed = json.dumps(doc)
    for _, app in apps.values():
        assert app.secret_key not in printed and app.publishable_key not in printed
    assert token not in printed and TEST_SECRETS["internal_token"] not in printed

    # the terminal view names them too
    text = await weir_status_text(env, *args)
    assert "throttled (429) in the last" in text and keyed.id in text and edge.id in text
    # a wrong token: the part is unavailable, with why
    _, doc = await weir_status({**env, "WEIR_INTERNAL_TOKEN": "not-the-token"}, *args)
    assert doc["unavailable"]["throttled.auth"].endswith("HTTP 401 invalid_credential")


async def weir_status_text(env: dict[str, str], *args: str) -> str:
    """`weir status` as an operator reads it (wide enough that no id is cut)."""
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "weir.cli", "status", *args], capture_output=True, text=True,
        timeout=120, env={**os.environ, **env, "COLUMNS": "240"})
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.stdout
