"""Upload tokens: signing, verifying, and every way a token is garbled."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.upload_tokens import (
    MAX_CREDENTIAL_LENGTH,
    UploadTokenClaims,
    UploadTokenVerdict,
    sign_upload_token,
    upload_token_expires_at,
    verify_upload_token,
)
from tests.unit.authfixtures import DEFAULTS, SECRET, T0, signed_token

B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _signed(payload: bytes, secret: bytes = SECRET) -> str:
    """A token over any payload, signed the way the domain signs: for garbled-but-signed cases."""
    text = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    mac = hmac.new(secret, ("wut_" + text).encode(), hashlib.sha256).digest()
    return f"wut_{text}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def test_a_signed_upload_token_verifies_with_its_claims() -> None:
    check = verify_upload_token(SECRET, signed_token(), T0)
    assert check.verdict is UploadTokenVerdict.VALID and not check.rejected
    assert check.claims == UploadTokenClaims("video-1", "app-1", "key-1", int(T0) + 3600)
    assert check.token_id is not None and re.fullmatch(r"[0-9a-f]{32}", check.token_id)
    assert verify_upload_token(SECRET, signed_token(), T0).token_id == check.token_id
    assert verify_upload_token(SECRET, signed_token(int(T0) + 1), T0).token_id != check.token_id


def test_upload_token_expiry_follows_the_ttl_setting() -> None:
    expires = upload_token_expires_at(T0 + 0.9, DEFAULTS.upload_token_ttl_seconds)
    assert expires == int(T0) + DEFAULTS.upload_token_ttl_seconds
    token = signed_token(expires)
    assert verify_upload_token(SECRET, token, math.nextafter(expires, 0)).verdict is UploadTokenVerdict.VALID
    assert verify_upload_token(SECRET, token, expires - 0.001).verdict is UploadTokenVerdict.VALID


def test_an_expired_token_with_a_good_signature_is_refused_but_not_rejected() -> None:
    expires = int(T0)
    for now in (expires, expires + 0.001, expires + DEFAULTS.upload_token_ttl_seconds):
        check = verify_upload_token(SECRET, signed_token(expires), now)
        assert check.verdict is UploadTokenVerdict.EXPIRED and not check.rejected
        assert check.claims is not None and check.token_id is not None


def test_a_tampered_payload_fails_its_signature() -> None:
    token = signed_token()
    payload, signature = token[len("wut_") :].split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data["v"] = "video-2"
    forged_payload = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    check = verify_upload_token(SECRET, f"wut_{forged_payload}.{signature}", T0)
    assert check.verdict is UploadTokenVerdict.BAD_SIGNATURE and check.rejected and check.claims is None


def test_a_tampered_signature_fails() -> None:
    token = signed_token()
    head, signature = token.split(".")
    flipped = ("B" if signature[0] == "A" else "A") + signature[1:]
    check = verify_upload_token(SECRET, f"{head}.{flipped}", T0)
    assert check.verdict is UploadTokenVerdict.BAD_SIGNATURE and check.rejected


def test_a_token_from_another_secret_fails_even_when_expired() -> None:
    assert verify_upload_token(SECRET, signed_token(secret=b"other"), T0).verdict is UploadTokenVerdict.BAD_SIGNATURE
    old = signed_token(int(T0) - 10, secret=b"other")
    assert verify_upload_token(SECRET, old, T0).verdict is UploadTokenVerdict.BAD_SIGNATURE


def _garbled_cases() -> Iterator[tuple[str, str]]:
    token = signed_token()
    head, signature = token.split(".")
    yield "no-prefix", token[len("wut_") :]
    yield "no-dot", token.replace(".", "")
    yield "two-dots", token + ".x"
    yield "bad-base64-char", head + ".*" + signature[1:]
    yield "padding", token + "="
    yield "short-signature", f"{head}.{signature[:-4]}"
    # the last base64 character carries unused bits: another spelling of the same bytes must not be a second token
    twin = B64URL[B64URL.index(signature[-1]) + 1]
    yield "non-canonical-signature", f"{head}.{signature[:-1]}{twin}"
    yield "too-long", f"{head}{'A' * MAX_CREDENTIAL_LENGTH}.{signature}"
    yield "empty", ""
    yield "not-json", _signed(b"\xff\x00 not json")
    yield "json-list", _signed(b"[1,2]")
    yield "extra-claim", _signed(json.dumps({"v": "a", "a": "b", "k": "c", "e": 1, "x": 2}).encode())
    yield "missing-claim", _signed(json.dumps({"v": "a", "a": "b", "k": "c"}).encode())
    yield "bool-expiry", _signed(json.dumps({"v": "a", "a": "b", "k": "c", "e": True}).encode())
    yield "string-expiry", _signed(json.dumps({"v": "a", "a": "b", "k": "c", "e": "9"}).encode())
    yield "empty-video", _signed(json.dumps({"v": "", "a": "b", "k": "c", "e": 9}).encode())


@pytest.mark.parametrize(("name", "token"), list(_garbled_cases()))
def test_a_garbled_token_is_a_rejected_credential(name: str, token: str) -> None:
    check = verify_upload_token(SECRET, token, T0)
    assert check.verdict is UploadTokenVerdict.GARBLED, name
    assert check.rejected and check.claims is None


def test_non_canonical_base64_is_garbled_not_a_second_valid_token() -> None:
    token = signed_token()
    head, signature = token.split(".")
    variants = {f"{head}.{signature[:-1]}{c}" for c in B64URL}
    valid = [v for v in variants if verify_upload_token(SECRET, v, T0).verdict is UploadTokenVerdict.VALID]
    assert valid == [token]


def test_signing_needs_a_secret_and_every_id() -> None:
    with pytest.raises(ValueError):
        sign_upload_token(b"", "v", "a", "k", 1)
    with pytest.raises(ValueError):
        verify_upload_token(b"", signed_token(), T0)
    for ids in (("", "a", "k"), ("v", "", "k"), ("v", "a", "")):
        with pytest.raises(ValueError):
            sign_upload_token(SECRET, *ids, 1)


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40),
       st.integers(min_value=0, max_value=2**40))
def test_any_claims_round_trip(video: str, app: str, key: str, expires_at: int) -> None:
    """Any claims that fit a credential's length come back as signed; longer ones are refused at signing (JSON
    escapes a non-ASCII character into up to 12 bytes), never handed out as a token that would not verify."""
    try:
        token = sign_upload_token(SECRET, video, app, key, expires_at)
    except ValueError as exc:
        assert "longer than" in str(exc)
        assert len(json.dumps([video, app, key])) > MAX_CREDENTIAL_LENGTH // 2
        return
    check = verify_upload_token(SECRET, token, expires_at - 1)
    assert check.verdict is UploadTokenVerdict.VALID
    assert check.claims == UploadTokenClaims(video, app, key, expires_at)
