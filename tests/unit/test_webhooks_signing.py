"""Standard Webhooks signing (SPEC 13): what Weir signs verifies with the `standardwebhooks` package, and matches a
hand-written HMAC-SHA256 of the specification's own test vector."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from datetime import UTC, datetime, timedelta

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from services.webhooks.settings import WebhookSettings
from services.webhooks.signing import (
    ID_HEADER,
    SECRET_PREFIX,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    new_secret,
    secret_key,
    signed_headers,
)

SETTINGS = WebhookSettings()

# The Standard Webhooks specification's example, as the package's own tests sign it (test_sign_function)
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

BODY = b'{"id":"0190a6c2-0000-7000-8000-000000000001","type":"video.created","data":{"video_id":"v1"}}'
MSG_ID = "0190a6c2-0000-7000-8000-000000000001"


def by_hand(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The specification's signature, written out: HMAC-SHA256 keyed by the secret's base64-decoded bytes over
    `{id}.{timestamp}.{body}`, base64, prefixed `v1,`."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def now() -> datetime:
    return datetime.now(UTC)  # the package verifies against its own clock, within 5 minutes


def test_the_hand_written_check_reproduces_the_spec_vector() -> None:
    assert hmac.compare_digest(by_hand(SPEC_SECRET, SPEC_MSG_ID, SPEC_TIMESTAMP, SPEC_BODY), SPEC_SIGNATURE)


def test_weir_signs_the_spec_vector_as_the_spec_says() -> None:
    headers = signed_headers(SPEC_MSG_ID, datetime.fromtimestamp(SPEC_TIMESTAMP, UTC), SPEC_BODY, [SPEC_SECRET])
    assert headers == {ID_HEADER: SPEC_MSG_ID, TIMESTAMP_HEADER: str(SPEC_TIMESTAMP), SIGNATURE_HEADER: SPEC_SIGNATURE}


def test_a_delivery_verifies_with_the_package() -> None:
    secret = new_secret(SETTINGS.webhook_secret_bytes)
    headers = signed_headers(MSG_ID, now(), BODY, [secret])
    assert Webhook(secret).verify(BODY, headers) == {"id": MSG_ID, "type": "video.created",
                                                     "data": {"video_id": "v1"}}


def test_a_delivery_verifies_by_hand_in_constant_time() -> None:
    secret = new_secret(SETTINGS.webhook_secret_bytes)
    headers = signed_headers(MSG_ID, now(), BODY, [secret])
    expected = by_hand(secret, MSG_ID, int(headers[TIMESTAMP_HEADER]), BODY)
    assert hmac.compare_digest(headers[SIGNATURE_HEADER], expected)


def test_during_a_rotation_both_secrets_sign_and_each_verifies_alone() -> None:
    new, old = new_secret(SETTINGS.webhook_secret_bytes), new_secret(SETTINGS.webhook_secret_bytes)
    headers = signed_headers(MSG_ID, now(), BODY, [new, old])
    entries = headers[SIGNATURE_HEADER].split(" ")
    assert len(entries) == 2 and all(re.fullmatch(r"v1,[A-Za-z0-9+/]{43}=", e) for e in entries)
    timestamp = int(headers[TIMESTAMP_HEADER])
    assert hmac.compare_digest(entries[0], by_hand(new, MSG_ID, timestamp, BODY))
    assert hmac.compare_digest(entries[1], by_hand(old, MSG_ID, timestamp, BODY))
    for secret in (new, old):
        Webhook(secret).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(BODY, headers)


@pytest.mark.parametrize("change", ["body", "id", "timestamp"])
def test_a_changed_body_id_or_timestamp_does_not_verify(change: str) -> None:
    secret = new_secret()
    when = now()
    headers = signed_headers(MSG_ID, when, BODY, [secret])
    body = BODY
    if change == "body":
        body = BODY.replace(b"v1", b"v2")
    elif change == "id":
        headers[ID_HEADER] = MSG_ID[:-1] + "2"
    else:
        headers[TIMESTAMP_HEADER] = str(int(when.timestamp()) + 1)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, headers)


def test_the_timestamp_is_whole_seconds_of_the_moment_given_whatever_its_zone() -> None:
    when = datetime(2026, 12, 4, 10, 0, 0, 900_000, tzinfo=UTC)
    elsewhere = when.astimezone(datetime.now().astimezone().tzinfo)
    headers = signed_headers(MSG_ID, elsewhere, BODY, [SPEC_SECRET])
    assert headers[TIMESTAMP_HEADER] == str(int(when.replace(microsecond=0).timestamp()))


def test_a_naive_timestamp_or_no_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        signed_headers(MSG_ID, datetime(2026, 12, 4), BODY, [SPEC_SECRET])
    with pytest.raises(ValueError):
        signed_headers(MSG_ID, now(), BODY, [])


def test_a_new_secret_is_whsec_and_the_settings_bytes_and_never_repeats() -> None:
    secrets = {new_secret(SETTINGS.webhook_secret_bytes) for _ in range(50)}
    assert len(secrets) == 50
    for secret in secrets:
        assert secret.startswith(SECRET_PREFIX)
        assert len(secret_key(secret)) == SETTINGS.webhook_secret_bytes


@pytest.mark.parametrize("nbytes", [23, 65, 0])
def test_a_secret_outside_the_specs_sizes_is_not_made(nbytes: int) -> None:
    with pytest.raises(ValueError):
        new_secret(nbytes)


@pytest.mark.parametrize("secret", [
    "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",  # no prefix
    "whsec_not base64!",
    "whsec_" + base64.b64encode(b"x" * 16).decode(),  # too short
    "whsec_",
])
def test_only_whsec_base64_secrets_of_the_specs_sizes_are_keys(secret: str) -> None:
    with pytest.raises(ValueError):
        secret_key(secret)


def test_an_old_delivery_is_refused_by_the_receivers_tolerance() -> None:
    """Why a replay is signed anew: receivers refuse timestamps over 5 minutes old (the package's tolerance)."""
    secret = new_secret()
    headers = signed_headers(MSG_ID, now() - timedelta(minutes=6), BODY, [secret])
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, headers)
