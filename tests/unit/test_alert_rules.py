"""deploy/prometheus/rules/weir-alerts.yml without servers and without promtool: the file has the shape Prometheus
reads, every series an alert names is one a service registers, used as its kind allows, and every label it matches on
is one that family has, with a value it can take. tests/integration/test_throttled.py evaluates the internal-traffic
alert on a real auth's /metrics."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.auth.domain.rules import RuleId
from services.auth.domain.throttled import CallerClass
from shared.metrics import FAMILIES, PREFIX, SERVICE_LABEL
from tests.promrules import INTERNAL_ALERT, Selector, alerts, load_rules, selectors
from tests.unit.test_dashboard import kind_problems, registered, used

DURATION = re.compile(r"\d+(ms|s|m|h|d|w|y)")
# the values a label of Weir's can take, where they are a closed set
LABEL_VALUES: dict[str, set[str]] = {"caller": {c.value for c in CallerClass}, "rule": {r.value for r in RuleId}}


def shape_problems(rules: Any) -> list[str]:
    """What Prometheus' rule loader would refuse, or what an alert needs to be acted on."""
    problems: list[str] = []
    groups = rules.get("groups") if isinstance(rules, dict) else None
    if not groups:
        return ["no rule groups"]
    names = [g.get("name") for g in groups]
    if len(set(names)) != len(names) or not all(names):
        problems.append(f"group names must be set and unique: {names}")
    seen: set[str] = set()
    for group in groups:
        for rule in group.get("rules") or []:
            name = rule.get("alert")
            if not name or "record" in rule:
                problems.append(f"not an alerting rule: {rule}")
                continue
            if name in seen:
                problems.append(f"{name}: twice")
            seen.add(name)
            if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                problems.append(f"{name}: no expr")
            if "for" in rule and not DURATION.fullmatch(str(rule["for"])):
                problems.append(f"{name}: `for` {rule['for']!r} is not a duration")
            if not (rule.get("labels") or {}).get("severity"):
                problems.append(f"{name}: no severity label")
            notes = rule.get("annotations") or {}
            if not notes.get("summary") or not notes.get("description"):
                problems.append(f"{name}: a summary and a description tell whoever is paged what to do")
            unknown = set(rule) - {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if unknown:
                problems.append(f"{name}: fields Prometheus does not know: {sorted(unknown)}")
    return problems


def label_problems(found: list[Selector]) -> list[str]:
    families = {PREFIX + f.name: f for f in FAMILIES} | {f.samples[0]: f for f in FAMILIES}
    problems = []
    for selector in found:
        family = families.get(selector.name)
        if family is None:
            problems.append(f"{selector.name}: not in shared/metrics.py")
            continue
        for label, op, value in selector.matchers:
            if label not in (*family.labels, SERVICE_LABEL):
                problems.append(f"{selector.name} has no label {label}")
            elif op == "=" and label in LABEL_VALUES and value not in LABEL_VALUES[label]:
                problems.append(f"{selector.name}: {label} is never {value!r}")
    return problems


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    return load_rules()


def test_the_rules_file_has_the_shape_prometheus_reads(rules: dict[str, Any]) -> None:
    assert shape_problems(rules) == []


def test_every_series_an_alert_names_is_registered_used_as_its_kind_with_its_labels(rules: dict[str, Any]) -> None:
    expressions = [rule["expr"] for rule in alerts(rules).values()]
    assert kind_problems(used(expressions), registered()) == []
    assert label_problems([s for expr in expressions for s in selectors(expr)]) == []


def test_the_internal_traffic_alert_fires_on_any_internal_429(rules: dict[str, Any]) -> None:
    """By caller class `internal`, every rule (none is matched away), at once (no `for`), above zero."""
    rule = alerts(rules)[INTERNAL_ALERT]
    found = selectors(rule["expr"])
    assert found == [Selector("weir_limit_refusals_total", (("caller", "=", CallerClass.INTERNAL.value),))]
    assert re.search(r"\bincrease\(", rule["expr"]) and rule["expr"].rstrip().endswith("> 0")
    assert "for" not in rule


def test_the_checks_can_fail() -> None:
    """A misspelt metric, a label the family lacks, a value it never takes, an alert with no severity are refused."""
    kinds = registered()
    assert kind_problems(used(["increase(weir_limit_refusal_total[5m]) > 0"]), kinds)
    assert kind_problems(used(["weir_limit_refusals_total > 0"]), kinds)  # a counter outside increase()
    assert label_problems(selectors('weir_limit_refusals_total{class="internal"}'))
    assert label_problems(selectors('weir_limit_refusals_total{caller="weir"}'))
    assert not label_problems(selectors('weir_limit_refusals_total{caller="internal", rule="key", service="auth"}'))
    with pytest.raises(ValueError):
        selectors('weir_limit_refusals_total{caller=internal}')
    rule = {"alert": "X", "expr": "vector(1)", "annotations": {"summary": "s", "description": "d"}}
    assert shape_problems({"groups": [{"name": "g", "rules": [rule]}]}) == ["X: no severity label"]
    assert shape_problems({"groups": []}) == ["no rule groups"]
    assert Selector("m", (("caller", "=~", "int.*"),)).matches({"caller": "internal"})
    assert not Selector("m", (("caller", "!=", "internal"),)).matches({"caller": "internal"})
