"""The auth service's decisions as plain functions and values: credentials, client address, windows, request limits.

No I/O and no clock: every function that depends on time takes `now` (seconds since the epoch, a float).

How credentials arrive (the edge forwards both header values to `auth.check` untouched):

- `Authorization: Bearer <credential>` carries one customer credential: an account token (`wat_`), a secret key
  (`wsk_`), a publishable key (`wpk_`) or an upload token (`wut_`). The scheme is case-insensitive; an empty
  `Bearer` value is no credential at all.
- `X-Weir-Internal-Token: <token>` carries Weir's internal token, so that an edge can send its own identity beside a
  customer credential it forwards.
- A Bearer value without a Weir prefix (and any other Authorization scheme) is read as a claim to be the internal
  token: it is compared with the real one like the header, and if it is not the real token it is a forged one.
  So nothing unrecognised passes unjudged: it is a rejected credential.
- The internal token is accepted only if every internal-token candidate of the request is the real token; an unset
  internal token (empty setting) accepts nothing.

The order of one decision (`decide`), for a request whose counters were already incremented:

1. Limits first: the `auth_failure` block of the address (unless the request is exempt from it), then every counted
   rule whose count went past its limit. A refusal is 429 and names the rule whose window ends last (the earliest
   moment a retry can succeed); ties go to the order of SPEC section 3's table. Limits come before credential refusals
   because rejected credentials count (SPEC section 3), and a flood of them must meet 429, not a stream of 401s.
2. Credential refusals: 401 `missing_credential`, `invalid_credential`, `token_expired`, `credential_not_allowed`;
   403 `forbidden` for an upload token used on another video.
3. Otherwise the request is allowed.

Every decision that counted anything carries the tightest rule that applied, for the rate-limit headers.

Wiring of one check (the service's app.py): `read_credentials` -> one lookup -> `RequestFacts` (with
`RecentAcceptedKeys.accepted_within`) -> `plan_counts` -> `refusal_from_memory` (answer there if it refuses) ->
the shared store, or `LocalWindows.count` when it cannot answer: increment `plan.increments`, read `plan.reads` ->
`decide` -> `RefusalMemory.remember_decision` and, if `accepted_key_id`, `RecentAcceptedKeys.record`.
A budget is remembered as soon as it is spent (count == limit), which is exact because counts in a fixed window
never go down: every later request on it would be past the limit.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from http import HTTPStatus
from typing import Final, Literal, NamedTuple, TypeAlias

from services.auth.settings import AuthSettings
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH, CredentialKind
from shared.problems import PROBLEM_TYPE_BASE

# --- credential forms ----------------------------------------------------------------------------------------------

KEY_ALPHABET: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""base62: URL-safe, no padding, survives double-click selection and every shell."""
KEY_BODY_LENGTH: Final = 32
KEY_RANDOM_BYTES: Final = 32
"""256 random bits reduced to 32 base62 digits (about 190 bits); the modulo bias is below 2**-65."""
UPLOAD_TOKEN_PREFIX: Final = "wut_"
INTERNAL_TOKEN_HEADER: Final = "X-Weir-Internal-Token"
MAX_CREDENTIAL_LENGTH: Final = 1024
"""Longer values are malformed before any decoding work is spent on them."""

_KEY_BODY = re.compile(rf"[0-9A-Za-z]{{{KEY_BODY_LENGTH}}}")
_B64URL = r"[A-Za-z0-9_-]+"
_UPLOAD_TOKEN_SHAPE = re.compile(rf"{UPLOAD_TOKEN_PREFIX}({_B64URL})\.({_B64URL})")
_ASCII_SPACE = " \t\r\n"


class FormKind(StrEnum):
    """What a presented credential looks like, before anything is looked up."""

    NONE = "none"
    ACCOUNT_TOKEN = "account_token"
    SECRET_KEY = "secret_key"
    PUBLISHABLE_KEY = "publishable_key"
    UPLOAD_TOKEN = "upload_token"
    INTERNAL_TOKEN_CANDIDATE = "internal_token_candidate"
    MALFORMED = "malformed"


KEY_PREFIXES: Final[Mapping[FormKind, str]] = {
    FormKind.ACCOUNT_TOKEN: "wat_",
    FormKind.SECRET_KEY: "wsk_",
    FormKind.PUBLISHABLE_KEY: "wpk_",
}

_CATALOG_KIND: Final[Mapping[FormKind, CredentialKind]] = {
    FormKind.ACCOUNT_TOKEN: "account_token",
    FormKind.SECRET_KEY: "secret_key",
    FormKind.PUBLISHABLE_KEY: "publishable_key",
    FormKind.UPLOAD_TOKEN: "upload_token",
    FormKind.INTERNAL_TOKEN_CANDIDATE: "internal_token",
}


@dataclass(frozen=True)
class CredentialForm:
    """A classified credential. `looks_like` is the kind it claims to be (set for malformed ones too)."""

    kind: FormKind
    value: str = field(default="", repr=False)  # the raw secret: never logged
    looks_like: CredentialKind | None = None


NO_CREDENTIAL_FORM: Final = CredentialForm(FormKind.NONE)


def classify_credential(raw: str | None) -> CredentialForm:
    """Tell a credential's form by its shape alone: a key-shaped value with a wrong body is malformed."""
    if raw is None:
        return NO_CREDENTIAL_FORM
    value = raw.strip(_ASCII_SPACE)
    if not value:
        return NO_CREDENTIAL_FORM
    for kind, prefix in KEY_PREFIXES.items():
        if value.startswith(prefix):
            well_formed = _KEY_BODY.fullmatch(value[len(prefix) :]) is not None
            return CredentialForm(kind if well_formed else FormKind.MALFORMED, value, _CATALOG_KIND[kind])
    if value.startswith(UPLOAD_TOKEN_PREFIX):
        shaped = len(value) <= MAX_CREDENTIAL_LENGTH and _UPLOAD_TOKEN_SHAPE.fullmatch(value) is not None
        return CredentialForm(FormKind.UPLOAD_TOKEN if shaped else FormKind.MALFORMED, value, "upload_token")
    return CredentialForm(FormKind.INTERNAL_TOKEN_CANDIDATE, value, "internal_token")


