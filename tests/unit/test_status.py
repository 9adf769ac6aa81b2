"""`weir status`'s shaping and drawing (weir/status/), without a server: what a snapshot becomes as JSON, as a
view, and as an exit code; how /readyz, /metrics and JetStream's per-subject counts are read."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Enum, Gauge, generate_latest
from rich.console import Console

from services.auth.settings import AuthSettings
from services.auth.throttled import ThrottledCaller, ThrottledReport
from shared.release import FIRST_WITH_VERSION_ROUTE, VERSION, dirty
from shared.streams import STREAMS
from weir.status.bus import dlq_counts
from weir.status.database import farm_view
from weir.status.limits import counter_store_mode, limits_mode
from weir.status.model import (
    NO_VERSION_ROUTE,
    Backlog,
    ConsumerState,
    Farm,
    InstanceRelease,
    Readiness,
    Shedding,
    Snapshot,
    StreamState,
    Unavailable,
    WebhookDeliveries,
    WorkerRow,
    reason_of,
)
from weir.status.render import render
from weir.status.services import (
    parse_service_options,
    readiness,
    release,
    service_addresses,
    service_kind,
    unreachable,
)
from weir.status.shedding import shedding_of
from weir.status.verdict import document, exit_code, not_ready

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TIMEOUT = 15.0  # a heartbeat timeout (the numbers below are fractions and multiples of it)


def worker(name: str, *, slots: int = 2, busy: int = 0, seen: float = 1.0, leaving: bool = False) -> WorkerRow:
    return WorkerRow(name=name, instance=f"{name}-instance", slots=slots, busy=busy, seen_seconds_ago=seen,
                     leaving=leaving)


def healthy(**changes: object) -> Snapshot:
    """A stack where every figure was read and every service is ready."""
    values: dict[str, object] = dict(
        checked_at=NOW,
        services={name: Readiness(f"http://127.0.0.1:{8000 + i}", True, 200, {"nats": "ok"})
                  for i, name in enumerate(("auth", "api", "encode", "sweep", "media-1"))},
        streams={s.name: StreamState(s.name, messages=3, bytes=300, consumers=1) for s in STREAMS},
        consumers={"VIDEOS": [ConsumerState("VIDEOS", "encode_uploads", pending=4, ack_pending=1, redelivered=2,
                                            waiting=1)], "ENCODE": []},
        dlq={"upload.completed": 2},
        outbox={"auth": Backlog(0, None), "api": Backlog(5, 12.5)},
        farm=farm_view([worker("media-1", busy=1), worker("media-2", slots=4)], TIMEOUT),
        limits={"auth": "shared"},
        shedding={"auth": Shedding(shed={"read": 0}), "api": Shedding(shed={"read": 0}, limit=32, in_flight=3,
                                                                      waiting=0, auth_overloaded=0)},
        sweep={"id": "r1", "trigger": "daily", "dry_run": False, "outcome": "completed",
               "started_at": NOW.isoformat(), "examined": 7, "retired": {"stale_file": 2}, "errors": 0},
        webhooks=hooks(),
    )
    values.update(changes)
    return Snapshot(**values)  # type: ignore[arg-type]


LATE_AFTER = 16.0  # the CLI's default: a scan, an attempt's timeout and a claim's grace


def hooks(**changes: object) -> WebhookDeliveries:
    values: dict[str, object] = dict(enabled=3, disabled=1, failing=1, pending=7, oldest_pending_seconds=600.0,
                                     due=2, oldest_due_seconds=0.5, failed_last_hour=4, late_after_seconds=LATE_AFTER)
    values.update(changes)
    return WebhookDeliveries(**values)  # type: ignore[arg-type]


def drawn(snapshot: Snapshot) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(render(snapshot))
    return console.export_text()


# ------------------------------------------------------------------------------------------------ the document


def test_a_healthy_stack_gives_the_documented_shape_and_exit_code_0() -> None:
    snap = healthy()
    doc = document(snap)
    assert json.loads(json.dumps(doc)) == doc  # plain JSON values only
    assert doc["services"]["auth"]["ready"] is True
    assert doc["consumers"] == [{"stream": "VIDEOS", "name": "encode_uploads", "pending": 4, "ack_pending": 1,
                                 "redelivered": 2, "waiting": 1}]
    assert doc["streams"][0] == {"name": STREAMS[0].name, "messages": 3, "bytes": 300, "consumers": 1}
    assert doc["outbox"] == {"auth": 0, "api": 5}
    assert doc["outbox_oldest_unsent_seconds"] == {"auth": None, "api": 12.5}
    assert doc["dlq"] == {"upload.completed": 2}
    assert {k: doc["farm"][k] for k in ("workers", "slots", "busy", "leaving")} == {
        "workers": 2, "slots": 6, "busy": 1, "leaving": 0}
    assert [w["name"] for w in doc["farm"]["detail"]] == ["media-1", "media-2"]
    assert doc["limits"] == {"mode": "shared", "instances": {"auth": "shared"}}
    assert doc["sweep"]["last_run"]["outcome"] == "completed"
    assert doc["unavailable"] == {} and doc["ok"] is True
    assert exit_code(snap) == 0


def test_a_service_that_is_not_ready_makes_exit_code_1() -> None:
    services = {"auth": Readiness("http://a", True, 200), "encode": readiness("http://e", 503, "")}
    snap = healthy(services=services)
    assert exit_code(snap) == 1 and not_ready(snap) == ["encode"]
    doc = document(snap)
    assert doc["services"]["encode"] == {"ready": False, "url": "http://e", "status": 503, "checks": {},
                                         "reason": "HTTP 503", "version": None, "commit": None, "dirty": None,
                                         "version_reason": None}
    assert doc["unavailable"] == {} and doc["ok"] is False  # not ready is not unavailable


def test_each_unreadable_figure_is_null_with_its_reason_and_exit_code_1() -> None:
    db_down = Unavailable("database: ConnectionRefusedError")
    snap = healthy(outbox=db_down, farm=db_down, sweep=db_down)
    doc = document(snap)
    assert doc["outbox"] is None and doc["farm"] is None and doc["sweep"] is None
    assert doc["unavailable"] == {"outbox": db_down.reason, "farm": db_down.reason, "sweep": db_down.reason}
    assert exit_code(snap) == 1 and doc["ok"] is False


def test_a_part_of_a_part_is_unavailable_on_its_own() -> None:
    streams = {"VIDEOS": StreamState("VIDEOS", 1, 10, 2), "LIMITS": Unavailable("stream not found")}
    snap = healthy(streams=streams, consumers={"VIDEOS": [], "LIMITS": Unavailable("stream not found")},
                   outbox={"auth": Backlog(0, None), "media": Unavailable("UndefinedTableError")},
                   limits={"auth": "local", "auth-2": Unavailable("http://x/metrics: ConnectError")})
    doc = document(snap)
    assert doc["streams"] == [{"name": "VIDEOS", "messages": 1, "bytes": 10, "consumers": 2},
                              {"name": "LIMITS", "messages": None, "bytes": None, "consumers": None}]
    assert doc["consumers"] == []
    assert doc["outbox"] == {"auth": 0, "media": None}
    # one auth instance not read: the stack's mode is unknown, the other's is shown
    assert doc["limits"] == {"mode": None, "instances": {"auth": "local", "auth-2": None}}
    assert doc["unavailable"] == {"streams.LIMITS": "stream not found", "consumers.LIMITS": "stream not found",
                                  "outbox.media": "UndefinedTableError",
                                  "limits.auth-2": "http://x/metrics: ConnectError"}
    assert exit_code(snap) == 1


def test_no_service_addresses_is_unavailable_and_exit_code_1() -> None:
    nowhere = Unavailable("no service addresses")
    snap = healthy(services=nowhere, limits=nowhere)
    doc = document(snap)
    assert doc["services"] is None and doc["limits"] is None
    assert doc["unavailable"] == {"services": "no service addresses", "limits": "no service addresses"}
    assert exit_code(snap) == 1
    assert exit_code(healthy(services={})) == 1  # nothing asked is not "everything ready"


def test_no_sweep_run_yet_is_an_answer() -> None:
    snap = healthy(sweep=None)
    assert document(snap)["sweep"] == {"last_run": None}
    assert exit_code(snap) == 0


# ------------------------------------------------------------------------------------------------ readings


def test_readiness_from_the_readyz_answer() -> None:
    ok = readiness("http://s", 200, json.dumps({"status": "ready", "checks": {"nats": "ok"}}))
    assert ok.ready and ok.reason is None and ok.checks == {"nats": "ok"}
    body = {"status": 503, "code": "unavailable", "detail": "a dependency does not answer",
            "checks": {"nats": "ok", "database": "unavailable: TimeoutError"}}
    down = readiness("http://s", 503, json.dumps(body))
    assert not down.ready and down.reason == "HTTP 503: database unavailable: TimeoutError"
    assert readiness("http://s", 404, "not found").reason == "HTTP 404: not found"
    gone = unreachable("http://s", ConnectionRefusedError("refused"))
    assert not gone.ready and gone.status is None and gone.reason == "unreachable: ConnectionRefusedError: refused"


WEIR_TEXT = """# HELP weir_counter_store_shared 1 while limits are counted in the shared store, 0 while on local windows
# TYPE weir_counter_store_shared gauge
weir_counter_store_shared{service="auth"} %d
# HELP weir_counter_store_switches_total switches between shared and local
# TYPE weir_counter_store_switches_total counter
weir_counter_store_switches_total{service="auth",to="local"} 1
"""


@pytest.mark.parametrize(("value", "mode"), [(1, "shared"), (0, "local")])
def test_the_limits_mode_from_weirs_own_exposition(value: int, mode: str) -> None:
    assert counter_store_mode(WEIR_TEXT % value) == mode


@pytest.mark.parametrize("mode", ["shared", "local"])
def test_the_limits_mode_from_prometheus_client_expositions(mode: str) -> None:
    labelled = CollectorRegistry()
    gauge = Gauge("weir_counter_store_mode", "the counter store's mode", ["mode"], registry=labelled)
    for m in ("shared", "local"):
        gauge.labels(mode=m).set(1 if m == mode else 0)
    assert counter_store_mode(generate_latest(labelled).decode()) == mode

    enum = CollectorRegistry()
    Enum("weir_counter_store_mode", "the counter store's mode", states=["shared", "local"], registry=enum).state(mode)
    assert counter_store_mode(generate_latest(enum).decode()) == mode

    bare = CollectorRegistry()
    Gauge("weir_counter_store_mode", "1 shared, 0 local", registry=bare).set(1 if mode == "shared" else 0)
    assert counter_store_mode(generate_latest(bare).decode()) == mode


def test_no_mode_series_is_an_error() -> None:
    with pytest.raises(ValueError, match="weir_counter_store_mode"):
        counter_store_mode("# TYPE weir_other gauge\nweir_other 1\n")


def test_dlq_counts_by_event_type() -> None:
    subjects = {"dlq.upload.completed": 3, "dlq.encode.progress": 1, "dlq.video.created": 0, "other": 5}
    assert dlq_counts(subjects) == {"encode.progress": 1, "upload.completed": 3}
    assert dlq_counts(None) == {}


def test_the_farm_counts_live_workers_as_encodes_registry_does() -> None:
    farm = farm_view([
        worker("media-2", slots=4, busy=3, seen=TIMEOUT / 3),
        worker("media-1", slots=2, busy=1, seen=0.1),
        worker("media-3", slots=8, seen=TIMEOUT * 2),  # silent past the timeout: gone
        worker("media-4", slots=2, seen=0.5, leaving=True),  # SIGTERM: takes no more offers
    ], TIMEOUT)
    assert [w.name for w in farm.workers] == ["media-1", "media-2"]
    assert (len(farm.workers), farm.slots, farm.busy) == (2, 6, 4)
    assert [w.name for w in farm.leaving] == ["media-4"]
    assert farm_view([worker("media-1", seen=TIMEOUT)], TIMEOUT).slots == 2  # the timeout itself is live


def test_limits_mode_across_auth_instances() -> None:
    assert limits_mode(["shared", "shared"]) == "shared"
    assert limits_mode(["local"]) == "local"
    assert limits_mode(["shared", "local"]) == "mixed"
    assert limits_mode([]) is None


# ------------------------------------------------------------------------------------------------ addresses


def test_service_options_and_the_stack_file(tmp_path: Path) -> None:
    assert parse_service_options(["auth=http://127.0.0.1:1/", "media-2 = http://h:2"]) == {
        "auth": "http://127.0.0.1:1", "media-2": "http://h:2"}
    for bad in ("auth", "=http://x", "auth=127.0.0.1:1"):
        with pytest.raises(ValueError, match="NAME=URL"):
            parse_service_options([bad])
    assert service_kind("media-2") == "media" and service_kind("auth") == "auth"

    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"services": {"auth": "http://127.0.0.1:9/", "media-1": "http://127.0.0.1:8"}}))
    assert service_addresses([], stack) == {"auth": "http://127.0.0.1:9", "media-1": "http://127.0.0.1:8"}
    # given options name every service to ask: the stack file's are not added
    assert service_addresses(["api=http://a:1"], stack) == {"api": "http://a:1"}
    missing = service_addresses([], tmp_path / "none.json")
    assert isinstance(missing, Unavailable) and "--service" in missing.reason
    stack.write_text("{not json")
    assert isinstance(service_addresses([], stack), Unavailable)


def test_reason_of_an_error_is_one_short_line() -> None:
    assert reason_of(TimeoutError()) == "TimeoutError"
    assert reason_of(OSError("first\nsecond")) == "OSError: first"
    assert len(reason_of(RuntimeError("x" * 1000))) == 300


# ------------------------------------------------------------------------------------------------ the view


def test_the_view_shows_every_part() -> None:
    text = drawn(healthy())
    assert "everything answered and is ready" in text
    for shown in ("encode_uploads", "upload.completed", "farm: 2 worker(s), 1 of 6 slot(s) busy",
                  "limits store: auth shared", "sweep: last run", "retired 2", "12 s"):
        assert shown in text, shown


def test_the_view_names_what_is_not_ready_and_why_a_figure_is_missing() -> None:
    snap = healthy(services={"media-2": unreachable("http://m", ConnectionRefusedError())},
                   farm=Unavailable("database: ConnectionRefusedError"), dlq={}, sweep=None,
                   limits={"auth": "local"})
    text = drawn(snap)
    assert "not ready: media-2, 1 figure(s) unavailable" in text
    assert "NOT READY" in text and "unreachable: ConnectionRefusedError" in text
    assert "farm: unavailable: database: ConnectionRefusedError" in text
    assert "dlq: empty" in text and "sweep: no run yet" in text and "limits store: auth local" in text


def test_the_farm_view_lists_leaving_workers() -> None:
    snap = healthy(farm=Farm(workers=(), leaving=(worker("media-9", leaving=True),), heartbeat_timeout_seconds=1))
    text = drawn(snap)
    assert "0 worker(s), 0 of 0 slot(s) busy, 1 leaving" in text and "media-9 (leaving)" in text


# ---------------------------------------------------------------------------------------------- versions (SPEC 11)

COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40


def with_releases(releases: dict[str, InstanceRelease | Unavailable | None]) -> Snapshot:
    """The healthy stack, each service running the release given for it."""
    base = healthy()
    assert not isinstance(base.services, Unavailable)
    return healthy(services={name: dataclasses.replace(r, release=releases.get(name))
                             for name, r in base.services.items()})


def one_release(version: str = VERSION, commit: str = COMMIT) -> InstanceRelease:
    return InstanceRelease(version=version, commit=commit)


def test_release_from_the_version_answer_is_read_tolerantly() -> None:
    newer = {"service": "api", "version": "1.2.0", "commit": COMMIT, "contracts": {"events": {}, "replies": {}},
             "built_at": "2027-01-01T00:00:00Z"}  # a field a newer release adds
    assert release(200, json.dumps(newer)) == InstanceRelease(version="1.2.0", commit=COMMIT, service="api")
    changed = {**newer, "dirty": True}  # a checkout with changes: shown after the commit
    assert release(200, json.dumps(changed)) == InstanceRelease(version="1.2.0", commit=COMMIT, service="api",
                                                                dirty=True)
    assert release(404, '{"status": 404}') == InstanceRelease(version=None)
    assert release(404, "").label == NO_VERSION_ROUTE == f"before {FIRST_WITH_VERSION_ROUTE} (no /version)"
    refused = release(503, "")
    assert isinstance(refused, Unavailable) and "HTTP 503" in refused.reason
    wrong = release(200, json.dumps({"service": "api"}))
    assert isinstance(wrong, Unavailable) and "version" in wrong.reason
    truncated = release(200, json.dumps(newer)[:20])
    assert isinstance(truncated, Unavailable) and "not a version" in truncated.reason


def test_one_version_everywhere_is_no_warning() -> None:
    snap = with_releases({name: one_release() for name in ("auth", "api", "encode", "sweep", "media-1")})
    doc = document(snap)
    assert doc["versions"] == {VERSION: ["api", "auth", "encode", "media-1", "sweep"]}
    assert doc["warnings"] == []
    assert {k: doc["services"]["api"][k] for k in ("version", "commit", "version_reason")} == {
        "version": VERSION, "commit": COMMIT, "version_reason": None}
    assert exit_code(snap) == 0


def test_several_versions_are_a_warning_not_a_failure() -> None:
    snap = with_releases({"auth": one_release("1.0.1"), "api": one_release(), "encode": one_release("1.10.0"),
                          "sweep": InstanceRelease(version=None), "media-1": one_release()})
    doc = document(snap)
    # oldest first: an instance without /version, then by number (1.10.0 after 1.1.0)
    assert list(doc["versions"]) == [NO_VERSION_ROUTE, "1.0.1", VERSION, "1.10.0"]
    assert doc["versions"][VERSION] == ["api", "media-1"]
    assert doc["services"]["sweep"]["version"] == NO_VERSION_ROUTE and doc["services"]["sweep"]["commit"] is None
    assert len(doc["warnings"]) == 1 and doc["warnings"][0].startswith("the stack runs 4 versions: ")
    assert f"{NO_VERSION_ROUTE} (sweep)" in doc["warnings"][0]
    assert doc["ok"] is True and exit_code(snap) == 0
    text = drawn(snap)
    assert "warning: the stack runs 4 versions" in text
    assert NO_VERSION_ROUTE in text and "1.0.1" in text and COMMIT[:12] in text and COMMIT[:13] not in text


def test_an_instance_running_changes_not_in_its_commit_is_marked_dirty() -> None:
    snap = with_releases({"auth": one_release(), "api": InstanceRelease(version=VERSION, commit=COMMIT, dirty=True)})
    doc = document(snap)
    assert (doc["services"]["api"]["dirty"], doc["services"]["auth"]["dirty"]) == (True, None)
    text = drawn(snap)
    assert text.count(f"{COMMIT[:12]}+dirty") == 1 and text.count(COMMIT[:12]) == 2


def test_one_version_from_two_commits_is_a_warning() -> None:
    snap = with_releases({"auth": one_release(), "api": one_release(commit=OTHER_COMMIT)})
    doc = document(snap)
    assert doc["versions"] == {VERSION: ["api", "auth"]}
    assert doc["warnings"] == [f"version {VERSION} runs from 2 commits: {COMMIT[:12]} (auth); "
                               f"{OTHER_COMMIT[:12]} (api)"]


def test_an_unreadable_version_is_shown_with_why_and_counts_for_no_release() -> None:
    snap = with_releases({"auth": one_release(), "api": Unavailable("/version: HTTP 503")})
    doc = document(snap)
    assert doc["services"]["api"]["ready"] is True  # its /readyz answered; only its /version did not
    assert (doc["services"]["api"]["version"], doc["services"]["api"]["version_reason"]) == (None,
                                                                                             "/version: HTTP 503")
    assert doc["versions"] == {VERSION: ["auth"]} and doc["warnings"] == []
    assert doc["unavailable"] == {} and exit_code(snap) == 0
    assert "unavailable: /version: HTTP 503" in drawn(snap)


SHEDDING_METRICS = """# HELP weir_shed_total requests refused
# TYPE weir_shed_total counter
weir_shed_total{priority="internal",service="api"} 0.0
weir_shed_total{priority="read",service="api"} 120.0
weir_shed_total{priority="write",service="api"} 3.0
# TYPE weir_shed_limit gauge
weir_shed_limit{service="api"} 43.5
# TYPE weir_shed_in_flight gauge
weir_shed_in_flight{service="api"} 12.0
# TYPE weir_shed_waiting gauge
weir_shed_waiting{service="api"} 1.0
# TYPE weir_auth_overloaded_total counter
weir_auth_overloaded_total{service="api"} 7.0
"""


def test_shedding_is_read_from_metrics_and_shown() -> None:
    shed = shedding_of(SHEDDING_METRICS)
    assert shed == Shedding(shed={"internal": 0, "read": 120, "write": 3}, limit=43.5, in_flight=12.0, waiting=1.0,
                            auth_overloaded=7)
    snapshot = healthy(shedding={"api": shed, "auth": Shedding(shed={"read": 5})})
    text = drawn(snapshot)
    assert "api read 120, write 3 (limit 44, 12 in flight, 1 waiting), 7 shed by auth" in text
    assert "auth read 5" in text
    assert document(snapshot)["shedding"]["api"]["shed"] == {"internal": 0, "read": 120, "write": 3}
    assert exit_code(snapshot) == 0  # a figure read, not a failure


def test_shedding_unreadable_is_unavailable() -> None:
    snapshot = healthy(shedding={"api": Unavailable("http://x/metrics: ConnectError")})
    assert "shedding" in str(document(snapshot)["unavailable"])
    assert exit_code(snapshot) == 1


# ------------------------------------------------------------------------------------------------ webhooks


def test_the_webhooks_figures_are_in_the_document_and_the_view() -> None:
    snap = healthy()
    doc = document(snap)
    assert doc["webhooks"] == {
        "endpoints": {"enabled": 3, "disabled": 1, "failing": 1},
        "deliveries": {"pending": 7, "oldest_pending_seconds": 600.0, "due": 2, "oldest_due_seconds": 0.5,
                       "failed_last_hour": 4},
        "late_after_seconds": LATE_AFTER, "falling_behind": False}
    assert doc["warnings"] == [] and exit_code(snap) == 0
    text = drawn(snap)
    assert "webhooks: endpoints 3 enabled (1 failing), 1 disabled; deliveries pending 7 (oldest 10 min)" in text
    assert "2 may go now (oldest waiting 0 s), failed in the last hour 4" in text


def test_deliveries_waiting_on_a_failing_endpoints_retries_are_no_backlog() -> None:
    # pending for an hour, every one waiting for its retry: nothing may go now, so delivering is not behind
    snap = healthy(webhooks=hooks(pending=500, oldest_pending_seconds=3600.0, due=0, oldest_due_seconds=None))
    assert document(snap)["webhooks"]["falling_behind"] is False and document(snap)["warnings"] == []


def test_deliveries_that_may_go_waiting_past_the_bound_are_a_warning_not_a_failure() -> None:
    snap = healthy(webhooks=hooks(due=120, oldest_due_seconds=LATE_AFTER * 3))
    doc = document(snap)
    assert doc["webhooks"]["falling_behind"] is True
    assert doc["warnings"] == ["webhooks: 120 deliveries to endpoints that are not failing may go now, the oldest "
                               "waiting 48 s (more than 16 s): delivering falls behind"]
    assert exit_code(snap) == 0 and doc["ok"] is True
    assert "delivering falls behind" in drawn(snap)


def test_webhooks_unreadable_is_unavailable() -> None:
    snap = healthy(webhooks=Unavailable("UndefinedTableError"))
    doc = document(snap)
    assert doc["webhooks"] is None and doc["unavailable"] == {"webhooks": "UndefinedTableError"}
    assert exit_code(snap) == 1
    assert "webhooks: unavailable: UndefinedTableError" in drawn(snap)


# ------------------------------------------------------------------------------------------------ who is throttled


def throttled_report(*callers: ThrottledCaller) -> ThrottledReport:
    s = AuthSettings()
    return ThrottledReport(window_seconds=s.throttled_window_seconds, windows=s.throttled_windows,
                           since=NOW.timestamp(), callers=list(callers))


def refused(caller: str, rule: str, n: int, **who: str) -> ThrottledCaller:
    return ThrottledCaller(caller=caller, rule=rule, refused=n, **who)  # type: ignore[arg-type]


KEYED = {"account_id": "acct-1", "app_id": "app-1", "key_prefix": "wsk_AbCdEfGh"}


def test_who_is_throttled_is_summed_across_auth_instances_most_refused_first() -> None:
    snap = healthy(throttled={
        "auth-1": throttled_report(refused("secret_key", "key", 5, **KEYED),
                                   refused("no_credential", "address", 4, address="203.0.113.9")),
        "auth-2": throttled_report(refused("secret_key", "key", 2, **KEYED),
                                   refused("publishable_key", "address", 6, account_id="acct-2", app_id="app-2")),
    }, throttled_top=2)
    doc = document(snap)
    top = doc["throttled"]["top"]
    assert [(c["caller"], c["refused"]) for c in top] == [("secret_key", 7), ("publishable_key", 6)]
    assert top[0] | KEYED == top[0] and top[0]["error"] == 0
    assert doc["throttled"]["instances"] == {"auth-1": 9, "auth-2": 8}
    assert doc["warnings"] == [] and exit_code(snap) == 0
    text = drawn(snap)
    minutes = AuthSettings().throttled_window_seconds * AuthSettings().throttled_windows / 60
    assert f"throttled (429) in the last {minutes:.0f} min, most refused first" in text
    assert "acct-1" in text and "app-1" in text and "wsk_AbCdEfGh" in text and "203.0.113.9" not in text  # top 2


def test_internal_traffic_refused_is_a_warning_not_a_failure() -> None:
    snap = healthy(throttled={"auth": throttled_report(
        refused("no_credential", "address", 50, address="203.0.113.9"),
        refused("internal", "key", 3, **KEYED), refused("internal", "owner", 1, **KEYED))}, throttled_top=1)
    doc = document(snap)
    assert doc["warnings"] == ["Weir's own internal traffic was refused 429 lately (3 by rule key, 1 by rule owner): "
                               "a bug report about the limits, not the limiter working"]
    assert [c["caller"] for c in doc["throttled"]["top"]] == ["no_credential"]  # warned though not in the top shown
    assert exit_code(snap) == 0
    assert "Weir's own internal traffic was refused 429" in drawn(snap)


def test_who_is_throttled_not_read_without_a_token_and_unavailable_when_an_instance_refuses() -> None:
    snap = healthy(throttled=None)
    assert document(snap)["throttled"] is None and exit_code(snap) == 0
    assert "throttled: not read" in drawn(snap)
    snap = healthy(throttled={"auth-1": Unavailable("http://a/throttled: HTTP 401 invalid_credential"),
                              "auth-2": throttled_report()})
    doc = document(snap)
    assert doc["unavailable"] == {"throttled.auth-1": "http://a/throttled: HTTP 401 invalid_credential"}
    assert doc["throttled"]["top"] == [] and doc["throttled"]["instances"] == {"auth-1": None, "auth-2": 0}
    assert exit_code(snap) == 1
    text = drawn(snap)
    assert "nobody" in text and "auth-1 unavailable: http://a/throttled: HTTP 401 invalid_credential" in text


@pytest.mark.parametrize(("env", "expected"), [({"WEIR_DIRTY": "1"}, True), ({"WEIR_DIRTY": "0"}, False),
                                               ({"WEIR_DIRTY": ""}, None), ({}, None)])
def test_an_image_says_whether_it_was_built_from_changes_not_in_its_commit(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: bool | None) -> None:
    monkeypatch.setenv("WEIR_COMMIT", COMMIT)
    monkeypatch.delenv("WEIR_DIRTY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dirty.cache_clear()
    try:
        assert dirty() is expected
    finally:
        dirty.cache_clear()
