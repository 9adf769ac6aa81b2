"""The auth service's pure decisions (SPEC sections 2 and 3), exhaustively and without a server.

Every count is derived from the settings (the defaults, or a small set chosen here); no limit is repeated as a literal.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.auth.domain import (
    HOUR_SECONDS,
    INTERNAL_TOKEN_HEADER,
    KEY_ALPHABET,
    KEY_BODY_LENGTH,
    KEY_PREFIXES,
    KEY_RANDOM_BYTES,
    MAX_CREDENTIAL_LENGTH,
    PURGES_PER_HORIZON,
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    AppliedLimit,
    CounterKey,
    CountPlan,
    CredentialOutcome,
    Decision,
    FormKind,
    InternalToken,
    LocalWindows,
    ManagementOperation,
    NoCredential,
    RecentAcceptedKeys,
    RefusalMemory,
    RejectedCredential,
    RejectionReason,
    RequestFacts,
    RouteClass,
    Rule,
    RuleId,
    UnusableReason,
    UnusableUploadToken,
    UploadTokenCheck,
    UploadTokenClaims,
    UploadTokenVerdict,
    ValidUploadToken,
    WindowsAt,
    bearer_credential,
    classify_credential,
    client_address,
    constant_time_equal,
    counter_subject,
    credential_refusal,
    decide,
    judge_internal_token,
    key_hash,
    key_prefix,
    malformed_credential,
    mint_key,
    parse_address,
    parse_trusted_proxies,
    plan_counts,
    rate_limit_headers,
    read_credentials,
    refusal_from_memory,
    rejections,
    retry_after,
    rules_from,
    seconds_until,
    sign_upload_token,
    subject_token,
    subject_value,
    tightest,
    upload_token_expires_at,
    upload_token_outcome,
    verify_upload_token,
    window_end,
    window_start,
)
from services.auth.settings import AuthSettings
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH

DEFAULTS = AuthSettings()
# small and pairwise different, so that a test cannot pass by confusing one rule with another
SMALL = AuthSettings(
    limit_address_per_minute=7,
    limit_auth_failure_per_minute=3,
    limit_key_per_minute=5,
    limit_owner_per_minute=12,
    limit_upload_token_per_minute=6,
    limit_app_create_per_hour=2,
    limit_key_rotate_per_hour=4,
    limit_window_seconds=60,
    upload_token_ttl_seconds=120,
)
BOTH = pytest.mark.parametrize("cfg", [DEFAULTS, SMALL], ids=["defaults", "small"])

WINDOW = SMALL.limit_window_seconds
# a moment on which every window (the minute rules' and the hour rules') starts
T0 = float(math.lcm(WINDOW, HOUR_SECONDS, DEFAULTS.limit_window_seconds) * 600_000)

ADDRESS = "203.0.113.7"
OTHER_ADDRESS = "198.51.100.9"
SECRET = b"upload-token-signing-secret"
HASH_SECRET = b"key-hash-secret"
INTERNAL = "internal-token-0123456789abcdefghijklmnopqrstuvwxyz"


def rand_bytes(seed: int) -> bytes:
    return hashlib.sha256(seed.to_bytes(8, "big")).digest()[:KEY_RANDOM_BYTES]


def claims(video: str = "video-1", expires_at: int | None = None) -> UploadTokenClaims:
    return UploadTokenClaims(video, "app-1", "key-1", int(T0) + 3600 if expires_at is None else expires_at)


SECRET_KEY = AcceptedSecretKey("key-1", "acct-1", "app-1")
PUBLISHABLE_KEY = AcceptedPublishableKey("key-2", "acct-1", "app-1")
ACCOUNT_TOKEN = AcceptedAccountToken("user-1", "acct-1")
UPLOAD_TOKEN = ValidUploadToken("tok-1", claims())
EXPIRED_TOKEN = UnusableUploadToken("tok-2", claims(), UnusableReason.EXPIRED)
REVOKED_TOKEN = UnusableUploadToken("tok-3", claims(), UnusableReason.KEY_REVOKED)
REJECTED_KEY = RejectedCredential("secret_key", RejectionReason.UNKNOWN, "wsk_abcdefgh")
REJECTED_TOKEN = RejectedCredential("upload_token", RejectionReason.BAD_SIGNATURE)

OUTCOMES: dict[str, CredentialOutcome] = {
    "none": NoCredential(),
    "secret_key": SECRET_KEY,
    "publishable_key": PUBLISHABLE_KEY,
    "account_token": ACCOUNT_TOKEN,
    "upload_token": UPLOAD_TOKEN,
    "expired_upload_token": EXPIRED_TOKEN,
    "revoked_upload_token": REVOKED_TOKEN,
    "rejected_key": REJECTED_KEY,
    "rejected_upload_token": REJECTED_TOKEN,
}


# --- a whole instance, as the service will wire it: memory, store (local windows here), recent keys -------------


class Instance:
    def __init__(self, cfg: AuthSettings, *, use_memory: bool = True) -> None:
        self.rules = rules_from(cfg)
        self.store = LocalWindows()
        self.memory = RefusalMemory()
        self.recent = RecentAcceptedKeys(cfg.limit_window_seconds)
        self.use_memory = use_memory
        self.store_calls = 0

    def check(self, facts: RequestFacts, now: float) -> Decision:
        if isinstance(facts.credential, AcceptedSecretKey):
            recent = self.recent.accepted_within(facts.address, facts.credential.key_id, now)
            facts = replace(facts, recently_accepted_key=recent)
        plan = plan_counts(facts, self.rules)
        if self.use_memory:
            remembered = refusal_from_memory(plan, self.memory, now)
            if remembered is not None:
                return remembered
        self.store_calls += 1
        decision = decide(plan, self.store.count(plan, now), now)
        self.memory.remember_decision(decision, now)
        if decision.accepted_key_id is not None:
            self.recent.record(facts.address, decision.accepted_key_id, now)
        return decision


def facts(
    route: RouteClass = RouteClass.PUBLIC,
    credential: CredentialOutcome | None = None,
    internal: InternalToken = InternalToken.ABSENT,
    address: str = ADDRESS,
    **kw: object,
) -> RequestFacts:
    return RequestFacts(route, address, credential or NoCredential(), internal, **kw)  # type: ignore[arg-type]


def statuses(decisions: list[Decision]) -> list[int]:
    return [d.status for d in decisions]


# --- credential forms ----------------------------------------------------------------------------------------------


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


# --- key material --------------------------------------------------------------------------------------------------


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


# --- upload tokens -------------------------------------------------------------------------------------------------


B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _token(expires_at: int | None = None, secret: bytes = SECRET) -> str:
    return sign_upload_token(secret, "video-1", "app-1", "key-1", int(T0) + 3600 if expires_at is None else expires_at)


def _signed(payload: bytes, secret: bytes = SECRET) -> str:
    """A token over any payload, signed the way the domain signs: for garbled-but-signed cases."""
    text = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    mac = hmac.new(secret, ("wut_" + text).encode(), hashlib.sha256).digest()
    return f"wut_{text}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def test_a_signed_upload_token_verifies_with_its_claims() -> None:
    check = verify_upload_token(SECRET, _token(), T0)
    assert check.verdict is UploadTokenVerdict.VALID and not check.rejected
    assert check.claims == UploadTokenClaims("video-1", "app-1", "key-1", int(T0) + 3600)
    assert check.token_id is not None and re.fullmatch(r"[0-9a-f]{32}", check.token_id)
    assert verify_upload_token(SECRET, _token(), T0).token_id == check.token_id
    assert verify_upload_token(SECRET, _token(int(T0) + 1), T0).token_id != check.token_id


def test_upload_token_expiry_follows_the_ttl_setting() -> None:
    expires = upload_token_expires_at(T0 + 0.9, DEFAULTS.upload_token_ttl_seconds)
    assert expires == int(T0) + DEFAULTS.upload_token_ttl_seconds
    token = _token(expires)
    assert verify_upload_token(SECRET, token, math.nextafter(expires, 0)).verdict is UploadTokenVerdict.VALID
    assert verify_upload_token(SECRET, token, expires - 0.001).verdict is UploadTokenVerdict.VALID


def test_an_expired_token_with_a_good_signature_is_refused_but_not_rejected() -> None:
    expires = int(T0)
    for now in (expires, expires + 0.001, expires + DEFAULTS.upload_token_ttl_seconds):
        check = verify_upload_token(SECRET, _token(expires), now)
        assert check.verdict is UploadTokenVerdict.EXPIRED and not check.rejected
        assert check.claims is not None and check.token_id is not None


def test_a_tampered_payload_fails_its_signature() -> None:
    token = _token()
    payload, signature = token[len("wut_") :].split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data["v"] = "video-2"
    forged_payload = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    check = verify_upload_token(SECRET, f"wut_{forged_payload}.{signature}", T0)
    assert check.verdict is UploadTokenVerdict.BAD_SIGNATURE and check.rejected and check.claims is None


def test_a_tampered_signature_fails() -> None:
    token = _token()
    head, signature = token.split(".")
    flipped = ("B" if signature[0] == "A" else "A") + signature[1:]
    check = verify_upload_token(SECRET, f"{head}.{flipped}", T0)
    assert check.verdict is UploadTokenVerdict.BAD_SIGNATURE and check.rejected


def test_a_token_from_another_secret_fails_even_when_expired() -> None:
    assert verify_upload_token(SECRET, _token(secret=b"other"), T0).verdict is UploadTokenVerdict.BAD_SIGNATURE
    old = _token(int(T0) - 10, secret=b"other")
    assert verify_upload_token(SECRET, old, T0).verdict is UploadTokenVerdict.BAD_SIGNATURE


def _garbled_cases() -> Iterator[tuple[str, str]]:
    token = _token()
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
    token = _token()
    head, signature = token.split(".")
    variants = {f"{head}.{signature[:-1]}{c}" for c in B64URL}
    valid = [v for v in variants if verify_upload_token(SECRET, v, T0).verdict is UploadTokenVerdict.VALID]
    assert valid == [token]


def test_signing_needs_a_secret_and_every_id() -> None:
    with pytest.raises(ValueError):
        sign_upload_token(b"", "v", "a", "k", 1)
    with pytest.raises(ValueError):
        verify_upload_token(b"", _token(), T0)
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


def test_upload_token_outcomes() -> None:
    valid = verify_upload_token(SECRET, _token(), T0)
    expired = verify_upload_token(SECRET, _token(int(T0)), T0)
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


# --- client address ------------------------------------------------------------------------------------------------

PROXIES = parse_trusted_proxies("10.0.0.0/8, 2001:db8:ffff::/48")


@pytest.mark.parametrize(
    "forwarded_for",
    [None, "", "1.1.1.1", "1.1.1.1, 10.0.0.1", "10.0.0.1", "2001:db8::1", "garbage", "1.1.1.1,,,", ADDRESS],
)
def test_an_untrusted_peer_is_the_address_whatever_it_forwards(forwarded_for: str | None) -> None:
    assert client_address("192.0.2.33", forwarded_for, PROXIES) == "192.0.2.33"
    assert client_address("192.0.2.33", forwarded_for, ()) == "192.0.2.33"


@pytest.mark.parametrize(
    ("forwarded_for", "expected"),
    [
        ("192.0.2.1", "192.0.2.1"),
        ("192.0.2.1, 10.1.2.3", "192.0.2.1"),
        ("192.0.2.1,10.1.2.3,10.9.9.9", "192.0.2.1"),
        ("6.6.6.6, 192.0.2.1", "192.0.2.1"),  # a spoofed leftmost entry
        ("6.6.6.6, 7.7.7.7, 192.0.2.1, 10.1.2.3", "192.0.2.1"),
        ("10.1.1.1, 10.2.2.2", "10.1.1.1"),  # every hop trusted: the leftmost
        ("6.6.6.6, garbage, 10.1.2.3", "10.1.2.3"),  # unreadable hop: the nearest known one, never left of it
        ("6.6.6.6, unknown", "10.0.0.2"),
        ("6.6.6.6, ", "10.0.0.2"),
        ("   ", "10.0.0.2"),
        ("", "10.0.0.2"),
        (None, "10.0.0.2"),
        ("192.0.2.1:5555", "192.0.2.1"),
        ('"192.0.2.1"', "192.0.2.1"),
        ("[2001:db8:1:2::99]:443", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:aaaa::1, 2001:db8:ffff::7", "2001:db8:1:2::/64"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("::ffff:10.1.1.1", "10.1.1.1"),  # mapped: trusted like its IPv4, and the only hop
    ],
)
def test_a_trusted_peer_forwards_the_rightmost_untrusted_hop(forwarded_for: str | None, expected: str) -> None:
    assert client_address("10.0.0.2", forwarded_for, PROXIES) == expected


def test_ipv6_clients_are_their_64_and_ipv4_the_full_address() -> None:
    assert client_address("2001:db8:1:2:3:4:5:6", None, ()) == "2001:db8:1:2::/64"
    assert client_address("2001:db8:1:2:ffff::", None, ()) == client_address("2001:db8:1:2::1", None, ())
    assert client_address("2001:db8:1:3::1", None, ()) != client_address("2001:db8:1:2::1", None, ())
    assert client_address("fe80::1%eth0", None, ()) == "fe80::/64"
    assert client_address("192.0.2.1", None, ()) != client_address("192.0.2.2", None, ())


def test_ipv4_mapped_peers_are_ipv4_for_trust_and_for_the_address() -> None:
    assert client_address("::ffff:192.0.2.1", None, ()) == "192.0.2.1"
    assert client_address("::ffff:10.0.0.2", "192.0.2.1", PROXIES) == "192.0.2.1"


def test_an_unreadable_peer_is_kept_as_given() -> None:
    assert client_address("testclient", "192.0.2.1", PROXIES) == "testclient"
    assert client_address("", None, PROXIES) == "unknown"


def test_parse_trusted_proxies() -> None:
    assert parse_trusted_proxies("") == ()
    assert parse_trusted_proxies("  ") == ()
    nets = parse_trusted_proxies("10.0.0.1, 172.16.0.0/12 2001:db8::/32,::ffff:192.0.2.9,10.1.2.3/8")
    assert nets == (
        ipaddress.ip_network("10.0.0.1/32"),
        ipaddress.ip_network("172.16.0.0/12"),
        ipaddress.ip_network("2001:db8::/32"),
        ipaddress.ip_network("192.0.2.9/32"),
        ipaddress.ip_network("10.0.0.0/8"),
    )
    for bad in ("10.0.0.0/33", "proxy.internal", "10.0.0.1, nope"):
        with pytest.raises(ValueError, match="WEIR_TRUSTED_PROXIES"):
            parse_trusted_proxies(bad)


def test_parse_address_forms() -> None:
    assert parse_address("[2001:db8::1]") == ipaddress.ip_address("2001:db8::1")
    for bad in ("[2001:db8::1", "[::1]x", "[::1]:", "1.2.3.4:", "1.2.3.4:http", "999.1.1.1", "", "a,b"):
        assert parse_address(bad) is None, bad


_untrusted_v4 = st.ip_addresses(v=4).filter(lambda a: not any(a in n for n in PROXIES))
_trusted_v4 = st.integers(min_value=0, max_value=2**24 - 1).map(lambda i: ipaddress.IPv4Address((10 << 24) + i))


@given(_untrusted_v4, st.text(max_size=200))
def test_an_untrusted_peer_never_yields_an_address_from_the_header(peer: ipaddress.IPv4Address, xff: str) -> None:
    assert client_address(str(peer), xff, PROXIES) == str(peer)


@given(st.text(max_size=200), _untrusted_v4, st.lists(_trusted_v4, max_size=4), _trusted_v4)
def test_a_client_can_never_pick_its_own_address(
    client_words: str, real: ipaddress.IPv4Address, hops: list[ipaddress.IPv4Address], peer: ipaddress.IPv4Address
) -> None:
    # whatever the client wrote, each trusted proxy appended the address it saw
    xff = ", ".join([client_words, str(real), *map(str, hops)])
    assert client_address(str(peer), xff, PROXIES) == str(real)


# --- windows -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [WINDOW, HOUR_SECONDS])
def test_windows_are_aligned_to_the_clock(seconds: int) -> None:
    boundary = T0 + seconds
    assert window_start(boundary, seconds) == boundary
    assert window_start(math.nextafter(boundary, 0), seconds) == T0
    assert window_start(boundary - 0.001, seconds) == T0
    assert window_end(T0, seconds) == boundary
    assert window_end(math.nextafter(boundary, 0), seconds) == boundary
    assert window_end(boundary, seconds) == boundary + seconds


@pytest.mark.parametrize("seconds", [WINDOW, HOUR_SECONDS])
def test_retry_after_is_whole_seconds_to_the_window_end_rounded_up(seconds: int) -> None:
    assert retry_after(T0, seconds) == seconds
    assert retry_after(T0 + 0.5, seconds) == seconds
    assert retry_after(T0 + 1, seconds) == seconds - 1
    assert retry_after(T0 + seconds - 1, seconds) == 1
    assert retry_after(T0 + seconds - 0.001, seconds) == 1
    assert retry_after(math.nextafter(T0 + seconds, 0), seconds) == 1
    assert retry_after(T0 + seconds, seconds) == seconds


def test_a_window_must_last() -> None:
    with pytest.raises(ValueError):
        window_start(T0, 0)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.sampled_from([1, 7, WINDOW, HOUR_SECONDS]))
def test_window_properties(now: float, seconds: int) -> None:
    start = window_start(now, seconds)
    assert start <= now < start + seconds and start % seconds == 0
    assert 1 <= retry_after(now, seconds) <= seconds
    assert now + retry_after(now, seconds) >= window_end(now, seconds)


# --- rules and subjects --------------------------------------------------------------------------------------------


@BOTH
def test_rules_come_from_the_settings(cfg: AuthSettings) -> None:
    rules = rules_from(cfg)
    assert list(rules) == list(RuleId)
    assert [r.value for r in RuleId] == [
        "address", "auth_failure", "key", "owner", "upload_token", "app_create", "key_rotate"
    ]
    expected = {
        RuleId.ADDRESS: (cfg.limit_address_per_minute, cfg.limit_window_seconds),
        RuleId.AUTH_FAILURE: (cfg.limit_auth_failure_per_minute, cfg.limit_window_seconds),
        RuleId.KEY: (cfg.limit_key_per_minute, cfg.limit_window_seconds),
        RuleId.OWNER: (cfg.limit_owner_per_minute, cfg.limit_window_seconds),
        RuleId.UPLOAD_TOKEN: (cfg.limit_upload_token_per_minute, cfg.limit_window_seconds),
        RuleId.APP_CREATE: (cfg.limit_app_create_per_hour, HOUR_SECONDS),
        RuleId.KEY_ROTATE: (cfg.limit_key_rotate_per_hour, HOUR_SECONDS),
    }
    assert {rid: (r.limit, r.window_seconds) for rid, r in rules.items()} == expected
    assert all(r.id is rid for rid, r in rules.items())


_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


@pytest.mark.parametrize(
    "value",
    ["0190e3c1-7b7a-7c6e-9a53-8d7f1c2b3a4d", "key-1", ADDRESS, "2001:db8:1:2::/64", "a.b", "*", ">", "x y", "_x"],
)
def test_subject_tokens_are_safe_and_reversible(value: str) -> None:
    token = subject_token(value)
    assert _SUBJECT_TOKEN.fullmatch(token)
    assert subject_value(token) == value


def test_ids_stay_readable_in_subjects_and_addresses_are_encoded() -> None:
    assert subject_token("key-1") == "key-1"
    assert subject_token(ADDRESS).startswith("_")


@given(st.text(min_size=1, max_size=80))
def test_every_value_has_a_safe_distinct_token(value: str) -> None:
    token = subject_token(value)
    assert _SUBJECT_TOKEN.fullmatch(token)
    assert subject_value(token) == value


def test_counter_subject() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    key = CounterKey.of(rule, ADDRESS)
    start = key.window_start(T0 + 1)
    subject = counter_subject("weir.limits", key, start)
    assert subject == f"weir.limits.address.{subject_token(ADDRESS)}.{int(T0)}"
    assert not any(ch in subject for ch in " *>")
    for bad in ("", "a.", ".a", "a.*", "a b", "a.>"):
        with pytest.raises(ValueError):
            counter_subject(bad, key, start)


# --- the plan: every credential outcome x internal token x route x operation --------------------------------------


def _carried(f: RequestFacts) -> bool:
    return f.internal is InternalToken.REAL or isinstance(f.credential, AcceptedSecretKey | ValidUploadToken)


def _rejected(f: RequestFacts) -> bool:
    return isinstance(f.credential, RejectedCredential) or f.internal is InternalToken.FORGED


MATRIX = [
    pytest.param(route, name, internal, operation, recent, id=f"{route}-{name}-{internal}-{operation}-{recent}")
    for route, name, internal, operation, recent in itertools.product(
        list(RouteClass), list(OUTCOMES), list(InternalToken), [None, *ManagementOperation], [False, True]
    )
]


@pytest.mark.parametrize(("route", "name", "internal", "operation", "recent"), MATRIX)
def test_the_plan_matrix(
    route: RouteClass, name: str, internal: InternalToken, operation: ManagementOperation | None, recent: bool
) -> None:
    rules = rules_from(SMALL)
    f = facts(route, OUTCOMES[name], internal, operation=operation, recently_accepted_key=recent, video_id="video-1")
    plan = plan_counts(f, rules)
    counted = {key.rule.id for key in plan.increments}

    assert len(plan.increments) == len(set(plan.increments)) == len(counted), "each budget at most once"
    assert (RuleId.ADDRESS in counted) is not _carried(f)
    if internal is InternalToken.REAL:
        assert RuleId.ADDRESS not in counted
    assert (RuleId.AUTH_FAILURE in counted) is _rejected(f)
    assert ({RuleId.KEY, RuleId.OWNER} <= counted) is isinstance(f.credential, AcceptedSecretKey)
    assert ({RuleId.KEY, RuleId.OWNER} & counted == set()) is not isinstance(f.credential, AcceptedSecretKey)
    if isinstance(f.credential, RejectedCredential):
        assert not counted & {RuleId.KEY, RuleId.OWNER, RuleId.UPLOAD_TOKEN, RuleId.APP_CREATE, RuleId.KEY_ROTATE}
    assert (RuleId.UPLOAD_TOKEN in counted) is isinstance(f.credential, ValidUploadToken)
    manages = isinstance(f.credential, AcceptedAccountToken) and route is RouteClass.MANAGEMENT
    assert (RuleId.APP_CREATE in counted) is (manages and operation is ManagementOperation.APP_CREATE)
    assert (RuleId.KEY_ROTATE in counted) is (manages and operation is ManagementOperation.KEY_ROTATE)

    exempt = internal is InternalToken.REAL or (isinstance(f.credential, AcceptedSecretKey) and recent)
    assert (plan.block_check is None) is exempt
    if plan.block_check is not None:
        assert plan.block_check == CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS)
        assert plan.reads == (() if RuleId.AUTH_FAILURE in counted else (plan.block_check,))
    assert len(rejections(f)) == int(isinstance(f.credential, RejectedCredential)) + int(
        internal is InternalToken.FORGED
    )


def test_the_plan_keys_each_budget_by_its_subject() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY, InternalToken.FORGED), rules)
    assert set(plan.increments) == {
        CounterKey.of(rules[RuleId.KEY], SECRET_KEY.key_id),
        CounterKey.of(rules[RuleId.OWNER], SECRET_KEY.account_id),
        CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS),
    }
    plan = plan_counts(facts(RouteClass.SDK, UPLOAD_TOKEN), rules)
    assert plan.increments == (CounterKey.of(rules[RuleId.UPLOAD_TOKEN], UPLOAD_TOKEN.token_id),)
    plan = plan_counts(facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE), rules)
    assert set(plan.increments) == {
        CounterKey.of(rules[RuleId.ADDRESS], ADDRESS),
        CounterKey.of(rules[RuleId.APP_CREATE], ACCOUNT_TOKEN.user_id),
    }
    assert plan_counts(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), rules).increments == ()


# --- credential refusals -------------------------------------------------------------------------------------------

OK = (200, None)
MISSING = (401, "missing_credential")
INVALID = (401, "invalid_credential")
NOT_ALLOWED = (401, "credential_not_allowed")
EXPIRED = (401, "token_expired")
FORBIDDEN = (403, "forbidden")

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


# --- limits, rule by rule, through a whole instance ----------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    rule: RuleId
    request: Callable[[int], RequestFacts]
    """The i-th request of a flood on this rule's budget."""
    within_status: int
    """What a request within budget gets (401 for the rejected credentials that spend auth_failure)."""


