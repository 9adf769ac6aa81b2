"""Weir's Prometheus alerting rules read without promtool (not installed): the rules file's alerts, the series selectors
of a PromQL expression (`name{label="value", ...}`), and which samples of a /metrics exposition a selector matches."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES_FILE = ROOT / "deploy" / "prometheus" / "rules" / "weir-alerts.yml"
INTERNAL_ALERT = "WeirInternalTrafficThrottled"

_SELECTOR = re.compile(r"\b(weir_[a-z0-9_]+)\b\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)

    def matches(self, labels: dict[str, str]) -> bool:
        for label, op, value in self.matchers:
            seen = labels.get(label, "")
            if (op == "=" and seen != value) or (op == "!=" and seen == value):
                return False
            if op in ("=~", "!~") and (re.fullmatch(value, seen) is None) == (op == "=~"):
                return False
        return True


def load_rules(path: Path = RULES_FILE) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def alerts(rules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every alerting rule of every group, by its name."""
    return {r["alert"]: r for g in rules.get("groups") or [] for r in g.get("rules") or [] if "alert" in r}


def selectors(expr: str) -> list[Selector]:
    """Each Weir series selector in the expression, with its label matchers (raises ValueError on one it cannot
    read, so that nothing passes unread)."""
    found = []
    for m in _SELECTOR.finditer(expr):
        body = (m.group(2) or "{}")[1:-1]
        matchers = []
        pos = 0
        while pos < len(body.strip()):
            one = _MATCHER.match(body, pos)
            if one is None:
                raise ValueError(f"cannot read the label matchers of {m.group(0)!r}")
            matchers.append((one.group(1), one.group(2), one.group(3)))
            pos = one.end()
        found.append(Selector(m.group(1), tuple(matchers)))
    return found


def matching(exposition: str, selector: Selector) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of a /metrics text the selector matches: their labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[frozenset[tuple[str, str]], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == selector.name and selector.matches(sample.labels):
                out[frozenset(sample.labels.items())] = sample.value
    return out
