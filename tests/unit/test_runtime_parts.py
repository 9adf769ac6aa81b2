"""A service's own objects on its runtime (`Runtime.parts`): read typed, and a clear error before the start made
them, which auth's operators route turns into a 503 problem rather than a 500."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.auth import operators
from services.auth.app import SERVICE as AUTH
from services.auth.settings import AuthSettings
from services.auth.throttled import PATH
from shared.metrics import Metrics
from shared.runtime import NotStarted, Runtime


def runtime() -> Runtime:
    return Runtime(definition=AUTH, settings=AuthSettings(internal_token="t" * 32), metrics=Metrics(AUTH.name))


def test_the_parts_are_read_as_their_own_type_once_made() -> None:
    rt = runtime()
    with pytest.raises(NotStarted, match="auth has not made its dict yet"):
        rt.parts_of(dict)
    rt.parts = {"made": True}
    assert rt.parts_of(dict) == {"made": True}
    with pytest.raises(NotStarted):  # another service's kind of parts is not these
        rt.parts_of(list)


def test_auths_operators_route_answers_503_before_the_start_made_its_checker() -> None:
    rt, app = runtime(), FastAPI()

    def not_made() -> Any:
        return rt.parts_of(dict)

    operators.routes(app, rt, not_made)
    answer = TestClient(app).get(PATH, headers={"X-Weir-Internal-Token": "t" * 32})
    assert answer.status_code == 503 and answer.json()["code"] == "unavailable"
    assert answer.headers["content-type"].startswith("application/problem+json")