SCENARIOS = [
    Scenario(RuleId.ADDRESS, lambda i: facts(RouteClass.PUBLIC), 200),
    Scenario(RuleId.AUTH_FAILURE, lambda i: facts(RouteClass.SECRET, REJECTED_KEY), 401),
    Scenario(RuleId.KEY, lambda i: facts(RouteClass.SECRET, SECRET_KEY), 200),
    Scenario(RuleId.UPLOAD_TOKEN, lambda i: facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"), 200),
    Scenario(
        RuleId.APP_CREATE,
        lambda i: facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE,
                        address=f"192.0.2.{i % 250}"),
        200,
    ),
    Scenario(
        RuleId.KEY_ROTATE,
        lambda i: facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.KEY_ROTATE,
                        address=f"192.0.2.{i % 250}"),
        200,
    ),
    Scenario(
        RuleId.OWNER,
        # a new key of the same account every time: no key budget binds, only the account's
        lambda i: facts(RouteClass.SECRET, AcceptedSecretKey(f"key-{i}", "acct-1", "app-1")),
        200,
    ),
]


def _limit_for(cfg: AuthSettings, scenario: Scenario) -> Rule:
    return rules_from(cfg)[scenario.rule]


@BOTH
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.rule.value for s in SCENARIOS])
def test_each_rule_admits_exactly_its_limit_in_a_window(cfg: AuthSettings, scenario: Scenario) -> None:
    rule = _limit_for(cfg, scenario)
    instance = Instance(cfg)
    now = T0 + 0.25
    within = [instance.check(scenario.request(i), now) for i in range(rule.limit)]
    assert set(statuses(within)) == {scenario.within_status}
    refused = instance.check(scenario.request(rule.limit), now)
    assert refused.status == 429 and refused.code == "rate_limited"
    assert refused.refused_by == rule
    assert refused.retry_after == retry_after(now, rule.window_seconds) == refused.applied.reset  # type: ignore[union-attr]
    assert refused.headers()["Retry-After"] == str(refused.retry_after)
    # refused for the rest of the window, answered without the store
    calls = instance.store_calls
    last = math.nextafter(T0 + rule.window_seconds, 0)
    assert instance.check(scenario.request(rule.limit + 1), last).status == 429
    assert instance.store_calls == calls
    # and the next window starts afresh
    assert instance.check(scenario.request(rule.limit + 2), T0 + rule.window_seconds).status == scenario.within_status


