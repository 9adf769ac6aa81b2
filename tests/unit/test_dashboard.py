"""deploy/grafana/weir-dashboard.json against the metrics the services register, without servers: every metric a
query names is one some service's registry has (built as the service builds it when it starts), used as its kind
allows (a counter or a histogram's series under rate/increase, a gauge not), so the dashboard and the metrics
cannot drift apart. tests/integration/test_metrics_endpoints.py checks the same against the running services'
/metrics."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Metric

from shared.metrics import Metrics
from shared.runtime import ServiceDefinition

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "weir-dashboard.json"
SERVICES = ("api", "auth", "encode", "media", "sweep")
METRIC = re.compile(r"\bweir_[a-z0-9_]+\b")
RANGE_FUNCTION = re.compile(r"\b(?:rate|increase|irate)\(\s*$")


def definitions() -> list[ServiceDefinition]:
    found = []
    for name in SERVICES:
        definition = importlib.import_module(f"services.{name}.app").SERVICE
        assert isinstance(definition, ServiceDefinition) and definition.name == name
        found.append(definition)
    return found


def sample_names(families: Iterable[Metric]) -> dict[str, str]:
    """Each series name these families can show -> its family's type (a counter's `_total`, a histogram's `_bucket`,
    `_sum`, `_count`), whether or not it has series yet."""
    names: dict[str, str] = {}
    for family in families:
        if family.type == "counter":
            names[family.name + "_total"] = "counter"
        elif family.type == "histogram":
            names.update({f"{family.name}{suffix}": "histogram" for suffix in ("_bucket", "_sum", "_count")})
        else:
            names[family.name] = family.type
    return names


def registered() -> dict[str, str]:
    """The union of what each service's metrics registry holds once it is built, as `shared.runtime.started` builds
    it (`Metrics(definition.name)`)."""
    names: dict[str, str] = {}
    for definition in definitions():
        names |= sample_names(Metrics(definition.name).registry.collect())
    return names


def panels(node: Any) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)  # a collapsed row keeps its panels inside it


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def used(expressions: Iterable[str]) -> dict[str, list[tuple[str, str]]]:
    """Each metric name in the expressions -> (the text before it, the expression) at each use."""
    uses: dict[str, list[tuple[str, str]]] = {}
    for expr in expressions:
        for m in METRIC.finditer(expr):
            uses.setdefault(m.group(), []).append((expr[: m.start()], expr))
    return uses


def kind_problems(uses: dict[str, list[tuple[str, str]]], kinds: dict[str, str]) -> list[str]:
    problems = []
    for name, places in uses.items():
        kind = kinds.get(name)
        if kind is None:
            problems.append(f"{name}: no service registers it")
            continue
        for before, expr in places:
            ranged = bool(RANGE_FUNCTION.search(before))
            if kind in ("counter", "histogram") and not ranged:
                problems.append(f"{name} ({kind}) outside rate/increase: {expr}")
            if kind == "gauge" and ranged:
                problems.append(f"{name} (gauge) under rate/increase: {expr}")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_metric_the_dashboard_queries_is_registered_and_used_as_its_kind(dashboard: dict[str, Any]) -> None:
    uses = used(queries(dashboard))
    assert uses, "the dashboard queries no Weir metric"
    assert kind_problems(uses, registered()) == []


def test_the_check_can_fail() -> None:
    """A misspelt metric, a histogram named without its suffix and a gauge under rate() are each refused."""
    kinds = registered()
    assert "weir_http_request_duration_seconds_bucket" in kinds and "weir_outbox_unsent" in kinds
    for expr, problem in [
        ("sum(rate(weir_http_requests_total[5m]))", "no service registers it"),
        ("histogram_quantile(0.99, rate(weir_http_request_duration_seconds[5m]))", "no service registers it"),
        ("rate(weir_outbox_unsent[5m])", "(gauge) under rate"),
        ("weir_consumer_messages_total", "(counter) outside rate"),
    ]:
        problems = kind_problems(used([expr]), kinds)
        assert any(problem in p for p in problems), (expr, problems)


def test_the_dashboard_covers_what_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    """HTTP rate and latency, consumer pending/failed/dead-lettered, outbox backlog and age, farm slots and busy slots,
    the limits mode, the sweep."""
    names = set(used(queries(dashboard)))
    assert {
        "weir_http_request_duration_seconds_count", "weir_http_request_duration_seconds_bucket",
        "weir_consumer_pending", "weir_consumer_messages_total", "weir_consumer_redelivered_total",
        "weir_outbox_unsent", "weir_outbox_oldest_unsent_age_seconds",
        "weir_farm_worker_slots", "weir_farm_worker_busy_slots", "weir_dispatch_answers_total",
        "weir_outputs_waiting", "weir_counter_store_shared", "weir_sweep_runs_total", "weir_sweep_retired_total",
        "weir_sweep_left_uncertain_total",
    } <= names
    quantiles = {float(q) for q in re.findall(r"histogram_quantile\((0\.\d+)", " ".join(queries(dashboard)))}
    assert {0.5, 0.99} <= quantiles


def test_every_panel_reads_the_provisioned_prometheus_and_the_grid_has_no_overlap(dashboard: dict[str, Any]) -> None:
    datasource = (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    uid = re.search(r"^\s*uid:\s*(\S+)", datasource, re.M)
    assert uid is not None
    cells: dict[tuple[int, int], int] = {}
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": uid[1]}, panel["title"]
            assert all(t["datasource"]["uid"] == uid[1] for t in panel["targets"]), panel["title"]
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for cx in range(g["x"], g["x"] + g["w"]):
            for cy in range(g["y"], g["y"] + g["h"]):
                assert (cx, cy) not in cells, f"{panel['title']} overlaps panel {cells[(cx, cy)]}"
                cells[(cx, cy)] = panel["id"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
