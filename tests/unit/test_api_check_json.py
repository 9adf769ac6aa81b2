"""auth.check's messages are written by templates made from their models (shared/modeljson.py); each must read back
as the same model. The api writes the CheckRequest (header values reach the guard as latin-1 text, so every string
is drawn from all 256 code points), auth writes the CheckReply (with parts given as ready JSON)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter

from services.api.guard import check_request_for
from shared.authcheck import CheckReply, CheckRequest
from shared.modeljson import ModelTemplate, RawJson
from tests.unit.apiapp import api_table
from tests.unit.checkreplies import REPLIES

ROUTES = api_table().rules  # as the guard derives them from the api's routes

LATIN1 = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=60)
MAYBE = st.none() | LATIN1


@given(
    rule=st.sampled_from([*ROUTES, None]),
    method=st.sampled_from(["GET", "PATCH", "BREW", 'X"\\']),
    authorization=MAYBE, internal_token=MAYBE, forwarded_for=MAYBE, video_id=MAYBE, peer=LATIN1, origin=MAYBE,
)
@settings(max_examples=500, deadline=None)
def test_the_written_request_is_the_model(
    rule: object, method: str, authorization: str | None, internal_token: str | None, forwarded_for: str | None,
    video_id: str | None, peer: str, origin: str | None,
) -> None:
    route = getattr(rule, "name", f"{method} (no route)")
    route_class = getattr(rule, "route_class", "public")
    operation = getattr(rule, "operation", None)
    expected = CheckRequest(authorization=authorization, internal_token=internal_token, peer=peer,
                            forwarded_for=forwarded_for, route_class=route_class, route=route, operation=operation,
                            video_id=video_id, origin=origin)
    encode = getattr(rule, "encode_check", None) or check_request_for("public", route, None)
    written = encode(authorization=authorization, internal_token=internal_token, peer=peer,
                     forwarded_for=forwarded_for, video_id=video_id, origin=origin)
    assert CheckRequest.model_validate_json(written) == expected


REPLY = ModelTemplate(CheckReply)


def fields(model: BaseModel) -> dict[str, object]:
    return {name: getattr(model, name) for name in type(model).model_fields}


@given(reply=REPLIES, bound=st.sets(st.sampled_from(list(CheckReply.model_fields))), raw=st.booleans())
@settings(max_examples=500, deadline=None)
def test_the_written_reply_is_the_model(reply: CheckReply, bound: set[str], raw: bool) -> None:
    values = fields(reply)
    if raw:  # what is not text, a boolean or an integer may come written already
        for name in ("identity", "headers", "problem"):
            values[name] = RawJson(TypeAdapter(CheckReply.model_fields[name].annotation).dump_json(values[name]))
    fixed = {name: values.pop(name) for name in bound}
    written = REPLY.bind(**fixed)(**values)
    assert CheckReply.model_validate_json(written) == reply
    assert written.endswith(b"}}")  # the headers last, for the edge's remembered decisions (authclient)


def test_a_field_the_model_does_not_have_is_refused() -> None:
    with pytest.raises(TypeError, match="no field"):
        REPLY.bind(allowed=True, verdict="yes")
    with pytest.raises(TypeError):
        REPLY.encode(allowed=True)  # every field not bound must be given
