"""What a presented credential is, told by its shape alone, and how keys are minted and hashed.

`Authorization: Bearer <credential>` carries one customer credential (`wat_`, `wsk_`, `wpk_` or `wut_`);
`X-Weir-Internal-Token` carries Weir's internal token beside it. A Bearer value without a Weir prefix (or any other
scheme) claims to be the internal token: it is judged like the header, so nothing unrecognised passes unjudged. The
internal token is real only if every candidate is the real one; an unset one accepts nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from services.auth.domain.upload_tokens import MAX_CREDENTIAL_LENGTH, UPLOAD_TOKEN_PREFIX, UPLOAD_TOKEN_SHAPE
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH, CredentialKind

KEY_ALPHABET: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""base62: URL-safe, no padding, survives double-click selection and every shell."""
KEY_BODY_LENGTH: Final = 32
KEY_RANDOM_BYTES: Final = 32
"""256 random bits reduced to 32 base62 digits (about 190 bits); the modulo bias is below 2**-65."""
INTERNAL_TOKEN_HEADER: Final = "X-Weir-Internal-Token"

_KEY_BODY = re.compile(rf"[0-9A-Za-z]{{{KEY_BODY_LENGTH}}}")
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
        shaped = len(value) <= MAX_CREDENTIAL_LENGTH and UPLOAD_TOKEN_SHAPE.fullmatch(value) is not None
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


# --- keys -------------------------------------------------------------------------------------------------------------


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
