"""The stream declaration covers the catalog; subject matching follows NATS wildcards; settings have SPEC defaults."""

from __future__ import annotations

import pytest

from services.api.settings import ApiSettings
from services.auth.settings import AuthSettings
from services.encode.settings import EncodeSettings
from services.media.settings import MediaSettings
from services.sweep.settings import SweepSettings
from shared.contracts import contract
from shared.events import CATALOG, dlq_subject
from shared.identities import IDENTITIES, JS_API, publisher_like
from shared.metrics import Metrics
from shared.settings import CommonSettings
from shared.streams import STREAMS, stream_config, stream_for_subject, subject_matches


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("*.b", "a.b", True),
        ("a.b.c", "a.b", False),
        (">", "x", True),
    ],
)
def test_subject_matches(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


@pytest.mark.parametrize("event_type", sorted(CATALOG))
def test_every_event_type_is_kept_by_exactly_one_stream(event_type: str) -> None:
    for subject in contract(event_type).subjects:  # its account subject's wildcard, and its bare type while legacy
        keeping = [s.name for s in STREAMS if any(subject_matches(p, subject) for p in s.subjects)]
        assert keeping == [contract(event_type).stream], (subject, keeping)
    assert stream_for_subject(dlq_subject(event_type)).name == "DLQ"


def test_streams_do_not_overlap() -> None:
    patterns = [(s.name, p) for s in STREAMS for p in s.subjects]
    for name_a, a in patterns:
        for name_b, b in patterns:
            if name_a != name_b:
                assert not subject_matches(a, b.replace(">", "x")) and not subject_matches(b, a.replace(">", "x"))


def test_stream_config_takes_retention_dedupe_and_replicas_from_settings() -> None:
    settings = CommonSettings(stream_replicas=3, stream_max_age_seconds=7, stream_duplicate_window_seconds=5)
    for spec in STREAMS:
        cfg = stream_config(spec, settings)
        assert cfg.num_replicas == 3 and cfg.duplicate_window == 5.0
        assert cfg.max_age == float(spec.max_age_seconds or 7)


def test_every_stream_an_identity_may_direct_get_from_allows_direct_gets_and_no_other() -> None:
    """A right to `$JS.API.DIRECT.GET.<stream>.<subject>` (auth's counters; a team's own subjects, README "Who may use
    the bus") is answered only by a stream that allows direct gets: without it the request gets "no responders"."""
    direct = f"{JS_API}.DIRECT.GET."
    team = publisher_like("acme", ["acme1"])
    read = {r.subject.removeprefix(direct).split(".", 1)[0]
            for i in (*IDENTITIES.values(), team) for r in i.publish if r.subject.startswith(direct)}
    allowing = {spec.name for spec in STREAMS if stream_config(spec, CommonSettings()).allow_direct}
    assert read == allowing == {"ENCODE", "LIMITS", "VIDEOS"}


def test_spec_defaults() -> None:
    """SPEC section 8, by name and default."""
    auth, api, enc, sweep = AuthSettings(), ApiSettings(), EncodeSettings(), SweepSettings()
    assert (auth.limit_address_per_minute, auth.limit_auth_failure_per_minute) == (300, 30)
    assert (auth.limit_key_per_minute, auth.limit_owner_per_minute, auth.limit_upload_token_per_minute) == (
        300, 1200, 1200,
    )
    assert (auth.limit_app_create_per_hour, auth.limit_key_rotate_per_hour, auth.limit_window_seconds) == (10, 10, 60)
    assert (auth.counter_store_timeout_ms, auth.upload_token_ttl_seconds) == (25, 3600)
    assert api.part_url_ttl_seconds == 3600
    assert (enc.processing_deadline_seconds, enc.dispatch_retry_seconds, enc.stuck_restart_seconds) == (
        10800, 20, 21600,
    )
    assert (sweep.claim_stale_seconds, sweep.sweep_min_age_seconds, sweep.sweep_max_retire_share) == (900, 86400, 0.5)
    assert (sweep.sweep_valve_min_candidates, sweep.sweep_daily_at) == (20, "03:00")
    assert MediaSettings().media_slots >= 1 and MediaSettings().media_heartbeat_seconds == 5
    assert CommonSettings().stream_max_age_seconds == 30 * 86400


def test_metrics_render_prometheus_text() -> None:
    m = Metrics("svc")
    m.inc("things_total", 2, "things", kind="a")
    m.set("depth", 5, "queue depth")
    text = m.render()
    assert '# TYPE weir_things_total counter' in text
    assert 'weir_things_total{kind="a",service="svc"} 2.0' in text
    assert 'weir_depth{service="svc"} 5.0' in text
    assert m.value("things_total", kind="a") == 2


def test_settings_are_shown_without_secrets() -> None:
    from pydantic import SecretStr

    from shared.settings import redact

    assert redact(SecretStr("s3cr3t")) == "(set)" and redact(SecretStr("")) == "(unset)"
    assert redact("postgresql://weir:hunter2@db:5432/weir") == "postgresql://weir:***@db:5432/weir"
    assert redact("postgresql://postgres@127.0.0.1:5432/weir") == "postgresql://postgres@127.0.0.1:5432/weir"
    assert redact("nats://a:pw@n1:4222,nats://a:pw@n2:4222") == "nats://a:***@n1:4222,nats://a:***@n2:4222"
    assert redact(5) == 5
