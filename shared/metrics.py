"""In-process counters and gauges rendered in the Prometheus text format for `/metrics`."""

from __future__ import annotations

from collections import defaultdict


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Metrics:
    def __init__(self, service: str) -> None:
        self.service = service
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._gauges: dict[tuple[str, str], float] = {}
        self._help: dict[str, tuple[str, str]] = {}
        self._rendered: dict[tuple[tuple[str, str], ...], str] = {}

    def inc(self, name: str, amount: float = 1.0, help: str = "", **labels: str) -> None:
        if name not in self._help:
            self._help[name] = ("counter", help)
        if labels:
            # hot paths count per request: the rendered label set is made once per distinct set
            pairs = tuple(labels.items())
            rendered = self._rendered.get(pairs)
            if rendered is None:
                rendered = self._rendered[pairs] = _labels(labels)
            self._counters[(name, rendered)] += amount
        else:
            self._counters[(name, "")] += amount

    def set(self, name: str, value: float, help: str = "", **labels: str) -> None:
        self._help.setdefault(name, ("gauge", help))
        self._gauges[(name, _labels(labels))] = value

    def value(self, name: str, **labels: str) -> float:
        key = (name, _labels(labels))
        return self._counters.get(key, self._gauges.get(key, 0.0))

    def render(self) -> str:
        lines: list[str] = []
        series = sorted({**self._counters, **self._gauges}.items())
        seen: set[str] = set()
        for (name, labels), value in series:
            full = f"weir_{name}"
            if name not in seen:
                kind, help_text = self._help.get(name, ("untyped", ""))
                lines.append(f"# HELP {full} {help_text or name}")
                lines.append(f"# TYPE {full} {kind}")
                seen.add(name)
            lines.append(f'{full}{labels[:-1] + "," if labels else "{"}service="{self.service}"}} {value:g}')
        return "\n".join(lines) + "\n"
