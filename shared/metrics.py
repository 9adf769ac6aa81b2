"""Each service's Prometheus metrics (`prometheus_client`), served on its `/metrics`, and the one list of them.

`FAMILIES` is that list: name, kind, help, labels and the services that have it (README "Metrics" summarises it).
deploy/grafana/weir-dashboard.json queries these; tests/unit/test_dashboard.py checks that it queries nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("weir.metrics")

PREFIX = "weir_"
SERVICE_LABEL = "service"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# `<name>_created` series (a timestamp per counter and histogram series) double /metrics for nothing Prometheus reads
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

Kind = Literal["counter", "gauge", "histogram"]
EVERY = ("api", "auth", "encode", "media", "sweep", "webhooks")

# seconds; HTTP answers and handler transactions take milliseconds, a slow one seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# an auth.check batch is decided in well under a millisecond when nothing waits
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# an event loop's lag and a refusal's time in the shedder: well under a millisecond when the process keeps up
LAG_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class Family:
    """One metric: its name without the prefix, kind, help, label names (besides `service`), and who has it."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    services: tuple[str, ...] = EVERY
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # histograms only

    @property
    def samples(self) -> tuple[str, ...]:
        """The names its series have on /metrics."""
        full = PREFIX + self.name
        if self.kind == "histogram":
            return (f"{full}_bucket", f"{full}_sum", f"{full}_count")
        if self.kind == "counter" and not full.endswith("_total"):
            return (f"{full}_total",)
        return (full,)


