"""What `weir dlq` prints of a parked message, and what it selects: pure functions, no server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from shared.bus import HDR_CONSUMER, HDR_ERROR, HDR_ORIGINAL_SUBJECT
from weir.deadletters import Parked, original_of, redact_body, redact_headers, redact_text, selected

KEY = "wsk_" + "Zz09" * 10
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def parked(headers: dict[str, str], data: bytes = b"{}", subject: str = "dlq.upload.completed") -> Parked:
    return Parked(seq=7, subject=subject, time=NOW, headers=headers, data=data)


def test_a_key_keeps_its_12_character_prefix_and_bearer_values_are_masked() -> None:
    text = redact_text(f"refused {KEY}; Authorization: Bearer opaque-thing")
    assert KEY not in text and f"{KEY[:12]}…" in text and "opaque-thing" not in text and "Bearer ***" in text


def test_credential_named_headers_are_masked_whole_and_others_redacted() -> None:
    shown = redact_headers({"X-Weir-Internal-Token": "abc", "Authorization": "x", HDR_ERROR: f"bad {KEY}",
                            HDR_CONSUMER: "api_status"})
    assert shown["X-Weir-Internal-Token"] == "***" and shown["Authorization"] == "***"
    assert shown[HDR_CONSUMER] == "api_status" and KEY not in shown[HDR_ERROR]


def test_the_body_masks_credential_fields_and_keeps_a_key_prefix_of_12() -> None:
    body = {"id": "e1", "data": {"key_prefix": KEY, "upload_token": "wut_secretsecret.sig", "route": KEY}}
    shown = json.loads(redact_body(json.dumps(body).encode()))
    assert shown["data"]["key_prefix"] == KEY[:12] and shown["data"]["upload_token"] == "***"
    assert KEY not in shown["data"]["route"]
    assert redact_body(b"{not json " + KEY.encode()) == "{not json " + KEY[:12] + "…"


def test_selection_by_type_time_and_consumer() -> None:
    p = parked({HDR_CONSUMER: "encode_uploads"})
    assert selected(p, event_type="upload.completed", since=NOW, consumer="encode_uploads")
    assert not selected(p, event_type="video.created", since=None, consumer=None)
    assert not selected(p, event_type=None, since=NOW + timedelta(seconds=1), consumer=None)
    assert not selected(p, event_type=None, since=None, consumer="api_status")


def test_a_copy_parked_from_the_replay_path_is_sent_back_from_its_bare_type() -> None:
    assert original_of(parked({HDR_ORIGINAL_SUBJECT: "replay.encode_uploads.upload.completed"})) == "upload.completed"
    assert original_of(parked({})) == "upload.completed"
    assert parked({}, data=b'{"id": "abc"}').event_id == "abc" and parked({}, data=b"[").event_id is None