def bearer_credential(authorization: str | None) -> str | None:
    """The credential of an Authorization header: the Bearer value, or the whole value for any other scheme."""
    if authorization is None:
        return None
    value = authorization.strip(_ASCII_SPACE)
    if not value:
        return None
    scheme, _, rest = value.partition(" ")
    if scheme.lower() == "bearer":
        return rest.strip(_ASCII_SPACE) or None
    return value


class InternalToken(StrEnum):
    """What the request's internal-token candidates amount to."""

    ABSENT = "absent"
    REAL = "real"
    FORGED = "forged"


def judge_internal_token(candidates: Iterable[str], real: str) -> InternalToken:
    """REAL only if there is a candidate and every one is the real token; an empty real token accepts nothing."""
    presented = [c for c in candidates if c]
    if not presented:
        return InternalToken.ABSENT
    if real and all(constant_time_equal(c, real) for c in presented):
        return InternalToken.REAL
    return InternalToken.FORGED


@dataclass(frozen=True)
class PresentedCredentials:
    """The customer credential to look up, and the verdict on the internal token."""

    credential: CredentialForm
    internal: InternalToken


def read_credentials(
    authorization: str | None, internal_header: str | None, real_internal_token: str
) -> PresentedCredentials:
    """Read both headers: an unprefixed Bearer value joins the internal-token header as a candidate."""
    form = classify_credential(bearer_credential(authorization))
    candidates: list[str] = []
    if form.kind is FormKind.INTERNAL_TOKEN_CANDIDATE:
        candidates.append(form.value)
        form = NO_CREDENTIAL_FORM
    if internal_header is not None:
        candidates.append(internal_header.strip(_ASCII_SPACE))
    return PresentedCredentials(form, judge_internal_token(candidates, real_internal_token))


# --- key material --------------------------------------------------------------------------------------------------


def mint_key(kind: FormKind, rand: bytes) -> str:
    """A new account token, secret key or publishable key from `rand` (at least KEY_RANDOM_BYTES random bytes)."""
    prefix = KEY_PREFIXES.get(kind)
    if prefix is None:
        raise ValueError(f"{kind} is not a key kind that is minted")
    if len(rand) < KEY_RANDOM_BYTES:
        raise ValueError(f"a key needs at least {KEY_RANDOM_BYTES} random bytes, got {len(rand)}")
    number = int.from_bytes(rand, "big")
    digits = []
    for _ in range(KEY_BODY_LENGTH):
        number, digit = divmod(number, len(KEY_ALPHABET))
        digits.append(KEY_ALPHABET[digit])
    return prefix + "".join(digits)


def key_hash(secret: bytes, key: str) -> str:
    """The keyed hash under which a key is stored and looked up (HMAC-SHA256, hex)."""
    if not secret:
        raise ValueError("the keyed hash needs a server secret (WEIR_KEY_HASH_SECRET)")
    return hmac.digest(secret, key.encode(), "sha256").hex()  # the one-shot C path: same value as hmac.new


def key_prefix(key: str) -> str:
    """The first characters of a key, kept for display."""
    return key[:KEY_PREFIX_MAX_LENGTH]


def constant_time_equal(a: str | bytes, b: str | bytes) -> bool:
    """Equality whose timing reveals neither where the values differ nor (hashed first) the real value's length."""
    a_bytes = a.encode() if isinstance(a, str) else a
    b_bytes = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(hashlib.sha256(a_bytes).digest(), hashlib.sha256(b_bytes).digest())


# --- upload tokens -------------------------------------------------------------------------------------------------

_CLAIM_FIELDS: Final = frozenset({"v", "a", "k", "e"})


@dataclass(frozen=True)
class UploadTokenClaims:
    video_id: str
    app_id: str
    key_id: str
    expires_at: int
    """Seconds since the epoch; the token works while now < expires_at."""


class UploadTokenVerdict(StrEnum):
    VALID = "valid"
    EXPIRED = "expired"  # signature good: refused, but not a rejected credential
    BAD_SIGNATURE = "bad_signature"
    GARBLED = "garbled"


@dataclass(frozen=True)
class UploadTokenCheck:
    verdict: UploadTokenVerdict
    claims: UploadTokenClaims | None = None
    token_id: str | None = None
    """Counter id of a signed token: a hash of its signed part, so the token itself never lands in a subject."""

    @property
    def rejected(self) -> bool:
        return self.verdict in (UploadTokenVerdict.BAD_SIGNATURE, UploadTokenVerdict.GARBLED)


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes | None:
    """Strict base64url without padding; None for a non-canonical spelling (one token, one string, one counter)."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if _b64encode(data) == text else None


def _upload_signature(secret: bytes, signed: str) -> bytes:
    if not secret:
        raise ValueError("upload tokens need a signing secret (WEIR_UPLOAD_TOKEN_SECRET)")
    return hmac.new(secret, signed.encode("ascii"), hashlib.sha256).digest()


def _token_id(signed: str) -> str:
    return hashlib.sha256(signed.encode("ascii")).hexdigest()[:32]


def upload_token_expires_at(now: float, ttl_seconds: int) -> int:
    return math.floor(now) + ttl_seconds


def sign_upload_token(secret: bytes, video_id: str, app_id: str, key_id: str, expires_at: int) -> str:
    """`wut_` + base64url(JSON claims) + `.` + base64url(HMAC-SHA256 over the `wut_`-prefixed payload)."""
    for name, value in (("video_id", video_id), ("app_id", app_id), ("key_id", key_id)):
        if not value:
            raise ValueError(f"an upload token needs a {name}")
    claims = {"v": video_id, "a": app_id, "k": key_id, "e": int(expires_at)}
    payload = _b64encode(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    signed = UPLOAD_TOKEN_PREFIX + payload
    token = f"{signed}.{_b64encode(_upload_signature(secret, signed))}"
    if len(token) > MAX_CREDENTIAL_LENGTH:  # verify_upload_token would call it garbled: never hand one out
        raise ValueError(f"the claims make an upload token longer than {MAX_CREDENTIAL_LENGTH} characters")
    return token


def _parse_claims(payload: bytes) -> UploadTokenClaims | None:
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != _CLAIM_FIELDS:
        return None
    ids = [data["v"], data["a"], data["k"]]
    expires_at = data["e"]
    if not all(isinstance(i, str) and i for i in ids) or type(expires_at) is not int:
        return None
    return UploadTokenClaims(video_id=data["v"], app_id=data["a"], key_id=data["k"], expires_at=expires_at)


def verify_upload_token(secret: bytes, token: str, now: float) -> UploadTokenCheck:
    """Valid, expired (good signature), bad signature or garbled. Revocation of the minting key is the caller's."""
    match = _UPLOAD_TOKEN_SHAPE.fullmatch(token) if len(token) <= MAX_CREDENTIAL_LENGTH else None
    if match is None:
        return UploadTokenCheck(UploadTokenVerdict.GARBLED)
    payload_text, signature_text = match.group(1), match.group(2)
    payload, signature = _b64decode(payload_text), _b64decode(signature_text)
    if payload is None or signature is None or len(signature) != hashlib.sha256().digest_size:
        return UploadTokenCheck(UploadTokenVerdict.GARBLED)
    signed = UPLOAD_TOKEN_PREFIX + payload_text
    if not hmac.compare_digest(signature, _upload_signature(secret, signed)):
        return UploadTokenCheck(UploadTokenVerdict.BAD_SIGNATURE)
    claims = _parse_claims(payload)
    if claims is None:
        return UploadTokenCheck(UploadTokenVerdict.GARBLED)
    verdict = UploadTokenVerdict.VALID if now < claims.expires_at else UploadTokenVerdict.EXPIRED
    return UploadTokenCheck(verdict, claims, _token_id(signed))


