"""The limits in the api's /openapi.json are the numbers auth runs with (SPEC 3: one settings object for headers,
refusals, docs and counters): auth started with limits unlike the defaults, every guarded route of the api's document
shows them, with the rate-limit headers and the 429 and 503 problems declared; an answer's headers say the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from services.auth.domain.access import ManagementOperation, RouteClass
from services.auth.domain.applicable import DOCUMENTED_CASES, rules_applying
from services.auth.domain.rules import RuleId, rules_from
from services.auth.settings import AuthSettings
from tests.integration.apihelpers import run_services
from tests.integration.authhelpers import fresh_address
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# every limit unlike its default and unlike the others, so that no rule can be shown with another's number
LIMITS = {"limit_address_per_minute": "7", "limit_auth_failure_per_minute": "5", "limit_key_per_minute": "11",
          "limit_owner_per_minute": "13", "limit_upload_token_per_minute": "17", "limit_app_create_per_hour": "3",
          "limit_key_rotate_per_hour": "4", "limit_window_seconds": "120"}
METHODS = {"get", "post", "put", "patch", "delete"}
LIMIT_HEADERS = {"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}


async def known_document(http: httpx.AsyncClient) -> dict[str, Any]:
    """/openapi.json once the api has auth's answer (it asks at start)."""

    async def document() -> dict[str, Any] | None:
        found: dict[str, Any] = (await http.get("/openapi.json")).json()
        first = found["paths"]["/v1/videos"]["get"]["x-weir-limits"]
        return found if first["known"] else None

    found: dict[str, Any] = await wait_for(document, 30, "the api's document with auth's limits")
    return found


async def test_every_guarded_route_shows_auth_s_numbers(bus_env: dict[str, str], tmp_path: Path) -> None:
    settings = AuthSettings(**LIMITS)  # type: ignore[arg-type]
    rules = rules_from(settings)
    assert all(rule.limit != rules_from(AuthSettings.model_construct())[rule.id].limit for rule in rules.values())
    with run_services(bus_env, tmp_path, names=("auth", "api"), **LIMITS) as services:
        async with httpx.AsyncClient(base_url=services.api_url, timeout=30) as http:
            document = await known_document(http)
            checked = 0
            for path, operations in document["paths"].items():
                for method, op in operations.items():
                    if method not in METHODS or op.get("x-weir-route-class") in (None, "operations"):
                        continue
                    name = f"{method.upper()} {path}"
                    route = RouteClass(op["x-weir-route-class"])
                    operation = op.get("x-weir-operation")
                    expected = {rule for case in DOCUMENTED_CASES for rule in rules_applying(
                        route, ManagementOperation(operation) if operation else None, case.credential,
                        case.internal)}
                    shown = {r["rule"]: r for r in op["x-weir-limits"]["rules"]}
                    assert set(shown) == {str(rule) for rule in expected}, name
                    for rule_id, rule in shown.items():
                        want = rules[RuleId(rule_id)]
                        assert (rule["limit"], rule["window_seconds"]) == (want.limit, want.window_seconds), name
                        assert f"`{rule_id}` {want.limit} per {want.window_seconds} s" in op["description"], name
                    responses = op["responses"]
                    for status in ("429", "503"):
                        assert responses[status]["content"]["application/problem+json"]["schema"] == {
                            "$ref": "#/components/schemas/Problem"}, name
                        assert "Retry-After" in responses[status]["headers"], name
                    assert all(LIMIT_HEADERS <= set(r["headers"]) for r in responses.values()), name
                    checked += 1
            assert checked and "Problem" in document["components"]["schemas"]
            # what an answer says is what the document says: a request without a credential meets `address`
            answer = await http.get("/v1/videos", headers={"X-Forwarded-For": fresh_address()})
            address = rules[RuleId.ADDRESS]
            assert answer.status_code == 401
            assert answer.headers["RateLimit-Policy"] == f'"address";q={address.limit};w={address.window_seconds}'
