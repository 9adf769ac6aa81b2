"""Credential forms by shape, the internal token's verdict, and key material (SPEC section 2)."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.access import RejectionReason, malformed_credential
from services.auth.domain.credentials import (
    INTERNAL_TOKEN_HEADER,
    KEY_ALPHABET,
    KEY_BODY_LENGTH,
    KEY_PREFIXES,
    KEY_RANDOM_BYTES,
    FormKind,
    InternalToken,
    bearer_credential,
    classify_credential,
    constant_time_equal,
    judge_internal_token,
    key_hash,
    key_prefix,
    mint_key,
    read_credentials,
)
from services.auth.domain.upload_tokens import MAX_CREDENTIAL_LENGTH, sign_upload_token
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH
from tests.unit.authfixtures import HASH_SECRET, INTERNAL, SECRET, T0, rand_bytes

# --- credential forms -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KEY_PREFIXES))
def test_a_minted_key_is_its_prefix_and_32_base62_chars_and_classifies_as_its_kind(kind: FormKind) -> None:
    key = mint_key(kind, rand_bytes(1))
    assert key.startswith(KEY_PREFIXES[kind])
    body = key[len(KEY_PREFIXES[kind]) :]
    assert len(body) == KEY_BODY_LENGTH and set(body) <= set(KEY_ALPHABET)
    form = classify_credential(key)
    assert form.kind is kind and form.value == key


def test_mint_key_is_deterministic_in_its_random_bytes() -> None:
    assert mint_key(FormKind.SECRET_KEY, rand_bytes(1)) == mint_key(FormKind.SECRET_KEY, rand_bytes(1))
    keys = {mint_key(FormKind.SECRET_KEY, rand_bytes(i)) for i in range(200)}
    assert len(keys) == 200


def test_mint_key_refuses_too_few_random_bytes_and_kinds_that_are_not_minted() -> None:
    with pytest.raises(ValueError):
        mint_key(FormKind.SECRET_KEY, rand_bytes(1)[: KEY_RANDOM_BYTES - 1])
    for kind in (FormKind.UPLOAD_TOKEN, FormKind.MALFORMED, FormKind.NONE, FormKind.INTERNAL_TOKEN_CANDIDATE):
        with pytest.raises(ValueError):
            mint_key(kind, rand_bytes(1))


@given(st.binary(min_size=KEY_RANDOM_BYTES, max_size=KEY_RANDOM_BYTES * 2), st.sampled_from(list(KEY_PREFIXES)))
def test_every_minted_key_is_well_formed(rand: bytes, kind: FormKind) -> None:
    assert classify_credential(mint_key(kind, rand)).kind is kind


def _key_body() -> str:
    return mint_key(FormKind.SECRET_KEY, rand_bytes(7))[len(KEY_PREFIXES[FormKind.SECRET_KEY]) :]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(lambda b: b[:-1], id="one-short"),
        pytest.param(lambda b: b + "A", id="one-long"),
        pytest.param(lambda b: "", id="empty"),
        pytest.param(lambda b: b[:-1] + "-", id="dash"),
        pytest.param(lambda b: b[:-1] + "_", id="underscore"),
        pytest.param(lambda b: b[:-1] + "=", id="padding"),
        pytest.param(lambda b: b[:-1] + "é", id="non-ascii-letter"),
        pytest.param(lambda b: b[:-1] + "٣", id="non-ascii-digit"),
        pytest.param(lambda b: b[:16] + " " + b[17:], id="inner-space"),
    ],
)
@pytest.mark.parametrize("kind", list(KEY_PREFIXES))
def test_a_key_shaped_value_with_a_wrong_body_is_malformed(kind: FormKind, body: Callable[[str], str]) -> None:
    form = classify_credential(KEY_PREFIXES[kind] + body(_key_body()))
    assert form.kind is FormKind.MALFORMED
    assert form.looks_like == kind.value
    rejected = malformed_credential(form)
    assert rejected.reason is RejectionReason.MALFORMED and rejected.kind == kind.value
    assert rejected.key_prefix is not None and len(rejected.key_prefix) <= KEY_PREFIX_MAX_LENGTH


@pytest.mark.parametrize("raw", [None, "", "   ", "\t"])
def test_nothing_is_no_credential(raw: str | None) -> None:
    assert classify_credential(raw).kind is FormKind.NONE


@pytest.mark.parametrize("raw", ["WSK_" + "a" * KEY_BODY_LENGTH, "sk_live_abc", "x", "wsk", "Basic dXNlcjpwYXNz"])
def test_a_value_without_a_weir_prefix_is_an_internal_token_candidate(raw: str) -> None:
    form = classify_credential(raw)
    assert form.kind is FormKind.INTERNAL_TOKEN_CANDIDATE and form.looks_like == "internal_token"
    # a near miss of the internal token must not show any of it
    assert malformed_credential(form).key_prefix is None


def test_an_upload_token_is_classified_by_shape_and_a_misshapen_one_is_malformed() -> None:
    token = sign_upload_token(SECRET, "v", "a", "k", int(T0))
    assert classify_credential(token).kind is FormKind.UPLOAD_TOKEN
    too_long = token + "x" * MAX_CREDENTIAL_LENGTH
    for bad in ["wut_", "wut_abc", "wut_abc.", "wut_.abc", "wut_a.b.c", "wut_a+b.c", too_long]:
        form = classify_credential(bad)
        assert form.kind is FormKind.MALFORMED and form.looks_like == "upload_token", bad


def test_a_form_never_shows_its_secret_in_repr() -> None:
    key = mint_key(FormKind.SECRET_KEY, rand_bytes(3))
    assert key not in repr(classify_credential(key))


@pytest.mark.parametrize(
    ("header", "credential"),
    [
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer    ", None),
        ("Bearer wsk_x", "wsk_x"),
        ("bearer wsk_x", "wsk_x"),
        ("BEARER   wsk_x  ", "wsk_x"),
        ("Basic dXNlcjpwYXNz", "Basic dXNlcjpwYXNz"),
        ("wsk_x", "wsk_x"),
    ],
)
def test_bearer_credential(header: str | None, credential: str | None) -> None:
    assert bearer_credential(header) == credential


def test_read_credentials_judges_every_internal_token_candidate() -> None:
    key = mint_key(FormKind.SECRET_KEY, rand_bytes(4))
    cases = [
        (f"Bearer {key}", None, FormKind.SECRET_KEY, InternalToken.ABSENT),
        (f"Bearer {key}", "", FormKind.SECRET_KEY, InternalToken.ABSENT),
        (f"Bearer {key}", INTERNAL, FormKind.SECRET_KEY, InternalToken.REAL),
        (f"Bearer {key}", INTERNAL + "x", FormKind.SECRET_KEY, InternalToken.FORGED),
        (f"Bearer {INTERNAL}", None, FormKind.NONE, InternalToken.REAL),
        (f"Bearer {INTERNAL[:-1]}", None, FormKind.NONE, InternalToken.FORGED),
        (f"Bearer {INTERNAL}", INTERNAL, FormKind.NONE, InternalToken.REAL),
        (f"Bearer {INTERNAL}", "forged", FormKind.NONE, InternalToken.FORGED),
        ("Bearer forged", INTERNAL, FormKind.NONE, InternalToken.FORGED),
        ("Basic dXNlcjpwYXNz", None, FormKind.NONE, InternalToken.FORGED),
        (None, INTERNAL, FormKind.NONE, InternalToken.REAL),
        (None, None, FormKind.NONE, InternalToken.ABSENT),
    ]
    for authorization, header, kind, internal in cases:
        presented = read_credentials(authorization, header, INTERNAL)
        assert (presented.credential.kind, presented.internal) == (kind, internal), (authorization, header)


def test_an_unset_internal_token_accepts_nothing() -> None:
    assert judge_internal_token([""], "") is InternalToken.ABSENT
    assert judge_internal_token(["anything"], "") is InternalToken.FORGED
    assert read_credentials(None, "x", "").internal is InternalToken.FORGED


def test_the_internal_token_header_is_named() -> None:
    assert INTERNAL_TOKEN_HEADER.lower().startswith("x-weir-")


# --- keys -------------------------------------------------------------------------------------------------------------


def test_key_hash_is_hmac_sha256_hex_under_the_server_secret() -> None:
    key = mint_key(FormKind.SECRET_KEY, rand_bytes(5))
    digest = key_hash(HASH_SECRET, key)
    assert digest == hmac.new(HASH_SECRET, key.encode(), hashlib.sha256).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert digest != key_hash(HASH_SECRET + b"!", key)
    assert digest != key_hash(HASH_SECRET, mint_key(FormKind.SECRET_KEY, rand_bytes(6)))
    with pytest.raises(ValueError):
        key_hash(b"", key)


def test_key_prefix_is_the_catalogs_display_length() -> None:
    key = mint_key(FormKind.PUBLISHABLE_KEY, rand_bytes(8))
    assert key_prefix(key) == key[:KEY_PREFIX_MAX_LENGTH]
    assert key_prefix(key).startswith(KEY_PREFIXES[FormKind.PUBLISHABLE_KEY])


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [("abc", "abc", True), ("abc", "abd", False), ("abc", "abcd", False), ("", "", True), (b"x", "x", True),
     ("ø", "ø", True), ("ø", "o", False)],
)
def test_constant_time_equal(a: str | bytes, b: str | bytes, equal: bool) -> None:
    assert constant_time_equal(a, b) is equal
