"""auth's request and reply models read what a newer release may send: unknown fields are ignored, and a value a
newer release may add to a closed set reads as its documented fallback (shared/authcheck.py); anything else that
does not validate is still refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.authcheck import MANAGE_OPERATIONS, CheckReply, CheckRequest, KeyList

REQUEST = {"peer": "10.0.0.1", "route_class": "secret", "route": "GET /v1/videos"}
REPLY = {"allowed": True, "status": 200, "client_address": "10.0.0.1", "headers": {}}


def read(model: type[BaseModel], value: dict[str, Any]) -> Any:
    return model.model_validate_json(json.dumps(value))


def test_unknown_fields_are_ignored_on_every_request_and_reply() -> None:
    assert read(CheckRequest, {**REQUEST, "priority": "high"}) == read(CheckRequest, REQUEST)
    assert read(CheckReply, {**REPLY, "verdict": "x", "identity": {"scopes": []}}).identity is not None
    for request, reply in MANAGE_OPERATIONS.values():
        for model in (request, reply):
            assert "additionalProperties" not in json.dumps(model.model_json_schema()), model.__name__
            assert model.model_config.get("extra") != "forbid", model.__name__


@pytest.mark.parametrize(("model", "base", "field", "unknown", "fallback"), [
    (CheckRequest, REQUEST, "route_class", "admin", "internal"),  # the strictest: only Weir's own token passes
    (CheckRequest, REQUEST, "operation", "video_delete", None),  # no operation limit this release knows
    (CheckReply, REPLY, "counter_mode", "quorum", "local"),  # the weaker promise
])
def test_an_unknown_closed_set_value_reads_as_its_fallback(
    model: type[BaseModel], base: dict[str, Any], field: str, unknown: str, fallback: object
) -> None:
    assert getattr(read(model, {**base, field: unknown}), field) == fallback
    with pytest.raises(ValidationError):  # not text: not a value of a newer release, but a broken message
        read(model, {**base, field: 7})


def test_an_unknown_key_type_reads_as_none_and_an_unknown_key_kind_as_secret() -> None:
    reply = read(CheckReply, {**REPLY, "identity": {"key_id": "k1", "key_type": "robot_key"}})
    assert reply.identity.key_id == "k1" and reply.identity.key_type is None
    keys = read(KeyList, {"keys": [{"id": "k1", "kind": "restricted", "prefix": "wrk_", "created_at": "2026-01-01",
                                    "revoked_at": None}]})
    assert keys.keys[0].kind == "secret"  # shown as the kind never to expose in a page