# --- client address ------------------------------------------------------------------------------------------------

IpAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
ProxyNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

IPV6_CLIENT_PREFIX: Final = 64
"""One host controls a whole /64, so an IPv6 client is its /64."""


def _normalise(address: IpAddress) -> IpAddress:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            return ipaddress.IPv6Address(address.packed)
    return address


def parse_address(text: str) -> IpAddress | None:
    """An address as proxies write it: bare, `v4:port`, `[v6]` or `[v6]:port`; None for anything else."""
    value = text.strip(_ASCII_SPACE + '"')
    candidate = value
    if value.startswith("["):
        inside, bracket, port = value[1:].partition("]")
        if bracket and (not port or (port.startswith(":") and port[1:].isdigit())):
            candidate = inside
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
        if port.isdigit():
            candidate = host
    try:
        return _normalise(ipaddress.ip_address(candidate))
    except ValueError:
        return None


def parse_trusted_proxies(setting: str) -> tuple[ProxyNetwork, ...]:
    """WEIR_TRUSTED_PROXIES: addresses and CIDRs separated by commas or spaces. A bad entry is an error, not ignored."""
    networks: list[ProxyNetwork] = []
    for entry in re.split(r"[,\s]+", setting.strip()):
        if not entry:
            continue
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(f"WEIR_TRUSTED_PROXIES: {entry!r} is not an address or a network") from None
        if isinstance(network, ipaddress.IPv6Network) and network.prefixlen == 128:
            mapped = network.network_address.ipv4_mapped
            if mapped is not None:
                network = ipaddress.IPv4Network(mapped)
        networks.append(network)
    return tuple(networks)


def address_key(address: IpAddress) -> str:
    """The limit subject for an address: IPv4 in full, IPv6 as its /64 (e.g. `2001:db8:1:2::/64`)."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


def _trusted(address: IpAddress, trusted_proxies: Sequence[ProxyNetwork]) -> bool:
    return any(address in network for network in trusted_proxies)


@functools.lru_cache(maxsize=65536)  # pure, and the same peers and headers come back request after request
def client_address(peer: str, forwarded_for: str | None, trusted_proxies: Sequence[ProxyNetwork]) -> str:
    """The address a request is limited by: the TCP peer, or behind trusted proxies the rightmost untrusted hop.

    `forwarded_for` is every X-Forwarded-For header joined with commas, in order. The walk goes from the right and
    stops at the first untrusted hop; if a hop cannot be read, the walk stops and the nearest hop already known (a
    trusted one, or the peer) is the address, since anything left of an unreadable hop may be the client's own words.
    If every hop is trusted, the leftmost is the address.
    """
    peer_address = parse_address(peer)
    if peer_address is None:
        return peer.strip(_ASCII_SPACE) or "unknown"
    if not forwarded_for or not _trusted(peer_address, trusted_proxies):
        return address_key(peer_address)
    nearest = peer_address
    for hop in reversed(forwarded_for.split(",")):
        hop_address = parse_address(hop)
        if hop_address is None:
            break
        if not _trusted(hop_address, trusted_proxies):
            return address_key(hop_address)
        nearest = hop_address
    return address_key(nearest)


# --- windows -------------------------------------------------------------------------------------------------------


def window_start(now: float, window_seconds: int) -> int:
    """Start of the fixed, clock-aligned window holding `now` (a minute window starts on the minute)."""
    if window_seconds <= 0:
        raise ValueError("a window must last at least one second")
    return math.floor(now) // window_seconds * window_seconds


def window_end(now: float, window_seconds: int) -> int:
    return window_start(now, window_seconds) + window_seconds


def retry_after(now: float, window_seconds: int) -> int:
    """Whole seconds until the window holding `now` ends, rounded up, at least 1."""
    return max(1, math.ceil(window_end(now, window_seconds) - now))


def seconds_until(now: float, moment: float) -> int:
    return max(1, math.ceil(moment - now))


class WindowsAt:
    """Each window length's end and reset (`window_end`, `seconds_until` it) at one moment, worked out once: a batch
    of requests is decided at one `now`, and its requests share a few window lengths."""

    __slots__ = ("_ends", "now")

    def __init__(self, now: float) -> None:
        self.now = now
        self._ends: dict[int, tuple[int, int]] = {}

    def end_and_reset(self, window_seconds: int) -> tuple[int, int]:
        got = self._ends.get(window_seconds)
        if got is None:
            end = window_end(self.now, window_seconds)
            got = self._ends[window_seconds] = (end, seconds_until(self.now, end))
        return got


# --- rules ---------------------------------------------------------------------------------------------------------


class RuleId(StrEnum):
    """The seven rules, in the order of SPEC section 3's table (the tie-break between refusals)."""

    ADDRESS = "address"
    AUTH_FAILURE = "auth_failure"
    KEY = "key"
    OWNER = "owner"
    UPLOAD_TOKEN = "upload_token"
    APP_CREATE = "app_create"
    KEY_ROTATE = "key_rotate"


RULE_ORDER: Final[Mapping[RuleId, int]] = {rule: index for index, rule in enumerate(RuleId)}

HOUR_SECONDS: Final = 3600
"""The management rules are per hour by name (`..._PER_HOUR`); the minute rules follow WEIR_LIMIT_WINDOW_SECONDS."""