def _family(name: str, kind: Kind, help: str, *labels: str, services: tuple[str, ...] = EVERY,
            buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Family:
    return Family(name, kind, help, labels, services, buckets)


FAMILIES: tuple[Family, ...] = (
    # every service (shared/runtime.py, shared/outbox.py, shared/consumer.py, shared/natsconn.py)
    _family("http_request_duration_seconds", "histogram", "HTTP answers by route template, method and status",
            "route", "method", "status"),
    _family("event_loop_lag_seconds", "histogram", "how late a sampling timer ran on the service's event loop: the "
            "wait any ready work meets there", buckets=LAG_BUCKETS),
    _family("consumer_messages_total", "counter", "messages by consumer and outcome: handled, duplicate, retry "
            "(failed, comes back), parked and invalid (dead-lettered)", "consumer", "outcome"),
    _family("consumer_redelivered_total", "counter", "messages a consumer received again", "consumer"),
    _family("consumer_handler_seconds", "histogram", "handler transactions (one event, or a lane's events together)",
            "consumer"),
    _family("consumer_pending", "gauge", "messages not yet delivered to the durable (JetStream consumer info)",
            "consumer", "durable"),
    _family("consumer_ack_pending", "gauge", "messages delivered to the durable and not yet acknowledged",
            "consumer", "durable"),
    _family("outbox_unsent", "gauge", "outbox rows not yet published"),
    _family("outbox_oldest_unsent_age_seconds", "gauge", "age of the oldest unsent outbox row (0: none)"),
    _family("outbox_published_total", "counter", "events published from the outbox"),
    _family("outbox_publish_failures_total", "counter", "outbox publishes not acked"),
    _family("nats_authorization_violations_total", "counter", "connections the server refused", "identity"),
    _family("nats_permission_violations_total", "counter", "publishes and subscribes the server refused",
            "identity", "operation", "subject"),
    _family("nats_tls_failures_total", "counter", "TLS handshakes with the server that failed", "identity"),
    # auth (services/auth)
    _family("checks_total", "counter", "auth.check decisions", "status", services=("auth",)),
    _family("check_decisions_total", "counter", "auth.check decisions by outcome and deciding rule", "outcome",
            "rule", services=("auth",)),
    _family("check_decision_seconds", "histogram", "time to decide one batch of auth.check requests",
            services=("auth",), buckets=DECISION_BUCKETS),
    _family("check_batches_total", "counter", "auth.check batches decided", services=("auth",)),
    _family("credential_lookups_total", "counter", "credential lookups that went to the database",
            services=("auth",)),
    _family("check_payloads_renewed_total", "counter", "remembered auth.check payloads kept past their refresh point"
            " because their lookup still found the same record", services=("auth",)),
    _family("credentials_rejected_total", "counter", "rejected credentials", services=("auth",)),
    _family("limit_refusals_total", "counter", "429s by caller class (internal, secret_key, publishable_key, "
            "upload_token, account_token, rejected, no_credential) and the rule that refused", "caller", "rule",
            services=("auth",)),
    _family("limit_refusals_from_memory_total", "counter", "429s answered without the counter store",
            services=("auth",)),
    _family("counter_store_shared", "gauge", "1 while limits are counted in the shared store, 0 while on local "
            "windows", services=("auth",)),
    _family("counter_store_switches_total", "counter", "switches between shared and local", "to",
            services=("auth",)),
    _family("counter_leases_ahead_total", "counter", "grants of counts taken ahead of need", services=("auth",)),
    _family("counter_lease_returned_total", "counter", "leased counts given back unused", services=("auth",)),
    _family("counter_late_counts_total", "counter", "counts of increments the shared store applied after their "
            "budget: held (for the next requests) or not_held, over_limit", "outcome", services=("auth",)),
    # api (services/api)
    _family("auth_unavailable_total", "counter", "requests answered 503 because auth did not answer",
            services=("api",)),
    _family("auth_overloaded_total", "counter", "requests answered 503 `overloaded` because auth shed their check",
            services=("api",)),
    _family("thumbnails_made_total", "counter", "thumbnails made on demand with ffmpeg (not from the cache)",
            services=("api",)),
    # shedding (SPEC 15: shared/overload; auth sheds its auth.check queue)
    _family("shed_total", "counter", "requests refused 503 `overloaded` at once, by priority", "priority",
            services=("api", "auth")),
    _family("shed_refusal_seconds", "histogram", "from the shedder's first look at a request to its 503 `overloaded` "
            "written: at_once (over its ceiling while dropping) or queued (waited past the queue's timeout)", "how",
            services=("api",), buckets=LAG_BUCKETS),
    _family("shed_limit", "gauge", "the api's concurrency limit now (shared/overload/domain.py)", services=("api",)),
    _family("shed_in_flight_peak", "gauge", "the most requests in flight at once in the last window",
            services=("api",)),
    _family("shed_in_flight", "gauge", "requests the api's shedder admitted that are not answered yet",
            services=("api",)),
    _family("shed_waiting", "gauge", "requests waiting for a slot (a burst passing)", services=("api",)),
    _family("nats_requests_retried_total", "counter", "requests sent again on a new connection: the one they went "
            "out on dropped (auth.check, encode.status)", "subject", services=("api",)),
    # encode (services/encode)
    _family("farm_workers", "gauge", "live workers taking offers", services=("encode",)),
    _family("farm_worker_slots", "gauge", "slots of each live worker", "worker", services=("encode",)),
    _family("farm_worker_busy_slots", "gauge", "slots of each live worker running a job", "worker",
            services=("encode",)),
    _family("dispatch_answers_total", "counter", "offers by the farm's answer", "answer", services=("encode",)),
    _family("outputs_waiting", "gauge", "outputs of processing videos not encoding yet", services=("encode",)),
    _family("results_total", "counter", "worker results by verdict", "verdict", services=("encode",)),
    _family("videos_failed_total", "counter", "videos failed by reason", "reason", services=("encode",)),
    _family("videos_deleted_total", "counter", "videos whose processing stopped because they were deleted",
            services=("encode",)),
    _family("stuck_restarts_total", "counter", "outputs restarted by the stuck rule", services=("encode",)),
    _family("outputs_returned_total", "counter", "outputs returned from dead workers", services=("encode",)),
    # media (services/media)
    _family("media_slots", "gauge", "this worker's encoding slots", services=("media",)),
    _family("media_busy_slots", "gauge", "this worker's slots running a job", services=("media",)),
    _family("offers_total", "counter", "dispatch offers by answer", "answer", services=("media",)),
    _family("cancels_total", "counter", "jobs cancelled by encode, by reason", "reason", services=("media",)),
    _family("jobs_total", "counter", "jobs by outcome", "outcome", services=("media",)),
    _family("job_seconds_total", "counter", "time spent on jobs", services=("media",)),
    _family("artwork_failures_total", "counter", "jobs whose poster or storyboard could not be made",
            services=("media",)),
    # sweep (services/sweep)
    _family("sweep_runs_total", "counter", "sweep runs by trigger and outcome", "trigger", "outcome",
            services=("sweep",)),
    _family("sweep_retired_total", "counter", "videos retired, by reason", "reason", services=("sweep",)),
    _family("sweep_left_uncertain_total", "counter", "candidates left alone because storage could not say for "
            "certain", services=("sweep",)),
    _family("sweep_left_alone_total", "counter", "candidates left alone, by reason", "reason", services=("sweep",)),
    _family("sweep_errors_total", "counter", "candidates a run could not settle", services=("sweep",)),
    _family("sweep_bytes_removed_total", "counter", "bytes of stale files removed", services=("sweep",)),
    _family("sweep_last_run_seconds", "gauge", "duration of the last run", services=("sweep",)),
    _family("sweep_last_run_timestamp_seconds", "gauge", "when the last run ended (Unix time)", services=("sweep",)),
    # webhooks (services/webhooks)
    _family("webhook_attempts_total", "counter", "delivery attempts by outcome: delivered, gone (410), failed",
            "outcome", services=("webhooks",)),
    _family("webhook_attempt_seconds", "histogram", "delivery attempts' durations by outcome", "outcome",
            services=("webhooks",)),
    _family("webhook_endpoints_disabled_total", "counter", "endpoints disabled, by reason (gone, failing)", "reason",
            services=("webhooks",)),
)


def families_of(service: str) -> tuple[Family, ...]:
    return tuple(f for f in FAMILIES if service in f.services)


@dataclass
class _Registered:
    family: Family
    metric: Any  # Counter | Gauge | Histogram with the family's labels and `service`


class Metrics:
    """A service's metrics: its own `CollectorRegistry` (never the process-wide default: tests run several services
    in one process), with every family of `FAMILIES` it has registered at once, so each is on /metrics before its
    first sample. Code counts by name without `weir_` (`inc`, `set`, `observe`, labels as keywords); an unlisted name
    is made on first use with that call's labels. Every series carries `service`. A gauge has no series until set (a
    made-up 0 would read as a fact, say "local windows" for the limits mode)."""

    def __init__(self, service: str, families: Iterable[Family] | None = None) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=False)
        self._registered: dict[str, _Registered] = {}
        # hot paths count per request batch: the child series of each label set, found by one dict lookup (much
        # cheaper than prometheus_client's `.labels(...)` each time); one dict per kind, so a name keeps its kind
        self._children: dict[Kind, dict[tuple[str, tuple[tuple[str, Any], ...]], Any]] = {
            "counter": {}, "gauge": {}, "histogram": {}}
        self._warned: set[tuple[str, frozenset[str]]] = set()
        for family in families_of(service) if families is None else families:
            self.declare(family)

    # --- the facade

    def inc(self, name: str, amount: float = 1.0, help: str = "", **labels: Any) -> None:
        child = self._children["counter"].get((name, tuple(labels.items())))
        if child is None:
            child = self._child(name, "counter", help, labels)
        child.inc(amount)

    def set(self, name: str, value: float, help: str = "", **labels: Any) -> None:
        child = self._children["gauge"].get((name, tuple(labels.items())))
        if child is None:
            child = self._child(name, "gauge", help, labels)
        child.set(value)

    def observe(self, name: str, value: float, help: str = "", buckets: tuple[float, ...] = LATENCY_BUCKETS,
                **labels: Any) -> None:
        child = self._children["histogram"].get((name, tuple(labels.items())))
        if child is None:
            child = self._child(name, "histogram", help, labels, buckets)
        child.observe(value)

    def follow(self, name: str, read: Callable[[], float], help: str = "", **labels: Any) -> None:
        """A gauge read from `read` at each scrape: a value a hot path keeps anyway costs nothing per request."""
        child = self._children["gauge"].get((name, tuple(labels.items())))
        if child is None:
            child = self._child(name, "gauge", help, labels)
        child.set_function(read)

    def clear(self, name: str) -> None:
        """Drop every series of a family (gauges of things that come and go, such as workers)."""
        registered = self._registered.get(name)
        if registered is None:
            return
        registered.metric.clear()
        children = self._children[registered.family.kind]
        for key in [k for k in children if k[0] == name]:
            del children[key]

    def value(self, name: str, **labels: Any) -> float:
        """A counter's or gauge's value, a histogram's count of observations (0 when there is no such series)."""
        registered = self._registered.get(name)
        if registered is None:
            return 0.0
        family = registered.family
        wanted = {n: str(labels.get(n, "")) for n in family.labels} | {SERVICE_LABEL: self.service}
        sample_name = family.samples[-1]  # `_count` of a histogram
        for collected in registered.metric.collect():
            for sample in collected.samples:
                if sample.name == sample_name and sample.labels == wanted:
                    return float(sample.value)
        return 0.0

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()

    # --- registration

    def declare(self, family: Family) -> None:
        """Register a family (idempotent for the same one); a counter without labels shows its series at once."""
        known = self._registered.get(family.name)
        if known is not None:
            if (known.family.kind, known.family.labels) != (family.kind, family.labels):
                raise ValueError(f"metric {family.name} is already a {known.family.kind} with labels "
                                 f"{known.family.labels}")
            return
        if SERVICE_LABEL in family.labels:
            raise ValueError(f"metric {family.name}: `{SERVICE_LABEL}` is every series' own label")
        full = PREFIX + family.name
        labelnames = (*family.labels, SERVICE_LABEL)
        help_text = family.help or family.name
        metric: Any
        if family.kind == "counter":
            metric = Counter(full, help_text, labelnames, registry=self.registry)
        elif family.kind == "gauge":
            metric = Gauge(full, help_text, labelnames, registry=self.registry)
        else:
            metric = Histogram(full, help_text, labelnames, registry=self.registry, buckets=family.buckets)
        self._registered[family.name] = _Registered(family, metric)
        if not family.labels and family.kind == "counter":
            # a counter's 0 is true before it counts; a gauge's or a histogram's would be made up: none until set
            self._children["counter"][(family.name, ())] = metric.labels(self.service)

    def _child(self, name: str, kind: Kind, help: str, labels: dict[str, Any],
               buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Any:
        registered = self._registered.get(name)
        if registered is None:
            self.declare(Family(name, kind, help, tuple(labels), (self.service,), buckets))
            registered = self._registered[name]
        family = registered.family
        if family.kind != kind:
            raise TypeError(f"metric {name} is a {family.kind}, not a {kind}")
        unknown = set(labels) - set(family.labels)
        if unknown and (name, frozenset(unknown)) not in self._warned:
            # a metric never breaks the work it counts: the series is counted without them, and said once
            self._warned.add((name, frozenset(unknown)))
            log.error("metric %s has no label %s (its labels: %s): counted without it", name,
                      ", ".join(sorted(unknown)), ", ".join(family.labels) or "none")
        child = registered.metric.labels(*(labels.get(n, "") for n in family.labels), self.service)
        self._children[kind][(name, tuple(labels.items()))] = child
        return child