@BOTH
def test_remaining_counts_down_to_zero_and_never_below(cfg: AuthSettings) -> None:
    rule = rules_from(cfg)[RuleId.KEY]
    instance = Instance(cfg, use_memory=False)
    remaining = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0).headers()["X-RateLimit-Remaining"]
                 for _ in range(rule.limit + 3)]
    assert [int(r) for r in remaining] == [*range(rule.limit - 1, -1, -1), 0, 0, 0]


@BOTH
def test_an_account_is_held_to_the_owner_limit_over_many_keys(cfg: AuthSettings) -> None:
    rules = rules_from(cfg)
    key_limit, owner_limit = rules[RuleId.KEY].limit, rules[RuleId.OWNER].limit
    keys = owner_limit // key_limit + 1  # enough keys that, each under its own limit, they pass the account's
    assert keys * key_limit > owner_limit
    instance = Instance(cfg)
    admitted: dict[str, int] = dict.fromkeys((f"key-{k}" for k in range(keys)), 0)
    refused_by: set[RuleId] = set()
    for i in range(keys * key_limit):
        key_id = f"key-{i % keys}"
        decision = instance.check(facts(RouteClass.SECRET, AcceptedSecretKey(key_id, "acct-1", "app-1")), T0)
        if decision.allowed:
            admitted[key_id] += 1
        else:
            assert decision.refused_by is not None
            refused_by.add(decision.refused_by.id)
    assert sum(admitted.values()) == owner_limit
    assert all(n <= key_limit for n in admitted.values())
    assert refused_by == {RuleId.OWNER}
    # another account is untouched
    assert instance.check(facts(RouteClass.SECRET, AcceptedSecretKey("key-x", "acct-2", "app-2")), T0).allowed


