"""The edge reads auth.check's reply as a remembered decision and its headers: the same values as the whole model.

`check_decision` validates the part before the headers once per distinct bytes and the headers on their own. Whatever
the reply holds (quotes, escapes, a value that reads like the headers field) and in whatever order its fields come,
it must give what `CheckReply.model_validate_json` gives, refuse what that refuses, and raise AuthError for an
error reply.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared import authclient
from shared.authcheck import CheckDecision, CheckReply
from shared.authclient import AuthError, check_decision
from shared.messaging import UnreadableReply, error_reply
from tests.unit.checkreplies import REPLIES


def parts(reply: CheckReply) -> tuple[dict[str, object], dict[str, str]]:
    return reply.model_dump(exclude={"headers"}), reply.headers


def read(data: bytes) -> tuple[dict[str, object], dict[str, str]]:
    decision, headers = check_decision(data)
    assert isinstance(decision, CheckDecision)
    return decision.model_dump(exclude={"headers"}), headers


@given(reply=REPLIES)
@settings(max_examples=300, deadline=None)
def test_the_model_written_with_its_headers_last_reads_as_itself(reply: CheckReply) -> None:
    data = reply.model_dump_json().encode()
    assert data.endswith(b"}}") or data.endswith(b"{}}")  # the headers object ends the reply
    assert read(data) == parts(reply)
    assert read(data) == parts(reply)  # and again, from the remembered decision


@given(reply=REPLIES, seed=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None)
def test_fields_in_any_order_read_as_the_model(reply: CheckReply, seed: int) -> None:
    fields = list(reply.model_dump(mode="json").items())
    random.Random(seed).shuffle(fields)
    data = json.dumps(dict(fields), separators=(",", ":")).encode()
    assert read(data) == parts(CheckReply.model_validate_json(data)) == parts(reply)


def test_the_remembered_part_is_reused_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(authclient, "_decisions", {})
    first, _ = check_decision(CheckReply(allowed=True, status=200, client_address="a",
                                         headers={"RateLimit": "1"}).model_dump_json().encode())
    again, headers = check_decision(CheckReply(allowed=True, status=200, client_address="a",
                                               headers={"RateLimit": "2"}).model_dump_json().encode())
    assert again is first and headers == {"RateLimit": "2"}
    for i in range(authclient._REMEMBERED * 2):
        check_decision(CheckReply(allowed=True, status=200, client_address=str(i)).model_dump_json().encode())
    assert 0 < len(authclient._decisions) <= authclient._REMEMBERED


@pytest.mark.parametrize("data", [
    b'{"allowed":true,"status":200,"client_address":"a","headers":{"RateLimit":1}}',  # a header that is no string
    b'{"allowed":true,"status":200,"headers":{}}',  # no client_address
    b'{"allowed":true,"status":200,"client_address":"a","headers":{}',  # cut short
    b'{"allowed":true,"status":200,"client_address":"a","headers":{}} {}',  # more after it
    b'not json',
])
def test_what_the_model_refuses_is_refused(data: bytes) -> None:
    with pytest.raises(ValidationError):
        CheckReply.model_validate_json(data)
    with pytest.raises(UnreadableReply, match=r"auth\.check"):  # the guard answers it 503
        check_decision(data)


@pytest.mark.parametrize("data", [
    b'{"allowed":true,"status":200,"client_address":"a","extra":1,"headers":{"RateLimit":"1"}}',
    b'{"allowed":true,"status":200,"client_address":"a","headers":{"RateLimit":"1"},"extra":{"b":[1]}}',
    b'{"extra":"x","allowed":true,"status":200,"client_address":"a","headers":{"RateLimit":"1"}}',
])
def test_a_field_this_release_does_not_know_is_ignored(data: bytes) -> None:
    assert read(data) == parts(CheckReply(allowed=True, status=200, client_address="a", headers={"RateLimit": "1"}))


def test_an_error_reply_is_auth_error() -> None:
    data = error_reply(400, "validation_error", 'bad "headers"').model_dump_json().encode()
    with pytest.raises(AuthError) as refused:
        check_decision(data)
    assert (refused.value.error.status, refused.value.error.code) == (400, "validation_error")
