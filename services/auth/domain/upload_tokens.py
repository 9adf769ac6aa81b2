"""Upload tokens: `wut_` + base64url(JSON claims) + `.` + base64url(HMAC-SHA256), minted for one video."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

UPLOAD_TOKEN_PREFIX: Final = "wut_"
MAX_CREDENTIAL_LENGTH: Final = 1024
"""A longer upload token is malformed before any decoding work is spent on it."""

_B64URL = r"[A-Za-z0-9_-]+"
UPLOAD_TOKEN_SHAPE = re.compile(rf"{UPLOAD_TOKEN_PREFIX}({_B64URL})\.({_B64URL})")

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
    match = UPLOAD_TOKEN_SHAPE.fullmatch(token) if len(token) <= MAX_CREDENTIAL_LENGTH else None
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