@BOTH
def test_rejected_credentials_leave_the_keys_and_the_accounts_remaining_unchanged(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    before = instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0)
    # near misses of the very key, garbled upload tokens and forged internal tokens, up to the block and beyond
    near_miss = RejectedCredential("secret_key", RejectionReason.UNKNOWN, key_prefix("wsk_" + "a" * KEY_BODY_LENGTH))
    for _ in range(cfg.limit_auth_failure_per_minute * 2):
        instance.check(facts(RouteClass.SECRET, near_miss), T0)
        instance.check(facts(RouteClass.SDK, REJECTED_TOKEN, video_id="video-1"), T0)
        instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.FORGED), T0)
    rules = rules_from(cfg)
    assert instance.store.peek(CounterKey.of(rules[RuleId.KEY], SECRET_KEY.key_id), int(T0)) == 1
    assert instance.store.peek(CounterKey.of(rules[RuleId.OWNER], SECRET_KEY.account_id), int(T0)) == 1
    after = instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0)
    assert before.applied is not None and after.applied is not None
    assert after.applied.remaining == before.applied.remaining - 1


# --- the auth_failure block ----------------------------------------------------------------------------------------


def _spend_auth_failures(instance: Instance, cfg: AuthSettings, now: float, address: str = ADDRESS) -> None:
    for _ in range(cfg.limit_auth_failure_per_minute):
        assert instance.check(facts(RouteClass.SECRET, REJECTED_KEY, address=address), now).status == 401


