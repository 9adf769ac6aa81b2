"""The api writes its `auth.check` request as JSON bytes itself; auth must read them as the same `CheckRequest`.

Header values reach the guard as latin-1 text (any byte), so every string is drawn from all 256 code points.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.api.guard import _route_fields, check_request_json
from shared.authcheck import CheckRequest
from tests.unit.apiapp import api_table

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
    fields = getattr(rule, "check_fields", None) or _route_fields("public", route, None)
    written = check_request_json(authorization=authorization, internal_token=internal_token, peer=peer,
                                 forwarded_for=forwarded_for, route_fields=fields, video_id=video_id,
                                 origin=origin)
    assert CheckRequest.model_validate_json(written) == expected
