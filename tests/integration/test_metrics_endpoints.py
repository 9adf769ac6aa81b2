"""Every service's /metrics as processes serve it (`python -m services.<name>` on the session's NATS, PostgreSQL and
S3): the Prometheus text format prometheus_client's parser reads, every family of shared/metrics.py the service has,
and series that move: the HTTP histogram by route template and status (the api's guard's own refusals too), a
consumer's handled messages, JetStream's pending count, the outbox, the farm as encode and media see it, the limits
mode; and every metric the Grafana dashboard queries is on some service's /metrics."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import CONTENT_TYPE, Metrics
from shared.settings import CommonSettings
from tests.integration.apihelpers import Services, run_services
from tests.integration.test_encode_helpers import clean_encode_state, prepare_encode_consumers, publish_deleted
from tests.unit.test_dashboard import DASHBOARD, queries, sample_names, used
from tests.waiting import wait_for_sync

SERVICES = ("auth", "api", "encode", "media", "sweep")
WORKER = "metrics-media"
SLOTS = 2
REFRESH_S = 0.5  # WEIR_METRICS_REFRESH_SECONDS, shrunk: gauges read from elsewhere are refreshed this often
WAIT_S = 30  # a busy machine is slow to start five services
HTTP = "weir_http_request_duration_seconds"


@pytest.fixture(scope="module")
async def encode_ready(prepared: CommonSettings) -> AsyncIterator[CommonSettings]:
    """encode starts at the end of its streams with no earlier test's videos, so it and media stay idle."""
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    yield prepared
    await clean_encode_state(prepared)


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], encode_ready: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), names=SERVICES, media_worker_id=WORKER,
                      media_slots=str(SLOTS), metrics_refresh_seconds=str(REFRESH_S)) as s:
        yield s