@BOTH
def test_past_auth_failure_every_request_from_the_address_waits_for_the_window_end(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    now = T0 + 10.5
    _spend_auth_failures(instance, cfg, now)
    others = [
        facts(RouteClass.PUBLIC),
        facts(RouteClass.SECRET),
        facts(RouteClass.SECRET, REJECTED_KEY),
        facts(RouteClass.SECRET, SECRET_KEY),  # a key not accepted here before the block
        facts(RouteClass.SDK, PUBLISHABLE_KEY),
        facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"),
        facts(RouteClass.SDK, EXPIRED_TOKEN, video_id="video-1"),
        facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN),
        facts(RouteClass.INTERNAL, internal=InternalToken.FORGED),
    ]
    for f in others:
        d = instance.check(f, now)
        assert (d.status, d.refused_by) == (429, rules_from(cfg)[RuleId.AUTH_FAILURE]), f
        assert d.retry_after == retry_after(now, cfg.limit_window_seconds)
        assert d.problem() is not None and d.problem()["rule"] == "auth_failure"  # type: ignore[index]
    # another address is not affected, and the window's end lifts the block
    assert instance.check(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS), now).allowed
    assert all(instance.check(f, T0 + cfg.limit_window_seconds).status != 429 for f in others)


@BOTH
def test_the_block_starts_after_exactly_the_limit_of_rejections(cfg: AuthSettings) -> None:
    # with the store read only: a fresh instance per request has no memory of refusals
    store = LocalWindows()
    rules = rules_from(cfg)

    def check(f: RequestFacts) -> Decision:
        plan = plan_counts(f, rules)
        return decide(plan, store.count(plan, T0), T0)

    for _ in range(cfg.limit_auth_failure_per_minute - 1):
        assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 401
        assert check(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS)).allowed
    assert check(facts(RouteClass.PUBLIC)).allowed
    assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 401  # the limit-th rejection is still answered
    assert check(facts(RouteClass.PUBLIC)).status == 429
    assert check(facts(RouteClass.SECRET, REJECTED_KEY)).status == 429


@BOTH
def test_a_key_accepted_here_within_the_last_window_passes_the_block(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    accepted_at = T0 + 1
    assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), accepted_at).allowed
    _spend_auth_failures(instance, cfg, T0 + 2)
    assert instance.check(facts(RouteClass.PUBLIC), T0 + 3).status == 429
    decision = instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 3)
    assert decision.allowed and decision.applied is not None and decision.applied.rule.id is RuleId.KEY
    # another key of the account, or the same key from another blocked address: no exemption
    other_key = AcceptedSecretKey("key-9", SECRET_KEY.account_id, SECRET_KEY.app_id)
    assert instance.check(facts(RouteClass.SECRET, other_key), T0 + 3).status == 429
    _spend_auth_failures(instance, cfg, T0 + 3, OTHER_ADDRESS)
    assert instance.check(facts(RouteClass.SECRET, SECRET_KEY, address=OTHER_ADDRESS), T0 + 4).status == 429


def test_the_recent_key_exemption_lasts_one_window_from_the_last_acceptance() -> None:
    window = SMALL.limit_window_seconds
    for asked_at, expected in ((T0 + window + 0.5, 200), (T0 + window + 1, 429)):
        instance = Instance(SMALL)
        assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 1).allowed
        _spend_auth_failures(instance, SMALL, T0 + window)  # the next window: the address is blocked
        assert instance.check(facts(RouteClass.SECRET, SECRET_KEY), asked_at).status == expected, asked_at


@BOTH
def test_the_real_internal_token_always_passes_the_block(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    _spend_auth_failures(instance, cfg, T0)
    assert instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0).allowed
    # even beside a rejected credential, it is not held by the block (the route still refuses the bad key)
    d = instance.check(facts(RouteClass.SECRET, REJECTED_KEY, InternalToken.REAL), T0)
    assert (d.status, d.code) == INVALID


def test_a_skipped_block_read_means_not_blocked() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.PUBLIC), rules)
    assert plan.reads
    assert decide(plan, dict.fromkeys(plan.increments, 1), T0).allowed
    blocked = {**dict.fromkeys(plan.increments, 1), plan.reads[0]: SMALL.limit_auth_failure_per_minute}
    assert decide(plan, blocked, T0).status == 429


def test_a_count_missing_for_an_increment_is_an_error() -> None:
    plan = plan_counts(facts(RouteClass.PUBLIC), rules_from(SMALL))
    with pytest.raises(ValueError):
        decide(plan, {}, T0)


# --- the post-mortem's three, with the address limit small -----------------------------------------------------


@BOTH
def test_the_internal_token_never_counts_against_the_address(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    many = rules_from(cfg)[RuleId.ADDRESS].limit * 4
    real = [instance.check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0) for _ in range(many)]
    assert set(statuses(real)) == {200}
    first_ordinary = instance.check(facts(RouteClass.PUBLIC), T0)
    assert first_ordinary.headers()["X-RateLimit-Remaining"] == str(cfg.limit_address_per_minute - 1)


@BOTH
def test_ordinary_requests_pass_up_to_the_address_limit_then_wait(cfg: AuthSettings) -> None:
    instance = Instance(cfg)
    limit = rules_from(cfg)[RuleId.ADDRESS].limit
    results = [instance.check(facts(RouteClass.PUBLIC), T0 + 5) for _ in range(limit * 4)]
    assert statuses(results) == [200] * limit + [429] * (limit * 3)
    assert {r.retry_after for r in results[limit:]} == {retry_after(T0 + 5, cfg.limit_window_seconds)}


