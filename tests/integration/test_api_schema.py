"""schemathesis over the api's own /openapi.json: no 500, no answer outside the documented schema.

Bounded (a few examples per operation) so it stays well under two minutes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from shared.authcheck import AccountCreated, AppCreated
from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, run_services
from tests.integration.authhelpers import fresh_address

EXAMPLES_PER_OPERATION = 50
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)


# the SDK routes run with the credential each one takes, so their bodies are fuzzed behind authentication too: the
# upload routes with an upload token minted for the very video in their path, the create route with a publishable
# key and an origin the app allows
SDK_PREFIX = "/sdk/v1/"
SDK_CREATE = "/sdk/v1/videos"
SDK_INITIATE = "/sdk/v1/videos/{video_id}/upload"
ORIGIN = "https://fuzz.example"
SDK_OPERATIONS = {f"POST {SDK_CREATE}", f"POST {SDK_INITIATE}", f"POST {SDK_INITIATE}/parts",
                  f"POST {SDK_INITIATE}/complete", f"DELETE {SDK_INITIATE}"}  # at least these (SPEC section 4)
# authentication must pass for at least this share of an SDK route's cases, so the fuzzing cannot drift back to
# answering 401 or 403 and still pass
AUTHENTICATED_SHARE_MIN = 0.5
REFUSED_BY_AUTH = (401, 403)


@pytest.fixture(scope="module")
def api(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), ("auth", "api", "webhooks"),  # /v1/webhooks
                      limit_key_per_minute="1000000",
                      limit_owner_per_minute="1000000", limit_address_per_minute="1000000",
                      limit_auth_failure_per_minute="1000000", limit_upload_token_per_minute="1000000") as s:
        yield s


async def _credentials(settings: CommonSettings) -> tuple[AccountCreated, AppCreated]:
    nc = await connect(settings, name="test")
    try:
        return await create_account_with_app(nc, "fuzz", allowed_origins=(ORIGIN,))
    finally:
        await nc.close()


def _video_with_token(api: Services, secret_key: str, *, initiated: bool) -> tuple[str, str]:
    """A video of the app and an upload token minted for it; `initiated`: its multipart upload already open, so
    that part URLs, completion and abort reach storage rather than stopping at "initiate one first"."""
    response = httpx.post(f"{api.api_url}/v1/videos", json={"name": "fuzzed upload"}, timeout=30,
                          headers={"Authorization": f"Bearer {secret_key}", "X-Forwarded-For": fresh_address()})
    assert response.status_code == 201, response.text
    video = response.json()
    if initiated:
        opened = httpx.post(f"{api.api_url}{SDK_INITIATE.format(video_id=video['id'])}", timeout=30,
                            json={"content_type": "video/mp4"},
                            headers={"Authorization": f"Bearer {video['upload_token']}",
                                     "X-Forwarded-For": fresh_address()})
        assert opened.status_code == 200, opened.text
    return video["id"], video["upload_token"]


@dataclass
class Seen:
    """What one operation's cases got back, to show authentication passed for them."""

    statuses: Counter[int] = field(default_factory=Counter)
    samples: dict[int, str] = field(default_factory=dict)  # the first body of each status, to say why

    @property
    def authenticated(self) -> int:
        return sum(n for status, n in self.statuses.items() if status not in REFUSED_BY_AUTH)


def _runner(operation: Any, base_url: str, headers: dict[str, str], path_parameters: dict[str, str],
            seen: Seen) -> Callable[[], None]:
    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case[Any]) -> None:
        if path_parameters:  # the resource the credential was made for (an upload token is for one video)
            case.path_parameters = {**case.path_parameters, **path_parameters}
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        seen.statuses[response.status_code] += 1
        body = "(no body)" if isinstance(case.body, NotSet) else repr(case.body)[:200]
        seen.samples.setdefault(response.status_code, f"{body} -> {response.text[:300]}")
        case.validate_response(response, checks=list(CHECKS))

    return run


def test_no_500_and_every_answer_matches_the_schema(api: Services, prepared: CommonSettings, tmp_path: Path) -> None:
    import asyncio

    account, app = asyncio.run(_credentials(prepared))
    schema = schemathesis.openapi.from_url(f"{api.api_url}/openapi.json")
    failures: list[str] = []
    sdk: dict[str, Seen] = {}
    for result in schema.get_all_operations():
        if isinstance(result, Err):  # an operation schemathesis cannot read is a defect of the document
            failures.append(f"unreadable operation: {result.err()}"[:3000])
            continue
        operation = result.ok()
        path = operation.path
        name = f"{operation.method.upper()} {path}"
        token = account.account_token if path.startswith("/v1/account") else app.secret_key
        if path.startswith("/internal"):
            token = api.env["WEIR_INTERNAL_TOKEN"]
        extra: dict[str, str] = {}
        path_parameters: dict[str, str] = {}
        if path == SDK_CREATE:
            token, extra = app.publishable_key, {"Origin": ORIGIN}
        elif path.startswith(SDK_PREFIX):
            assert "{video_id}" in path, f"an SDK route this test does not know how to authenticate: {name}"
            # one video per operation, so no operation's cases change another's state; initiate itself starts from
            # a video with no upload, the others from one with an open upload
            initiated = not (operation.method.upper() == "POST" and path == SDK_INITIATE)
            video_id, token = _video_with_token(api, app.secret_key, initiated=initiated)
            path_parameters = {"video_id": video_id}
        headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": fresh_address(), **extra}

        seen = Seen()
        if path.startswith(SDK_PREFIX):
            sdk[name] = seen
        run = _runner(operation, api.api_url, headers, path_parameters, seen)
        try:
            run()
        # collect every operation's first failure, then fail once (schemathesis raises its failures as a
        # FailureGroup, a BaseExceptionGroup: `except Exception` alone would let the first one end the test)
        except (Exception, FailureGroup) as exc:
            failures.append(f"{name}: {exc}"[:3000])

    # every SDK route was fuzzed behind its authentication, not only at its 401
    assert SDK_OPERATIONS <= set(sdk), sorted(sdk)
    for name, seen in sorted(sdk.items()):
        cases = sum(seen.statuses.values())
        print(f"{name}: {cases} cases, statuses {dict(sorted(seen.statuses.items()))}")  # shown with -rP
        for status, sample in sorted(seen.samples.items()):
            print(f"    {status}: {sample}")
        if cases == 0:
            failures.append(f"{name}: no case was sent")
        elif seen.authenticated < AUTHENTICATED_SHARE_MIN * cases:
            failures.append(f"{name}: authentication passed for only {seen.authenticated} of {cases} cases "
                            f"({dict(seen.statuses)}); refusals: {[seen.samples.get(s) for s in REFUSED_BY_AUTH]}")
    assert not failures, "\n\n".join(failures)
