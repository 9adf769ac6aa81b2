"""shared/messaging.py's error replies and closed sets are read tolerantly: what a newer responder adds is read."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ValidationError

from shared.messaging import ErrorReply, error_in, error_reply, unknown_as


def test_an_error_reply_with_new_fields_and_an_unknown_code_is_read() -> None:
    body = b'{"error": {"status": 429, "code": "slow_down", "detail": "later", "retry_in": 3}, "trace": "t"}'
    refused = error_in(body)
    assert refused is not None
    assert (refused.error.status, refused.error.code, refused.error.detail) == (429, "slow_down", "later")
    assert ErrorReply.model_validate_json(body) == refused


def test_what_is_not_an_error_reply_is_none() -> None:
    assert error_in(b'{"accepted": true}') is None
    assert error_in(b'{"error": {"status": "bad"}}') is None
    assert error_in(b"not json") is None
    assert error_in(error_reply(400, "validation_error", "x").model_dump_json().encode()) is not None


class _Answer(BaseModel):
    state: Annotated[Literal["ready", "busy", "unknown"], unknown_as("unknown")]


def test_a_closed_set_reads_a_value_a_newer_release_added_as_its_fallback() -> None:
    assert _Answer.model_validate_json(b'{"state": "busy"}').state == "busy"
    assert _Answer.model_validate_json(b'{"state": "draining"}').state == "unknown"
    with pytest.raises(ValidationError):
        _Answer.model_validate_json(b'{"state": 3}')  # not a value of any release