def test_forged_internal_tokens_are_refused_like_ordinary_requests() -> None:
    # the address limit below the auth_failure limit, as in the post-mortem's test, so only the address binds
    cfg = SMALL.model_copy(update={"limit_address_per_minute": 5, "limit_auth_failure_per_minute": 50})
    limit = cfg.limit_address_per_minute
    many = limit * 4
    forged = Instance(cfg)
    ordinary = Instance(cfg)
    forged_results = [
        forged.check(facts(RouteClass.INTERNAL, internal=InternalToken.FORGED), T0) for _ in range(many)
    ]
    ordinary_results = [ordinary.check(facts(RouteClass.PUBLIC), T0) for _ in range(many)]
    assert [s == 429 for s in statuses(forged_results)] == [s == 429 for s in statuses(ordinary_results)]
    # /internal answers 401 until the 429s start
    assert statuses(forged_results) == [401] * limit + [429] * (many - limit)
    # each forged token that reached the store counted as a rejected credential; once the address budget was
    # spent (at the limit-th request) the rest met the instance's memory and cost the store nothing
    key = CounterKey.of(rules_from(cfg)[RuleId.AUTH_FAILURE], ADDRESS)
    assert forged.store.peek(key, int(T0)) == limit == forged.store_calls
    assert all(r.code == "invalid_credential" for r in forged_results[:limit])


# --- refusal order and naming --------------------------------------------------------------------------------------


def test_limits_come_before_credential_refusals() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET), rules)
    over = {**dict.fromkeys(plan.increments, SMALL.limit_address_per_minute + 1), **dict.fromkeys(plan.reads, 0)}
    assert decide(plan, over, T0).status == 429
    within = {**dict.fromkeys(plan.increments, 1), **dict.fromkeys(plan.reads, 0)}
    assert (decide(plan, within, T0).status, decide(plan, within, T0).code) == MISSING


def test_a_refusal_names_the_rule_whose_window_ends_last() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(
        facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE), rules
    )
    counts = {key: key.rule.limit + 1 for key in plan.increments} | dict.fromkeys(plan.reads, 0)
    now = T0 + 30
    d = decide(plan, counts, now)
    assert d.refused_by == rules[RuleId.APP_CREATE]
    assert d.retry_after == retry_after(now, HOUR_SECONDS)


def test_ties_between_refusals_go_to_spec_order() -> None:
    rules = rules_from(SMALL)
    f = facts(RouteClass.SECRET, REJECTED_KEY)
    plan = plan_counts(f, rules)
    counts = {key: key.rule.limit + 1 for key in plan.increments}
    assert decide(plan, counts, T0).refused_by == rules[RuleId.ADDRESS]
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    counts = {key: key.rule.limit + 1 for key in plan.increments} | dict.fromkeys(plan.reads, 0)
    assert decide(plan, counts, T0).refused_by == rules[RuleId.KEY]


# --- headers and problem bodies ------------------------------------------------------------------------------------

POLICY = re.compile(r'"(?P<name>[a-z_]+)";q=(?P<q>\d+);w=(?P<w>\d+)')
RATELIMIT = re.compile(r'"(?P<name>[a-z_]+)";r=(?P<r>\d+);t=(?P<t>\d+)')


@BOTH
def test_headers_follow_the_draft_and_the_common_trio(cfg: AuthSettings) -> None:
    rule = rules_from(cfg)[RuleId.KEY]
    instance = Instance(cfg)
    now = T0 + 17.25
    d = instance.check(facts(RouteClass.SECRET, SECRET_KEY), now)
    h = d.headers()
    policy, current = POLICY.fullmatch(h["RateLimit-Policy"]), RATELIMIT.fullmatch(h["RateLimit"])
    assert policy and current
    assert policy["name"] == current["name"] == "key"
    assert (int(policy["q"]), int(policy["w"])) == (rule.limit, rule.window_seconds)
    assert int(current["r"]) == rule.limit - 1 == int(h["X-RateLimit-Remaining"])
    assert int(current["t"]) == retry_after(now, rule.window_seconds) == int(h["X-RateLimit-Reset"])
    assert int(h["X-RateLimit-Limit"]) == rule.limit
    assert "Retry-After" not in h


def test_rate_limit_headers_exactly() -> None:
    rule = rules_from(DEFAULTS)[RuleId.KEY]
    h = rate_limit_headers(AppliedLimit(rule, 123, 42))
    assert h == {
        "RateLimit-Policy": f'"key";q={rule.limit};w={rule.window_seconds}',
        "RateLimit": '"key";r=123;t=42',
        "X-RateLimit-Limit": str(rule.limit),
        "X-RateLimit-Remaining": "123",
        "X-RateLimit-Reset": "42",
    }
    assert rate_limit_headers(AppliedLimit(rule, 0, 42), 42)["Retry-After"] == "42"


def test_a_refusal_carries_retry_after_equal_to_the_reset_and_nothing_left() -> None:
    instance = Instance(SMALL)
    for _ in range(SMALL.limit_address_per_minute):
        instance.check(facts(RouteClass.PUBLIC), T0 + 59.5)
    h = instance.check(facts(RouteClass.PUBLIC), T0 + 59.5).headers()
    assert h["Retry-After"] == h["X-RateLimit-Reset"] == "1"
    assert RATELIMIT.fullmatch(h["RateLimit"])["r"] == "0"  # type: ignore[index]


def test_the_tightest_rule_is_the_one_with_fewest_remaining_then_shortest_reset() -> None:
    rules = rules_from(SMALL)
    a, k, o = rules[RuleId.ADDRESS], rules[RuleId.KEY], rules[RuleId.OWNER]
    assert tightest([AppliedLimit(a, 5, 10), AppliedLimit(k, 3, 50)]) == AppliedLimit(k, 3, 50)
    assert tightest([AppliedLimit(a, 3, 10), AppliedLimit(k, 3, 50)]) == AppliedLimit(a, 3, 10)
    assert tightest([AppliedLimit(o, 3, 10), AppliedLimit(k, 3, 10)]) == AppliedLimit(k, 3, 10)
    assert tightest([]) is None


def test_a_decision_shows_the_tightest_of_the_rules_it_counted() -> None:
    rules = rules_from(SMALL)
    plan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    checked = 0
    for counts in itertools.product(*(range(1, k.rule.limit + 2) for k in plan.increments)):
        by_key = dict(zip(plan.increments, counts, strict=True))
        applied = [AppliedLimit(k.rule, max(0, k.rule.limit - c), seconds_until(T0, k.window_end(T0)))
                   for k, c in by_key.items()]
        decision = decide(plan, by_key, T0)
        if decision.status != 429:  # a 429 shows the rule that refused (see the refusal tests)
            assert decision.applied == tightest(applied)
            checked += 1
    assert checked == math.prod(k.rule.limit for k in plan.increments)  # every count within the limits


def test_a_rejected_credential_shows_its_tighter_auth_failure_budget() -> None:
    d = Instance(SMALL).check(facts(RouteClass.SECRET, REJECTED_KEY), T0)
    assert d.applied is not None and d.applied.rule.id is RuleId.AUTH_FAILURE
    assert d.applied.remaining == SMALL.limit_auth_failure_per_minute - 1


def test_nothing_counted_means_no_rate_limit_headers() -> None:
    d = Instance(SMALL).check(facts(RouteClass.INTERNAL, internal=InternalToken.REAL), T0)
    assert d.allowed and d.headers() == {} and d.problem() is None


