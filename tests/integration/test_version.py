"""Every running service says which release it is (SPEC 11): `GET /version`, the same object in `/healthz`, and the
release as info.version of its OpenAPI and AsyncAPI documents, each asked over HTTP of the real process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from shared import db
from shared.contractversions import contract_versions
from shared.release import VERSION, VersionInfo
from shared.routeclass import ROUTE_CLASS
from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, run_services

SERVICES = tuple(sorted(db.SCHEMAS))
# what an image built with `--build-arg WEIR_COMMIT=...` sets (Dockerfile): /version must show it, not git's HEAD
BUILT_FROM = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture(scope="module")
def every_service(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("version-logs"), names=SERVICES,
                      extra_env={"WEIR_COMMIT": BUILT_FROM}) as running:
        yield running


@pytest.mark.parametrize("service", SERVICES)
def test_version_route_names_the_release_commit_and_contracts(service: str, every_service: Services) -> None:
    url = every_service.urls[service]
    answer = httpx.get(f"{url}/version")  # no credential: an operations route, the api's guard included
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == set(VersionInfo.model_fields)
    assert body == {"service": service, "version": VERSION, "commit": BUILT_FROM, "dirty": None,  # no WEIR_DIRTY
                    "contracts": json.loads(json.dumps(contract_versions(service)))}
    assert body["contracts"]["events"], "every service speaks at least one event contract"

    health = httpx.get(f"{url}/healthz").json()
    assert health == {"status": "alive", "service": service, "version": body}


@pytest.mark.parametrize("service", SERVICES)
def test_documents_carry_the_release_as_info_version(service: str, every_service: Services) -> None:
    url = every_service.urls[service]
    openapi = httpx.get(f"{url}/openapi.json").json()
    assert openapi["info"]["version"] == VERSION
    operation = openapi["paths"]["/version"]["get"]
    assert operation[ROUTE_CLASS] == "operations"
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/VersionInfo"}
    asyncapi = httpx.get(f"{url}/asyncapi.json").json()
    assert asyncapi["info"]["version"] == VERSION

