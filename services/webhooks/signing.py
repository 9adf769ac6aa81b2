"""Standard Webhooks signing (SPEC 13) with the `standardwebhooks` package, so that any Standard Webhooks library
verifies Weir's deliveries: secrets `whsec_<base64>`, and the three headers of one delivery, one `v1,` signature
per secret that signs now (the new and the old during a rotation's overlap)."""

from __future__ import annotations

import base64
import binascii
import math
import secrets as random
from collections.abc import Sequence
from datetime import UTC, datetime

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"
SECRET_MIN_BYTES, SECRET_MAX_BYTES = 24, 64  # Standard Webhooks: secrets of 24 to 64 random bytes

ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER = "webhook-id", "webhook-timestamp", "webhook-signature"


def new_secret(nbytes: int = 32) -> str:
    """A fresh signing secret, `whsec_` and the base64 of `nbytes` random bytes (shown to the developer once)."""
    if not SECRET_MIN_BYTES <= nbytes <= SECRET_MAX_BYTES:
        raise ValueError(f"a secret has {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes")
    return SECRET_PREFIX + base64.b64encode(random.token_bytes(nbytes)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The key bytes of a `whsec_` secret; ValueError for anything else (a secret is checked before it is kept)."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("a signing secret starts with whsec_")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except binascii.Error:
        raise ValueError("a signing secret is whsec_ and base64") from None
    if not SECRET_MIN_BYTES <= len(key) <= SECRET_MAX_BYTES:
        raise ValueError(f"a signing secret has {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes")
    return key


def signed_headers(msg_id: str, timestamp: datetime, body: bytes, secrets: Sequence[str]) -> dict[str, str]:
    """The Standard Webhooks headers of one delivery: `webhook-id` (the event id, the same on every retry and
    replay, so receivers de-duplicate by it), `webhook-timestamp` (whole seconds) and `webhook-signature`, the
    space-separated `v1,<base64 HMAC-SHA256>` of each secret, in the order given (current first)."""
    if not secrets:
        raise ValueError("a delivery is signed with at least one secret")
    if timestamp.tzinfo is None:
        raise ValueError("the timestamp must be timezone-aware")  # the package would read a naive one as UTC
    when = timestamp.astimezone(UTC)
    signatures = " ".join(Webhook(secret_key(s)).sign(msg_id=msg_id, timestamp=when, data=body) for s in secrets)
    return {ID_HEADER: msg_id, TIMESTAMP_HEADER: str(math.floor(when.timestamp())), SIGNATURE_HEADER: signatures}