@dataclass(frozen=True)
class Rule:
    id: RuleId
    limit: int
    window_seconds: int

    @functools.cached_property
    def headers_json_parts(self) -> tuple[str, str]:
        """What `rate_limit_headers_json` writes for this rule around its `remaining` (written for every request)."""
        name = f'\\"{self.id}\\"'  # a rule id is a plain word: its structured-field string needs only JSON's escape
        return (f'{{"RateLimit-Policy":"{name};q={self.limit};w={self.window_seconds}","RateLimit":"{name};r=',
                f'"X-RateLimit-Limit":"{self.limit}","X-RateLimit-Remaining":"')


def rules_from(settings: AuthSettings) -> dict[RuleId, Rule]:
    minute = settings.limit_window_seconds
    return {
        RuleId.ADDRESS: Rule(RuleId.ADDRESS, settings.limit_address_per_minute, minute),
        RuleId.AUTH_FAILURE: Rule(RuleId.AUTH_FAILURE, settings.limit_auth_failure_per_minute, minute),
        RuleId.KEY: Rule(RuleId.KEY, settings.limit_key_per_minute, minute),
        RuleId.OWNER: Rule(RuleId.OWNER, settings.limit_owner_per_minute, minute),
        RuleId.UPLOAD_TOKEN: Rule(RuleId.UPLOAD_TOKEN, settings.limit_upload_token_per_minute, minute),
        RuleId.APP_CREATE: Rule(RuleId.APP_CREATE, settings.limit_app_create_per_hour, HOUR_SECONDS),
        RuleId.KEY_ROTATE: Rule(RuleId.KEY_ROTATE, settings.limit_key_rotate_per_hour, HOUR_SECONDS),
    }


# --- counter keys and subjects -------------------------------------------------------------------------------------

_VERBATIM_TOKEN = re.compile(r"[A-Za-z0-9-]{1,64}")


@functools.lru_cache(maxsize=65536)  # the same keys and addresses come back request after request
def subject_token(value: str) -> str:
    """A NATS subject token for any value: ids as they are, anything else `_` + base32 (`_` never starts an id)."""
    if _VERBATIM_TOKEN.fullmatch(value):
        return value
    return "_" + base64.b32encode(value.encode()).decode("ascii").rstrip("=").lower()


def subject_value(token: str) -> str:
    """The value a subject token stands for (the inverse of `subject_token`)."""
    if not token.startswith("_"):
        return token
    body = token[1:].upper()
    return base64.b32decode(body + "=" * (-len(body) % 8)).decode()