def test_problem_bodies() -> None:
    instance = Instance(SMALL)
    for _ in range(SMALL.limit_address_per_minute):
        instance.check(facts(RouteClass.PUBLIC), T0)
    refused = instance.check(facts(RouteClass.PUBLIC), T0 + 20)
    body = refused.problem()
    assert body == {
        "type": "https://weir.dev/problems/rate_limited",  # as every other Weir problem
        "title": "Too Many Requests",
        "status": 429,
        "detail": refused.detail,
        "code": "rate_limited",
        "rule": "address",
        "retry_after": SMALL.limit_window_seconds - 20,
    }
    missing = Instance(SMALL).check(facts(RouteClass.SECRET), T0).problem()
    assert missing is not None
    assert {k: missing[k] for k in ("title", "status", "code")} == {
        "title": "Unauthorized", "status": 401, "code": "missing_credential"
    }
    assert "rule" not in missing
    forbidden = Instance(SMALL).check(facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-2"), T0).problem()
    assert forbidden is not None and (forbidden["status"], forbidden["code"]) == (403, "forbidden")


# --- refusal memory, recent keys, local windows --------------------------------------------------------------------


def test_refusal_memory_holds_until_the_window_end() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    key = CounterKey.of(rule, ADDRESS)
    memory = RefusalMemory()
    end = key.window_end(T0)
    memory.remember(key, end, T0)
    assert memory.refused_until(key, T0) == end
    assert memory.refused_until(key, math.nextafter(end, 0)) == end
    assert memory.refused_until(key, end) is None
    assert len(memory) == 0
    memory.remember(key, end, end)  # already over: not kept
    assert len(memory) == 0


def test_refusal_memory_forgets_ended_windows_by_itself() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    memory = RefusalMemory()
    for i in range(50):
        key = CounterKey.of(rule, f"192.0.2.{i}")
        memory.remember(key, key.window_end(T0), T0)
    assert len(memory) == 50
    later = T0 + rule.window_seconds
    fresh = CounterKey.of(rule, OTHER_ADDRESS)
    memory.remember(fresh, fresh.window_end(later), later)
    assert len(memory) == 1
    assert memory.purge(later + rule.window_seconds) == 1 and len(memory) == 0


def test_a_spent_budget_is_remembered_at_the_request_that_spent_it() -> None:
    instance = Instance(SMALL)
    limit = SMALL.limit_key_per_minute
    decisions = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0) for _ in range(limit)]
    assert all(d.allowed for d in decisions)
    assert [bool(d.remember) for d in decisions] == [False] * (limit - 1) + [True]
    calls = instance.store_calls
    flood = [instance.check(facts(RouteClass.SECRET, SECRET_KEY), T0 + 1) for _ in range(limit * 10)]
    assert set(statuses(flood)) == {429}
    assert instance.store_calls == calls, "a flood costs the store nothing"


def test_memory_of_auth_failure_does_not_refuse_the_exempt() -> None:
    rules = rules_from(SMALL)
    memory = RefusalMemory()
    key = CounterKey.of(rules[RuleId.AUTH_FAILURE], ADDRESS)
    memory.remember(key, key.window_end(T0), T0)
    exempt = plan_counts(facts(RouteClass.SECRET, REJECTED_KEY, InternalToken.REAL), rules)
    assert key in exempt.increments and refusal_from_memory(exempt, memory, T0) is None
    recent = plan_counts(facts(RouteClass.SECRET, SECRET_KEY, recently_accepted_key=True), rules)
    assert refusal_from_memory(recent, memory, T0) is None
    blocked = refusal_from_memory(plan_counts(facts(RouteClass.PUBLIC), rules), memory, T0 + 1)
    assert blocked is not None and blocked.refused_by == rules[RuleId.AUTH_FAILURE]
    assert blocked.retry_after == retry_after(T0 + 1, SMALL.limit_window_seconds)
    assert refusal_from_memory(plan_counts(facts(RouteClass.PUBLIC, address=OTHER_ADDRESS), rules), memory, T0) is None


@given(st.lists(st.floats(min_value=0, max_value=3 * WINDOW, allow_nan=False), max_size=60))
@settings(max_examples=60)
def test_memory_changes_no_answer_of_a_single_budget(offsets: list[float]) -> None:
    with_memory, without = Instance(SMALL), Instance(SMALL, use_memory=False)
    for offset in sorted(offsets):
        a = with_memory.check(facts(RouteClass.PUBLIC), T0 + offset)
        b = without.check(facts(RouteClass.PUBLIC), T0 + offset)
        assert (a.status, a.retry_after, a.refused_by) == (b.status, b.retry_after, b.refused_by)


def test_recent_accepted_keys() -> None:
    horizon = SMALL.limit_window_seconds
    recent = RecentAcceptedKeys(horizon)
    recent.record(ADDRESS, "key-1", T0)
    assert recent.accepted_within(ADDRESS, "key-1", T0)
    assert recent.accepted_within(ADDRESS, "key-1", math.nextafter(T0 + horizon, 0))
    assert not recent.accepted_within(ADDRESS, "key-1", T0 + horizon)
    assert not recent.accepted_within(OTHER_ADDRESS, "key-1", T0)
    assert not recent.accepted_within(ADDRESS, "key-2", T0)
    assert not recent.accepted_within(ADDRESS, "key-1", T0 - 1)
    recent.record(ADDRESS, "key-2", T0 + 1)
    recent.record(ADDRESS, "key-1", T0 - 5)  # an earlier sighting (another instance's record) keeps the later one
    assert recent.accepted_from(ADDRESS, T0 + 1) == {"key-1": T0, "key-2": T0 + 1}
    assert recent.accepted_from(ADDRESS, T0 + horizon) == {"key-2": T0 + 1}
    assert recent.accepted_from(OTHER_ADDRESS, T0) == {}
    recent.record(OTHER_ADDRESS, "key-1", T0 + horizon)  # purges what has aged out
    assert len(recent) == 2
    assert recent.purge(T0 + horizon + 1) == 1
    assert recent.purge(T0 + 2 * horizon) == 1 and len(recent) == 0


def test_local_windows() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    key = CounterKey.of(rule, ADDRESS)
    windows = LocalWindows()
    start = key.window_start(T0)
    assert [windows.incr(key, start) for _ in range(3)] == [1, 2, 3]
    assert windows.incr(key, start, by=4) == 7
    assert windows.peek(key, start) == 7
    nxt = start + rule.window_seconds
    assert windows.peek(key, nxt) == 0
    assert windows.incr(key, nxt) == 1
    assert windows.incr(key, start) == 1  # a window already left behind does not disturb the current one
    assert windows.peek(key, nxt) == 1
    assert windows.purge(nxt + rule.window_seconds - 1) == 0
    assert windows.purge(nxt + rule.window_seconds) == 1 and len(windows) == 0


def test_local_windows_answer_a_plan_as_the_store_would() -> None:
    rules = rules_from(SMALL)
    plan: CountPlan = plan_counts(facts(RouteClass.SECRET, SECRET_KEY), rules)
    counts = LocalWindows().count(plan, T0)
    assert set(counts) == set(plan.increments) | set(plan.reads)
    assert all(counts[k] == 1 for k in plan.increments) and all(counts[k] == 0 for k in plan.reads)


# --- properties ----------------------------------------------------------------------------------------------------


