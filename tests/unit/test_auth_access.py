"""What a credential amounts to, and which route classes refuse it and how (401 and 403)."""

from __future__ import annotations

import pytest

from services.auth.domain.access import (
    RejectedCredential,
    RejectionReason,
    RouteClass,
    UnusableReason,
    UnusableUploadToken,
    ValidUploadToken,
    credential_refusal,
    upload_token_outcome,
)
from services.auth.domain.credentials import InternalToken
from services.auth.domain.limits import decide, plan_counts
from services.auth.domain.rules import rules_from
from services.auth.domain.upload_tokens import UploadTokenCheck, UploadTokenVerdict, verify_upload_token
from tests.unit.authfixtures import (
    DEFAULTS,
    EXPIRED,
    FORBIDDEN,
    INVALID,
    MISSING,
    NOT_ALLOWED,
    OK,
    OUTCOMES,
    PUBLISHABLE_KEY,
    SECRET,
    T0,
    facts,
    signed_token,
)


def test_upload_token_outcomes() -> None:
    valid = verify_upload_token(SECRET, signed_token(), T0)
    expired = verify_upload_token(SECRET, signed_token(int(T0)), T0)
    assert isinstance(upload_token_outcome(valid, key_live=True), ValidUploadToken)
    revoked = upload_token_outcome(valid, key_live=False)
    assert isinstance(revoked, UnusableUploadToken) and revoked.reason is UnusableReason.KEY_REVOKED
    for live in (True, False):
        outcome = upload_token_outcome(expired, key_live=live)
        assert isinstance(outcome, UnusableUploadToken) and outcome.reason is UnusableReason.EXPIRED
    bad = upload_token_outcome(UploadTokenCheck(UploadTokenVerdict.BAD_SIGNATURE), key_live=True)
    assert bad == RejectedCredential("upload_token", RejectionReason.BAD_SIGNATURE)
    garbled = upload_token_outcome(UploadTokenCheck(UploadTokenVerdict.GARBLED), key_live=True)
    assert isinstance(garbled, RejectedCredential) and garbled.reason is RejectionReason.MALFORMED


# --- credential refusals ----------------------------------------------------------------------------------------------


# route -> outcome name -> (status, code), with the route's video where it has one
REFUSALS: dict[tuple[RouteClass, str | None], dict[str, tuple[int, str | None]]] = {
    (RouteClass.SECRET, None): {
        "none": MISSING, "secret_key": OK, "publishable_key": NOT_ALLOWED, "account_token": NOT_ALLOWED,
        "upload_token": NOT_ALLOWED, "expired_upload_token": NOT_ALLOWED, "revoked_upload_token": NOT_ALLOWED,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.SDK, None): {
        "none": MISSING, "secret_key": NOT_ALLOWED, "publishable_key": OK, "account_token": NOT_ALLOWED,
        "upload_token": NOT_ALLOWED, "expired_upload_token": EXPIRED, "revoked_upload_token": INVALID,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.SDK, "video-1"): {
        "none": MISSING, "secret_key": NOT_ALLOWED, "publishable_key": NOT_ALLOWED, "account_token": NOT_ALLOWED,
        "upload_token": OK, "expired_upload_token": EXPIRED, "revoked_upload_token": INVALID,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.SDK, "video-2"): {
        "none": MISSING, "secret_key": NOT_ALLOWED, "publishable_key": NOT_ALLOWED, "account_token": NOT_ALLOWED,
        "upload_token": FORBIDDEN, "expired_upload_token": EXPIRED, "revoked_upload_token": INVALID,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.MANAGEMENT, None): {
        "none": MISSING, "secret_key": NOT_ALLOWED, "publishable_key": NOT_ALLOWED, "account_token": OK,
        "upload_token": NOT_ALLOWED, "expired_upload_token": NOT_ALLOWED, "revoked_upload_token": NOT_ALLOWED,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.INTERNAL, None): {
        "none": MISSING, "secret_key": NOT_ALLOWED, "publishable_key": NOT_ALLOWED, "account_token": NOT_ALLOWED,
        "upload_token": NOT_ALLOWED, "expired_upload_token": NOT_ALLOWED, "revoked_upload_token": NOT_ALLOWED,
        "rejected_key": INVALID, "rejected_upload_token": INVALID,
    },
    (RouteClass.PUBLIC, None): dict.fromkeys(OUTCOMES, OK),
}


@pytest.mark.parametrize(
    ("route", "video", "name"),
    [(route, video, name) for (route, video) in REFUSALS for name in OUTCOMES],
)
@pytest.mark.parametrize("internal", list(InternalToken))
def test_credential_refusals(route: RouteClass, video: str | None, name: str, internal: InternalToken) -> None:
    expected = REFUSALS[(route, video)][name]
    if route is RouteClass.INTERNAL:
        # only the real internal token opens /internal; a forged one is a rejected credential there
        expected = {InternalToken.REAL: OK, InternalToken.FORGED: INVALID, InternalToken.ABSENT: expected}[internal]
    refusal = credential_refusal(facts(route, OUTCOMES[name], internal, video_id=video))
    assert ((refusal.status, refusal.code) if refusal else OK) == expected
    # the same through the whole decision, with budgets to spare
    rules = rules_from(DEFAULTS)
    plan = plan_counts(facts(route, OUTCOMES[name], internal, video_id=video), rules)
    decision = decide(plan, dict.fromkeys(plan.increments, 1) | dict.fromkeys(plan.reads, 0), T0)
    assert (decision.status, decision.code) == expected


def test_a_publishable_key_on_a_secret_route_is_told_so() -> None:
    refusal = credential_refusal(facts(RouteClass.SECRET, PUBLISHABLE_KEY))
    assert refusal is not None and refusal.detail == "publishable keys cannot be used on this route"


SPEC_CODES = {
    "missing_credential", "invalid_credential", "credential_not_allowed", "token_expired", "forbidden", "not_found",
    "conflict", "validation_error", "payload_too_large", "unsupported_file", "rate_limited", "unavailable",
}


def test_every_code_is_one_of_specs() -> None:
    for table in REFUSALS.values():
        for _, code in table.values():
            assert code is None or code in SPEC_CODES