@dataclass(frozen=True)
class CounterKey:
    """One budget: a rule and whom it is kept for (already a subject-safe token)."""

    rule: Rule
    key: str
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # hashed on every dict lookup of every request: once, not by hashing the rule's fields each time
        object.__setattr__(self, "_hash", hash((self.rule, self.key)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, rule: Rule, value: str) -> CounterKey:
        return _counter_key(rule, value)

    def window_start(self, now: float) -> int:
        return window_start(now, self.rule.window_seconds)

    def window_end(self, now: float) -> int:
        return window_end(now, self.rule.window_seconds)


@functools.lru_cache(maxsize=65536)
def _counter_key(rule: Rule, value: str) -> CounterKey:
    # one object per budget: the dicts a request goes through then match by identity before equality
    return CounterKey(rule, subject_token(value))


_SUBJECT_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


@functools.lru_cache(maxsize=65536)  # the same counters come back request after request, within a window
def counter_subject(prefix: str, counter: CounterKey, window_start: int) -> str:
    """`<prefix>.<rule>.<key>.<window start>`: one counter subject per rule, key and window."""
    if not _SUBJECT_PREFIX.fullmatch(prefix):
        raise ValueError(f"{prefix!r} is not a subject prefix")
    return f"{prefix}.{counter.rule.id}.{counter.key}.{window_start}"


# --- what a request carries ----------------------------------------------------------------------------------------


class RouteClass(StrEnum):
    SECRET = "secret"
    SDK = "sdk"
    INTERNAL = "internal"
    MANAGEMENT = "management"
    PUBLIC = "public"


class ManagementOperation(StrEnum):
    APP_CREATE = "app_create"
    KEY_ROTATE = "key_rotate"


class RejectionReason(StrEnum):
    MALFORMED = "malformed"
    UNKNOWN = "unknown"
    REVOKED = "revoked"
    BAD_SIGNATURE = "bad_signature"
    FORGED = "forged"


class UnusableReason(StrEnum):
    EXPIRED = "expired"
    KEY_REVOKED = "key_revoked"


@dataclass(frozen=True)
class NoCredential:
    pass


@dataclass(frozen=True)
class AcceptedSecretKey:
    key_id: str
    account_id: str
    app_id: str


@dataclass(frozen=True)
class AcceptedPublishableKey:
    key_id: str
    account_id: str
    app_id: str


@dataclass(frozen=True)
class AcceptedAccountToken:
    user_id: str
    account_id: str


@dataclass(frozen=True)
class ValidUploadToken:
    token_id: str
    claims: UploadTokenClaims


@dataclass(frozen=True)
class UnusableUploadToken:
    """A token with a good signature that no longer works: refused, but not a rejected credential."""

    token_id: str
    claims: UploadTokenClaims
    reason: UnusableReason


@dataclass(frozen=True)
class RejectedCredential:
    """A rejected credential (SPEC section 2): it counts on `auth_failure`, never on a key's or account's budget."""

    kind: CredentialKind
    reason: RejectionReason
    key_prefix: str | None = None


CredentialOutcome: TypeAlias = (
    NoCredential
    | AcceptedSecretKey
    | AcceptedPublishableKey
    | AcceptedAccountToken
    | ValidUploadToken
    | UnusableUploadToken
    | RejectedCredential
)


def malformed_credential(form: CredentialForm) -> RejectedCredential:
    """The outcome of a malformed form (looked up nowhere)."""
    kind: CredentialKind = form.looks_like or "internal_token"
    # never a prefix of an internal-token attempt: a near miss would show part of the real token
    prefix = None if kind == "internal_token" else key_prefix(form.value)
    return RejectedCredential(kind, RejectionReason.MALFORMED, prefix)


def upload_token_outcome(check: UploadTokenCheck, key_live: bool) -> CredentialOutcome:
    """What an upload token amounts to, given its check and whether the key that minted it is still live."""
    if check.verdict is UploadTokenVerdict.GARBLED:
        return RejectedCredential("upload_token", RejectionReason.MALFORMED)
    if check.verdict is UploadTokenVerdict.BAD_SIGNATURE:
        return RejectedCredential("upload_token", RejectionReason.BAD_SIGNATURE)
    assert check.claims is not None and check.token_id is not None
    if check.verdict is UploadTokenVerdict.EXPIRED:
        return UnusableUploadToken(check.token_id, check.claims, UnusableReason.EXPIRED)
    if not key_live:
        return UnusableUploadToken(check.token_id, check.claims, UnusableReason.KEY_REVOKED)
    return ValidUploadToken(check.token_id, check.claims)


@dataclass(frozen=True)
class RequestFacts:
    """What the edge saw and what the one credential lookup found.

    `video_id` is the video the route acts on (SDK upload routes); `recently_accepted_key` is whether this instance
    accepted the request's secret key from this address within the last window (`RecentAcceptedKeys`).
    """

    route: RouteClass
    address: str
    credential: CredentialOutcome = NoCredential()
    internal: InternalToken = InternalToken.ABSENT
    operation: ManagementOperation | None = None
    video_id: str | None = None
    recently_accepted_key: bool = False


@dataclass(frozen=True)
class Rejection:
    """One rejected credential of a request, for the `credential.rejected` event."""

    kind: CredentialKind
    reason: RejectionReason
    key_prefix: str | None = None


def rejections(facts: RequestFacts) -> tuple[Rejection, ...]:
    """The rejected credentials a request carried: its Authorization credential, a forged internal token, or both."""
    found: list[Rejection] = []
    if isinstance(facts.credential, RejectedCredential):
        c = facts.credential
        found.append(Rejection(c.kind, c.reason, c.key_prefix))
    if facts.internal is InternalToken.FORGED:
        found.append(Rejection("internal_token", RejectionReason.FORGED))
    return tuple(found)


# --- the limit plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CountPlan:
    """The counters a request increments (each at most once), and the `auth_failure` counter its block depends on.

    `block_check` is None when the request is exempt from the block; when it is not also incremented, the caller
    reads its current value (or skips the read and relies on `RefusalMemory`, giving up exactness across instances).
    """

    facts: RequestFacts
    increments: tuple[CounterKey, ...]
    block_check: CounterKey | None

    # the plan is kept with its remembered payload and serves each of its requests: what follows from it alone is
    # worked out once (functools.cached_property on a frozen dataclass: set in the instance's own dict)

    @functools.cached_property
    def reads(self) -> tuple[CounterKey, ...]:
        if self.block_check is None or self.block_check in self.increments:
            return ()
        return (self.block_check,)

    @functools.cached_property
    def rejections(self) -> tuple[Rejection, ...]:
        """`rejections` of the facts."""
        return rejections(self.facts)

    @functools.cached_property
    def accepted_key_id(self) -> str | None:
        """The secret key an allowed request of this plan was accepted with, for `RecentAcceptedKeys`."""
        credential = self.facts.credential
        return credential.key_id if isinstance(credential, AcceptedSecretKey) else None

    @functools.cached_property
    def refusal(self) -> Refusal | None:
        """`credential_refusal` of the facts."""
        return credential_refusal(self.facts)


def carried_by_identity(facts: RequestFacts) -> bool:
    """Carried by the real internal token, an accepted secret key or a valid upload token: not counted by address."""
    return facts.internal is InternalToken.REAL or isinstance(
        facts.credential, AcceptedSecretKey | ValidUploadToken
    )


def exempt_from_block(facts: RequestFacts) -> bool:
    """The two ways through an address's `auth_failure` block."""
    # Weir's own edges share a few addresses with everyone they serve: identity, not address, lets them through
    if facts.internal is InternalToken.REAL:
        return True
    # a customer behind a shared address keeps working while someone else there guesses keys
    return isinstance(facts.credential, AcceptedSecretKey) and facts.recently_accepted_key


def plan_counts(facts: RequestFacts, rules: Mapping[RuleId, Rule]) -> CountPlan:
    """Which budgets this request spends. Rejected credentials spend the address's, never a key's or an account's.

    Counters are incremented before the decision (that is what keeps them exact across instances), so a request
    refused by another rule still spends its budgets; `app_create` and `key_rotate` therefore count attempts.
    """
    increments: list[CounterKey] = []
    credential = facts.credential
    # the post-mortem's lesson: our own traffic is told apart by the token it carries, not by where it comes from
    if not carried_by_identity(facts):
        increments.append(CounterKey.of(rules[RuleId.ADDRESS], facts.address))
    auth_failure = CounterKey.of(rules[RuleId.AUTH_FAILURE], facts.address)
    if isinstance(credential, RejectedCredential) or facts.internal is InternalToken.FORGED:
        increments.append(auth_failure)
    if isinstance(credential, AcceptedSecretKey):
        increments.append(CounterKey.of(rules[RuleId.KEY], credential.key_id))
        increments.append(CounterKey.of(rules[RuleId.OWNER], credential.account_id))
    if isinstance(credential, ValidUploadToken):
        increments.append(CounterKey.of(rules[RuleId.UPLOAD_TOKEN], credential.token_id))
    if isinstance(credential, AcceptedAccountToken) and facts.route is RouteClass.MANAGEMENT:
        if facts.operation is ManagementOperation.APP_CREATE:
            increments.append(CounterKey.of(rules[RuleId.APP_CREATE], credential.user_id))
        elif facts.operation is ManagementOperation.KEY_ROTATE:
            increments.append(CounterKey.of(rules[RuleId.KEY_ROTATE], credential.user_id))
    block_check = None if exempt_from_block(facts) else auth_failure
    return CountPlan(facts, tuple(increments), block_check)


# --- credential refusals -------------------------------------------------------------------------------------------

ProblemCode: TypeAlias = Literal[
    "missing_credential", "invalid_credential", "credential_not_allowed", "token_expired", "forbidden", "rate_limited",
    "unavailable",
]

# the shared counter store is failing over (a replicated store electing a leader) and this instance holds no leased
# count for the request: counting stays exact, so the request is not decided; it may be sent again in a moment
FAILOVER_RETRY_AFTER_S: Final = 1


@dataclass(frozen=True)
class Refusal:
    status: int
    code: ProblemCode
    detail: str


_NOT_ALLOWED_NAMES: Final[Mapping[type, str]] = {
    AcceptedSecretKey: "secret keys",
    AcceptedPublishableKey: "publishable keys",
    AcceptedAccountToken: "account tokens",
    ValidUploadToken: "upload tokens",
    UnusableUploadToken: "upload tokens",
}

_ACCEPTED_ON: Final[Mapping[RouteClass, tuple[type, ...]]] = {
    RouteClass.SECRET: (AcceptedSecretKey,),
    RouteClass.SDK: (AcceptedPublishableKey, ValidUploadToken, UnusableUploadToken),
    RouteClass.MANAGEMENT: (AcceptedAccountToken,),
    RouteClass.INTERNAL: (),
}

MISSING: Final = Refusal(401, "missing_credential", "this route needs a credential: Authorization: Bearer <credential>")
INVALID: Final = Refusal(401, "invalid_credential", "the credential was not accepted")


def _not_allowed(credential: CredentialOutcome) -> Refusal:
    name = _NOT_ALLOWED_NAMES[type(credential)]
    return Refusal(401, "credential_not_allowed", f"{name} cannot be used on this route")


def credential_refusal(facts: RequestFacts) -> Refusal | None:
    """Whether the route refuses the request's credential, and how; None lets it through."""
    route, credential = facts.route, facts.credential
    if route is RouteClass.PUBLIC:
        return None
    if route is RouteClass.INTERNAL:
        if facts.internal is InternalToken.REAL:
            return None
        if facts.internal is InternalToken.FORGED:
            return INVALID
    if isinstance(credential, NoCredential):
        return MISSING
    if isinstance(credential, RejectedCredential):
        return INVALID
    if not isinstance(credential, _ACCEPTED_ON[route]):
        if route is RouteClass.INTERNAL:
            return Refusal(401, "credential_not_allowed", "only Weir's internal token is accepted on this route")
        return _not_allowed(credential)
    if isinstance(credential, UnusableUploadToken):
        if credential.reason is UnusableReason.EXPIRED:
            return Refusal(401, "token_expired", "the upload token has expired; mint a new one")
        return Refusal(401, "invalid_credential", "the key that minted this upload token was revoked")
    # on SDK routes a publishable key creates videos (no video in the route); an upload token acts on its one video
    if isinstance(credential, AcceptedPublishableKey) and facts.video_id is not None:
        return _not_allowed(credential)
    if isinstance(credential, ValidUploadToken):
        if facts.video_id is None:
            return _not_allowed(credential)
        if facts.video_id != credential.claims.video_id:
            return Refusal(403, "forbidden", "this upload token was minted for another video")
    return None


# --- headers and problem bodies ------------------------------------------------------------------------------------


class AppliedLimit(NamedTuple):
    """The tightest rule that applied to a request: what is left of it and when it resets (seconds).

    Made for every request, like `Decision`: a named tuple is as immutable as a frozen dataclass and about a
    fifth as dear to make (a frozen dataclass sets each field through object.__setattr__)."""

    rule: Rule
    remaining: int
    reset: int


def _sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rate_limit_headers(applied: AppliedLimit, retry_after_seconds: int | None = None) -> dict[str, str]:
    """RateLimit-Policy and RateLimit as in draft-ietf-httpapi-ratelimit-headers-11 (list items named by rule id),
    the common X-RateLimit-* trio (reset in seconds), and Retry-After on a refusal."""
    name = _sf_string(applied.rule.id)
    headers = {
        "RateLimit-Policy": f"{name};q={applied.rule.limit};w={applied.rule.window_seconds}",
        "RateLimit": f"{name};r={applied.remaining};t={applied.reset}",
        "X-RateLimit-Limit": str(applied.rule.limit),
        "X-RateLimit-Remaining": str(applied.remaining),
        "X-RateLimit-Reset": str(applied.reset),
    }
    if retry_after_seconds is not None:
        headers["Retry-After"] = str(retry_after_seconds)
    return headers


def rate_limit_headers_json(applied: AppliedLimit | None, retry_after_seconds: int | None = None) -> str:
    """`rate_limit_headers(...)` (or only Retry-After, or nothing) as a JSON object, written directly: a rule id is
    a plain word, so its structured-field string needs no escaping beyond JSON's for the quotes."""
    retry = "" if retry_after_seconds is None else f',"Retry-After":"{int(retry_after_seconds)}"'
    if applied is None:
        return "{" + retry[1:] + "}"
    head, middle = applied.rule.headers_json_parts
    remaining, reset = applied.remaining, applied.reset
    return f'{head}{remaining};t={reset}",{middle}{remaining}","X-RateLimit-Reset":"{reset}"{retry}}}'


def tightness(remaining: int, reset: int, rule: Rule) -> tuple[int, int, int]:
    """How tight a rule is, smallest first: fewest remaining; ties to the shortest reset, then to SPEC order."""
    return remaining, reset, RULE_ORDER[rule.id]


def tightest(applied: Iterable[AppliedLimit]) -> AppliedLimit | None:
    """The tightest of the rules that applied (see `tightness`)."""
    return min(applied, key=lambda a: tightness(a.remaining, a.reset, a.rule), default=None)


class Decision(NamedTuple):
    """One request's outcome. status 200 means "go on" (the route picks its own success status).

    `remember` lists budgets spent to the end of their window (key, window end) for `RefusalMemory`;
    `accepted_key_id` is a secret key to record in `RecentAcceptedKeys` (set only when the request is allowed).
    """

    status: int
    code: ProblemCode | None = None
    detail: str | None = None
    refused_by: Rule | None = None
    retry_after: int | None = None
    applied: AppliedLimit | None = None
    remember: tuple[tuple[CounterKey, int], ...] = ()
    accepted_key_id: str | None = None

    @property
    def allowed(self) -> bool:
        return self.status == 200

    def headers(self) -> dict[str, str]:
        if self.applied is not None:
            return rate_limit_headers(self.applied, self.retry_after)
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def headers_json(self) -> str:
        """`headers()` as a JSON object."""
        return rate_limit_headers_json(self.applied, self.retry_after)

    def problem(self) -> dict[str, object] | None:
        """The RFC 9457 body of a refusal, with the stable `code`; a 429 also names `rule` and `retry_after`."""
        if self.allowed or self.code is None:
            return None
        body: dict[str, object] = {
            "type": PROBLEM_TYPE_BASE + self.code,  # as every other Weir problem (shared/problems.py)
            "title": HTTPStatus(self.status).phrase,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.refused_by is not None:
            body["rule"] = str(self.refused_by.id)
            body["retry_after"] = self.retry_after
        return body


def _limit_refusal(refusing: Sequence[tuple[CounterKey, int]], now: float) -> Decision:
    """429 naming the rule whose window ends last: the earliest moment a retry can succeed."""
    key, until = max(refusing, key=lambda item: (item[1], -RULE_ORDER[item[0].rule.id]))
    rule = key.rule
    wait = seconds_until(now, until)
    if rule.id is RuleId.AUTH_FAILURE:
        detail = f"too many rejected credentials from this address; retry in {wait}s"
    else:
        detail = f"the {rule.id} limit of {rule.limit} requests per {rule.window_seconds}s is spent; retry in {wait}s"
    return Decision(
        status=429,
        code="rate_limited",
        detail=detail,
        refused_by=rule,
        retry_after=wait,
        applied=AppliedLimit(rule, 0, wait),
    )


def _holds_nothing(key: CounterKey) -> bool:
    return False


def refusal_from_memory(
    plan: CountPlan, memory: RefusalMemory, now: float, holds: Callable[[CounterKey], bool] = _holds_nothing
) -> Decision | None:
    """A 429 answered without the store, when a budget this request needs is remembered as spent.

    A budget spent in the store while this instance still holds leased counts of it (`holds`) is not refused:
    those counts are this instance's to admit.
    """
    refusing: list[tuple[CounterKey, int]] = []
    for key in plan.increments:
        until = memory.refused_until(key, now)
        if until is not None and key.rule.id is not RuleId.AUTH_FAILURE and not holds(key):
            refusing.append((key, until))
    if plan.block_check is not None:
        until = memory.refused_until(plan.block_check, now)
        if until is not None:
            refusing.append((plan.block_check, until))
    return _limit_refusal(refusing, now) if refusing else None


def decide(plan: CountPlan, counts: Mapping[CounterKey, int], now: float, at: WindowsAt | None = None) -> Decision:
    """The full outcome of a request from its plan and the counts after incrementing (and the block read).

    `at` is the windows at `now`, shared by the requests of a batch (made here when not given)."""
    if at is None or at.now != now:
        at = WindowsAt(now)
    refusing: list[tuple[CounterKey, int]] = []
    spent: list[tuple[CounterKey, int]] = []
    best: tuple[int, int, int] | None = None  # the tightest rule so far, as `tightness` orders them
    best_rule: Rule | None = None
    for key in plan.increments:
        count = counts.get(key)
        if count is None:
            raise ValueError(f"no count for {key.rule.id}:{key.key}")
        rule = key.rule
        limit = rule.limit
        end, reset = at.end_and_reset(rule.window_seconds)
        candidate = tightness(limit - count if count < limit else 0, reset, rule)
        if best is None or candidate < best:
            best, best_rule = candidate, rule
        if count >= limit:
            spent.append((key, end))
            # auth_failure refuses only through the block, so that its two exceptions hold for counted requests too
            if count > limit and rule.id is not RuleId.AUTH_FAILURE:
                refusing.append((key, end))
    block = plan.block_check
    if block is not None:
        incremented = block in plan.increments
        count = counts.get(block, 0)
        before = count - 1 if incremented else count
        limit = block.rule.limit
        end = at.end_and_reset(block.rule.window_seconds)[0]
        if not incremented and count >= limit:
            spent.append((block, end))
        # "past auth_failure": once the address has spent its rejected-credential budget, everything else waits
        if before >= limit:
            refusing.append((block, end))
    remember = tuple(spent)
    if refusing:
        return _limit_refusal(refusing, now)._replace(remember=remember)
    chosen = None if best is None or best_rule is None else AppliedLimit(best_rule, best[0], best[1])
    refused = plan.refusal
    if refused is not None:
        return Decision(refused.status, refused.code, refused.detail, applied=chosen, remember=remember)
    # positional: made for every request, and a named tuple's keywords cost more than the rest of this line
    return Decision(200, None, None, None, None, chosen, remember, plan.accepted_key_id)


# --- instance state: remembered refusals, recently accepted keys, local windows -------------------------------------


class RefusalMemory:
    """Budgets known to be spent until their window ends, so that a flood is refused without asking the store."""

    def __init__(self) -> None:
        self._until: dict[CounterKey, int] = {}
        self._next_purge = math.inf

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, key: CounterKey, until: int, now: float) -> None:
        self._maybe_purge(now)
        if until > now:
            self._until[key] = max(until, self._until.get(key, until))
            self._next_purge = min(self._next_purge, until)

    def remember_decision(self, decision: Decision, now: float) -> None:
        for key, until in decision.remember:
            self.remember(key, until, now)

    def forget(self, key: CounterKey) -> None:
        """Counts of `key` were given back to the store: it may have room again."""
        self._until.pop(key, None)

    def refused_until(self, key: CounterKey, now: float) -> int | None:
        """The end of the window in which `key` is spent, or None."""
        until = self._until.get(key)
        if until is None:
            return None
        if now >= until:
            del self._until[key]
            return None
        return until

    def purge(self, now: float) -> int:
        expired = [key for key, until in self._until.items() if until <= now]
        for key in expired:
            del self._until[key]
        self._next_purge = min(self._until.values(), default=math.inf)
        return len(expired)

    def _maybe_purge(self, now: float) -> None:
        if now >= self._next_purge:
            self.purge(now)


PURGES_PER_HORIZON: Final = 10
"""RecentAcceptedKeys purges at most this many times per horizon: an aged-out entry lingers at most a tenth of it."""


class RecentAcceptedKeys:
    """When this instance last accepted each secret key from each address."""

    def __init__(self, horizon_seconds: float) -> None:
        self.horizon_seconds = horizon_seconds
        self._last: dict[str, dict[str, float]] = {}  # address -> key id -> when last accepted
        self._next_purge = math.inf

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._last.values())

    def record(self, address: str, key_id: str, now: float) -> None:
        self.record_many(((address, key_id),), now)

    def record_many(self, accepted: Iterable[tuple[str, str]], now: float) -> None:
        """Each (address, key id) accepted at `now`."""
        if now >= self._next_purge:
            self.purge(now)
        last = self._last
        for address, key_id in accepted:
            keys = last.get(address)
            if keys is None:
                keys = last[address] = {}
            was = keys.get(key_id)
            if was is None or was < now:
                keys[key_id] = now
        self._next_purge = min(self._next_purge, now + self.horizon_seconds)

    def accepted_within(self, address: str, key_id: str, now: float) -> bool:
        """Accepted from `address` less than `horizon_seconds` before `now`."""
        last = self._last.get(address, {}).get(key_id)
        return last is not None and 0 <= now - last < self.horizon_seconds

    def accepted_from(self, address: str, now: float) -> dict[str, float]:
        """Every key accepted from `address` within the horizon, with when it last was."""
        return {k: last for k, last in self._last.get(address, {}).items() if 0 <= now - last < self.horizon_seconds}

    def purge(self, now: float) -> int:
        stale = 0
        for address in list(self._last):
            keys = self._last[address]
            for key_id in [k for k, last in keys.items() if now - last >= self.horizon_seconds]:
                del keys[key_id]
                stale += 1
            if not keys:
                del self._last[address]
        earliest = min((last + self.horizon_seconds for keys in self._last.values() for last in keys.values()),
                       default=math.inf)
        # a purge reads every entry: with addresses each seen once, entries age out one after another, so purging at
        # each one's end would read them all on nearly every request; entries past the horizon answer nothing
        # (accepted_within and accepted_from check the time), so purging a little late only keeps them longer
        self._next_purge = max(earliest, now + self.horizon_seconds / PURGES_PER_HORIZON)
        return stale