@given(st.sampled_from(list(RuleId)), st.integers(min_value=0, max_value=10_000))
def test_remaining_is_never_below_zero_nor_above_the_limit(rule_id: RuleId, count: int) -> None:
    rules = rules_from(SMALL)
    key = CounterKey.of(rules[rule_id], "x")
    plan = CountPlan(facts(RouteClass.PUBLIC, internal=InternalToken.REAL), (key,), None)
    d = decide(plan, {key: count}, T0)
    assert d.applied is not None and 0 <= d.applied.remaining <= rules[rule_id].limit
    assert int(d.headers()["X-RateLimit-Remaining"]) >= 0


_REQUEST_FACTS = [
    facts(RouteClass.PUBLIC),
    facts(RouteClass.PUBLIC, address=OTHER_ADDRESS),
    facts(RouteClass.SECRET, SECRET_KEY),
    facts(RouteClass.SECRET, AcceptedSecretKey("key-2", "acct-1", "app-1")),
    facts(RouteClass.SECRET, REJECTED_KEY),
    facts(RouteClass.SDK, UPLOAD_TOKEN, video_id="video-1"),
    facts(RouteClass.INTERNAL, internal=InternalToken.FORGED),
    facts(RouteClass.INTERNAL, internal=InternalToken.REAL),
    facts(RouteClass.MANAGEMENT, ACCOUNT_TOKEN, operation=ManagementOperation.APP_CREATE),
]
_REQUESTS = st.sampled_from(_REQUEST_FACTS)


@given(st.lists(st.tuples(_REQUESTS, st.floats(min_value=0, max_value=WINDOW * 0.999)), max_size=120))
@settings(max_examples=80)
def test_no_budget_ever_admits_more_than_its_limit_in_a_window(requests: list[tuple[RequestFacts, float]]) -> None:
    instance = Instance(SMALL)
    rules = instance.rules
    admitted: dict[CounterKey, int] = {}
    for f, offset in sorted(requests, key=lambda r: r[1]):
        d = instance.check(f, T0 + offset)
        if d.status != 429:
            for key in plan_counts(replace(f, recently_accepted_key=False), rules).increments:
                admitted[key] = admitted.get(key, 0) + 1
    for key, n in admitted.items():
        assert n <= key.rule.limit, key


@pytest.mark.parametrize("rule_id", list(RuleId))
def test_headers_written_as_json_are_the_headers(rule_id: RuleId) -> None:
    from services.auth.domain import rate_limit_headers_json

    rule = rules_from(SMALL)[rule_id]
    for remaining, reset, retry in itertools.product([0, 1, rule.limit], [1, rule.window_seconds], [None, 0, 7]):
        applied = AppliedLimit(rule, remaining, reset)
        assert json.loads(rate_limit_headers_json(applied, retry)) == rate_limit_headers(applied, retry)
        decision = Decision(429 if retry else 200, applied=applied, retry_after=retry)
        assert json.loads(decision.headers_json()) == decision.headers()
    for retry in (None, 3):
        assert json.loads(Decision(401, retry_after=retry).headers_json()) == Decision(401, retry_after=retry).headers()


def test_recent_accepted_keys_purge_a_bounded_number_of_times_and_keep_a_bounded_excess() -> None:
    """Addresses each seen once age out one after another: the purges (each reads every entry) stay at most
    PURGES_PER_HORIZON per horizon, and an aged-out entry lingers at most a PURGES_PER_HORIZON-th of the horizon."""
    horizon = SMALL.limit_window_seconds
    recent = RecentAcceptedKeys(horizon)
    purges = 0
    real_purge = recent.purge

    def counted(now: float) -> int:
        nonlocal purges
        purges += 1
        return real_purge(now)

    recent.purge = counted  # type: ignore[method-assign]
    step = horizon / 1000  # a new address every thousandth of the horizon, for three horizons
    for i in range(3000):
        now = T0 + i * step
        recent.record(f"10.0.{i // 256}.{i % 256}", "key-1", now)
        assert len(recent) <= 1000 + 1000 / PURGES_PER_HORIZON + 1  # within the horizon, and the lingering tenth
    assert purges <= 2 * PURGES_PER_HORIZON + 1  # none before the first horizon; then at most ten per horizon
    assert recent.accepted_from("10.0.0.0", T0 + 3000 * step) == {}  # lingering or not, an old entry answers nothing


@given(st.lists(st.tuples(_REQUESTS, st.integers(min_value=0, max_value=40)), min_size=1, max_size=30),
       st.floats(min_value=0, max_value=HOUR_SECONDS * 2, allow_nan=False), st.booleans())
@settings(max_examples=200)
def test_a_batch_decided_with_shared_windows_is_decided_as_each_alone(
    requests: list[tuple[RequestFacts, int]], offset: float, block_spent: bool
) -> None:
    """`decide` with one `WindowsAt` for a batch gives what it gives each request alone, at every count: under,
    at and past every limit, with the block's counter read or incremented."""
    rules = rules_from(SMALL)
    now = T0 + offset
    at = WindowsAt(now)
    for f, count in requests:
        plan = plan_counts(f, rules)
        counts = {key: count for key in plan.increments}
        for key in plan.reads:
            counts[key] = key.rule.limit if block_spent else count
        assert decide(plan, counts, now, at) == decide(plan, counts, now)
    stale = WindowsAt(now - WINDOW)  # windows of another moment are not used
    f, count = requests[0]
    plan = plan_counts(f, rules)
    counts = {key: count for key in [*plan.increments, *plan.reads]}
    assert decide(plan, counts, now, stale) == decide(plan, counts, now)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.sampled_from([1, 7, WINDOW, HOUR_SECONDS]))
def test_windows_at_a_moment_are_the_window_functions(now: float, window: int) -> None:
    from services.auth.domain import seconds_until, window_end

    at = WindowsAt(now)
    assert at.end_and_reset(window) == (window_end(now, window), seconds_until(now, window_end(now, window)))
    assert at.end_and_reset(window) == at.end_and_reset(window)


def test_what_a_plan_alone_decides_is_what_the_functions_say() -> None:
    from services.auth.domain import rejections

    rules = rules_from(SMALL)
    for f in _REQUEST_FACTS:
        plan = plan_counts(f, rules)
        assert plan.rejections == rejections(f)
        assert plan.refusal == credential_refusal(f)
        key_id = f.credential.key_id if isinstance(f.credential, AcceptedSecretKey) else None
        assert plan.accepted_key_id == key_id
        if plan.refusal is None:
            counts = {key: 0 for key in [*plan.increments, *plan.reads]}
            assert decide(plan, counts, T0).accepted_key_id == key_id


def test_recent_keys_recorded_as_a_batch_are_recorded_as_one_by_one() -> None:
    horizon = SMALL.limit_window_seconds
    pairs = [(f"10.0.0.{i % 5}", f"key-{i % 3}") for i in range(20)]
    one, many = RecentAcceptedKeys(horizon), RecentAcceptedKeys(horizon)
    for step, now in enumerate([T0, T0 + 1, T0 + 0.5, T0 + horizon * 2]):  # an earlier moment never moves one back
        batch = pairs[step * 5:] if step < 3 else pairs[:2]
        for address, key_id in batch:
            one.record(address, key_id, now)
        many.record_many(batch, now)
        assert one._last == many._last
        for address, key_id in pairs:
            assert many.accepted_within(address, key_id, now + 1) == one.accepted_within(address, key_id, now + 1)