def scrape(services: Services, name: str) -> list[Metric]:
    answer = httpx.get(f"{services.urls[name]}/metrics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == CONTENT_TYPE
    return list(text_string_to_metric_families(answer.text))


def value(families: list[Metric], sample: str, **labels: str) -> float | None:
    """The value of the one series named `sample` whose labels include these (None when there is none)."""
    found = [s.value for f in families for s in f.samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) <= 1, (sample, labels, found)
    return found[0] if found else None


def test_every_metrics_parses_and_has_every_family_of_its_service(services: Services) -> None:
    for name in SERVICES:
        families = scrape(services, name)
        served = sample_names(families)
        expected = sample_names(Metrics(name).registry.collect())
        assert set(expected) <= set(served), (name, sorted(set(expected) - set(served)))
        assert {k: served[k] for k in expected} == expected, name  # each with its kind
        for family in families:
            for s in family.samples:
                assert s.labels.get("service") == name, (name, s)


def http_count(services: Services, name: str, **labels: str) -> float:
    return value(scrape(services, name), f"{HTTP}_count", **labels) or 0.0


def counted_once_more(services: Services, name: str, before: float, **labels: str) -> None:
    wait_for_sync(lambda: http_count(services, name, **labels), WAIT_S, f"{name} {labels}",
                  until=lambda v: v >= before + 1)


def test_http_durations_count_by_route_template_and_status(services: Services) -> None:
    healthz = {"route": "/healthz", "method": "GET", "status": "200"}
    for name in SERVICES:
        before = http_count(services, name, **healthz)
        assert httpx.get(f"{services.urls[name]}/healthz").status_code == 200
        counted_once_more(services, name, before, **healthz)
    api = services.urls["api"]
    video = str(uuid.uuid4())
    cases = [  # (method, path, the route's template, expected status); the guard answers the refusals itself
        ("GET", "/v1/videos", "/v1/videos", 401),
        ("GET", f"/v1/videos/{video}", "/v1/videos/{video_id}", 401),
        ("DELETE", f"/v1/videos/{video}", "/v1/videos/{video_id}", 401),
        ("GET", f"/no/such/{video}", "unmatched", 404),
    ]
    for method, path, template, status in cases:
        labels = {"route": template, "method": method, "status": str(status)}
        before = http_count(services, "api", **labels)
        answer = httpx.request(method, f"{api}{path}", headers={"X-Forwarded-For": "203.0.113.9"})
        assert answer.status_code == status, (method, path, answer.text)
        counted_once_more(services, "api", before, **labels)
    families = scrape(services, "api")
    routes = {s.labels["route"] for f in families for s in f.samples if s.name == f"{HTTP}_count"}
    assert not any(video in r for r in routes), routes  # never a raw path: ids would grow /metrics without end
    bucket = value(families, f"{HTTP}_bucket", route="/v1/videos", method="GET", status="401", le="+Inf")
    assert bucket == value(families, f"{HTTP}_count", route="/v1/videos", method="GET", status="401")


async def test_a_consumed_event_moves_handled_and_pending_is_read_from_jetstream(
    services: Services, nc: NATS, prepared: CommonSettings
) -> None:
    handled = "weir_consumer_messages_total"
    before = value(scrape(services, "encode"), handled, consumer="encode_deletions", outcome="handled")
    assert before is not None  # every outcome's series is there from the start
    event = await publish_deleted(nc, video_id=str(uuid.uuid4()))
    wait_for_sync(lambda: value(scrape(services, "encode"), handled, consumer="encode_deletions", outcome="handled"),
                  WAIT_S, "encode_deletions handled", until=lambda v: v is not None and v >= before + 1)
    conn = await asyncpg.connect(prepared.database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM encode.inbox WHERE event_id = $1", event.id) == 1
    finally:
        await conn.close()
    families = scrape(services, "encode")
    assert (value(families, "weir_consumer_handler_seconds_count", consumer="encode_deletions") or 0) >= 1
    for name, durables in {"encode": ("encode_uploads", "encode_recordings", "encode_deletions"),
                           "api": ("api_status",)}.items():
        for durable in durables:
            for source in (durable, f"{durable}_replay"):
                pending = wait_for_sync(lambda n=name, d=durable, s=source: value(
                    scrape(services, n), "weir_consumer_pending", consumer=d, durable=s),
                    WAIT_S, f"{name} {source} pending", until=lambda v: v is not None)
                assert pending >= 0 and pending == int(pending)
                assert value(scrape(services, name), "weir_consumer_ack_pending", consumer=durable,
                             durable=source) is not None


def test_auth_counts_its_decisions_by_outcome_and_rule_and_times_them(services: Services) -> None:
    missing = {"outcome": "missing_credential", "rule": "none"}
    before = scrape(services, "auth")
    decided = value(before, "weir_check_decisions_total", **missing) or 0.0
    timed = value(before, "weir_check_decision_seconds_count") or 0.0
    answer = httpx.get(f"{services.urls['api']}/v1/videos", headers={"X-Forwarded-For": "203.0.113.10"})
    assert answer.status_code == 401 and answer.json()["code"] == "missing_credential"
    after = scrape(services, "auth")
    assert value(after, "weir_check_decisions_total", **missing) == decided + 1
    assert (value(after, "weir_check_decision_seconds_count") or 0.0) >= timed + 1
    assert value(after, "weir_checks_total", status="401") is not None


def test_outbox_backlog_and_age_on_every_service(services: Services) -> None:
    for name in SERVICES:
        families = wait_for_sync(lambda n=name: scrape(services, n), WAIT_S, f"{name} outbox",
                                 until=lambda f: value(f, "weir_outbox_oldest_unsent_age_seconds") is not None)
        unsent = value(families, "weir_outbox_unsent")
        age = value(families, "weir_outbox_oldest_unsent_age_seconds")
        assert unsent is not None and unsent >= 0 and age is not None and age >= 0, name
        if unsent == 0:
            assert age == 0, name


def test_the_farm_as_encode_and_media_see_it(services: Services) -> None:
    wait_for_sync(lambda: value(scrape(services, "encode"), "weir_farm_worker_slots", worker=WORKER), WAIT_S,
                  "encode's view of the worker's slots", until=lambda v: v == SLOTS)
    families = scrape(services, "encode")
    assert value(families, "weir_farm_worker_busy_slots", worker=WORKER) == 0
    assert (value(families, "weir_farm_workers") or 0) >= 1
    assert value(families, "weir_outputs_waiting") is not None
    media = scrape(services, "media")
    assert value(media, "weir_media_slots") == SLOTS and value(media, "weir_media_busy_slots") == 0


def test_the_limits_mode_is_shared(services: Services) -> None:
    assert value(scrape(services, "auth"), "weir_counter_store_shared") == 1


def test_every_metric_the_dashboard_queries_is_on_some_services_metrics(services: Services) -> None:
    served: dict[str, str] = {}
    for name in SERVICES:
        served |= sample_names(scrape(services, name))
    wanted = set(used(queries(json.loads(DASHBOARD.read_text()))))
    assert wanted and wanted <= set(served), sorted(wanted - set(served))
