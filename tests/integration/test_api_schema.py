"""schemathesis over the api's own /openapi.json: no 500, no answer outside the documented schema.

Bounded (a few examples per operation) so it stays well under two minutes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import nats
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, run_services
from tests.integration.authhelpers import fresh_address

EXAMPLES_PER_OPERATION = 50
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)


@pytest.fixture(scope="module")
def api(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), limit_key_per_minute="1000000",
                      limit_owner_per_minute="1000000", limit_address_per_minute="1000000",
                      limit_auth_failure_per_minute="1000000") as s:
        yield s


async def _credentials(nats_url: str) -> tuple[AccountCreated, AppCreated]:
    nc = await nats.connect(nats_url)
    try:
        return await create_account_with_app(nc, "fuzz")
    finally:
        await nc.close()


def _runner(operation: Any, base_url: str, headers: dict[str, str]) -> Callable[[], None]:
    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        case.validate_response(response, checks=CHECKS)

    return run  # type: ignore[no-any-return]


def test_no_500_and_every_answer_matches_the_schema(api: Services, prepared: CommonSettings, tmp_path: Path) -> None:
    import asyncio

    account, app = asyncio.run(_credentials(prepared.nats_url))
    schema = schemathesis.openapi.from_url(f"{api.api_url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        path = operation.path
        token = account.account_token if path.startswith("/v1/account") else app.secret_key
        if path.startswith("/internal"):
            token = api.env["WEIR_INTERNAL_TOKEN"]
        headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": fresh_address()}

        run = _runner(operation, api.api_url, headers)
        try:
            run()
        except Exception as exc:  # collect every operation's first failure, then fail once
            failures.append(f"{operation.method.upper()} {path}: {exc}"[:3000])
    assert not failures, "\n\n".join(failures)