class LocalWindows:
    """This instance's own fixed windows, with the same rules, for when the shared counter store cannot answer."""

    def __init__(self) -> None:
        self._windows: dict[CounterKey, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def incr(self, key: CounterKey, window_start: int, by: int = 1) -> int:
        """The total of `key` in the window starting at `window_start`, after adding `by`."""
        start, total = self._windows.get(key, (window_start, 0))
        if window_start < start:
            return by  # a window already left behind: count nothing into the current one
        if window_start > start:
            total = 0
        total += by
        self._windows[key] = (window_start, total)
        return total

    def peek(self, key: CounterKey, window_start: int) -> int:
        start, total = self._windows.get(key, (window_start, 0))
        return total if start == window_start else 0

    def count(self, plan: CountPlan, now: float) -> dict[CounterKey, int]:
        """Counts for `decide`, as the shared store would answer them: increments, then the block read."""
        counts = {key: self.incr(key, key.window_start(now)) for key in plan.increments}
        for key in plan.reads:
            counts[key] = self.peek(key, key.window_start(now))
        return counts

    def purge(self, now: float) -> int:
        ended = [key for key, (start, _) in self._windows.items() if start + key.rule.window_seconds <= now]
        for key in ended:
            del self._windows[key]
        return len(ended)


# --- budget leases: counts taken from the shared counter ahead of requests, admitted locally -----------------------
#
# An instance takes s counts at once from a shared counter (`+s`); the store's total T gives it the numbers
# T-s+1 ... T, its own. A request is admitted on a number no greater than the limit, as without leases, so any
# number of instances together never admit more than the limit. A number is never given to two requests, and
# numbers over the limit are never kept. An instance that stops seeing a counter gives its unused numbers back
# (`-k`), so that the others can still admit them: the shared total always covers every number used or held.


@dataclass(frozen=True)
class LeasePolicy:
    """How far ahead of its requests an instance counts. `max_lease` 1 turns leases off."""

    max_lease: int
    fraction: int  # a lease takes at most this fraction of what is left of the budget

    def __post_init__(self) -> None:
        if self.max_lease < 1 or self.fraction < 1:
            raise ValueError("max_lease and fraction must be at least 1")


def leases_for(rule: RuleId) -> bool:
    """Rules whose counts may be leased. The auth_failure block reads its counter's total, so it is never leased."""
    return rule is not RuleId.AUTH_FAILURE


def lease_size(
    policy: LeasePolicy, rule: RuleId, wanted: int, limit: int, seen: int, previous: int, demand: int
) -> int:
    """How many counts to take for `wanted` requests waiting now (0 when prefetching).

    The waiting requests always get their counts in one publish. Beyond them a grant covers the counter's `demand`
    here (the counts it used over the last lease horizon, decayed), growing at most by doubling from the `previous`
    grant, and never more than `max_lease` nor 1/`fraction` of what this instance last saw left of the budget: a
    rarely used counter takes one count at a time, and near the limit every count is asked for when it is needed.
    """
    if min(wanted, limit, previous, demand) < 0:
        raise ValueError("counts are never negative")
    headroom = limit - seen
    if not leases_for(rule) or headroom <= wanted:
        return wanted
    ramp = 2 * previous if previous else 1
    return max(wanted, min(ramp, demand, policy.max_lease, headroom // policy.fraction))


def prefetch_size(
    policy: LeasePolicy, rule: RuleId, held: int, limit: int, seen: int, previous: int, demand: int
) -> int:
    """How many counts to take ahead of need, or 0: once what is held covers less than half of the demand expected
    over the horizon (at most `max_lease`), so that a busy counter never waits for the store."""
    target = min(demand, policy.max_lease)
    if target < 2 or held * 2 > target:
        return 0
    return lease_size(policy, rule, 0, limit, seen, previous, demand)


def decayed(count: float, since: float, now: float, horizon: float) -> float:
    """A count of uses, decayed exponentially over `horizon` seconds: about the uses of the last horizon."""
    if now <= since:
        return count
    return count * math.exp((since - now) / horizon)


def granted_numbers(total: int, size: int) -> range:
    """The numbers a grant of `size` counts owns, from the counter's total after it."""
    if size < 0:
        raise ValueError("a grant is never negative")
    return range(total - size + 1, total + 1)


def usable(numbers: range, limit: int) -> range:
    """The numbers of a grant that can admit a request (those over the limit only refuse)."""
    return range(numbers.start, min(numbers.stop, limit + 1)) if numbers.start <= limit else range(0)


def give_back_due(held: int, last_used: float, now: float, idle_seconds: float) -> bool:
    """Unused counts go back to the shared counter once nothing here has used them for `idle_seconds`."""
    return held > 0 and now - last_used >= idle_seconds


def failing_over() -> Decision:
    """A request the limits cannot decide exactly right now (the store is failing over): 503, retry shortly."""
    return Decision(503, "unavailable", "the limits store is failing over; retry in a moment",
                    retry_after=FAILOVER_RETRY_AFTER_S)
