"""In-process counters and gauges rendered in the Prometheus text format for `/metrics`."""

from __future__ import annotations

import math
from collections import defaultdict

# the text exposition format's escapes: a label value escapes backslash, double quote and line feed; HELP text
# escapes backslash and line feed (a raw quote or newline would end the value or the line early)
_LABEL_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})
_HELP_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n"})


def escape_label_value(value: str) -> str:
    return value.translate(_LABEL_ESCAPES)


def _number(value: float) -> str:
    """A sample value: whole numbers in full (`:g` would print 1234567 as 1.23457e+06), specials as Prometheus
    spells them."""
    value = float(value)  # a gauge may have been set to an int
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Metrics:
    def __init__(self, service: str) -> None:
        self.service = service
        self._service_label = f'service="{escape_label_value(service)}"'
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._gauges: dict[tuple[str, str], float] = {}
        self._help: dict[str, tuple[str, str]] = {}
        self._rendered: dict[tuple[tuple[str, str], ...], str] = {}

    def inc(self, name: str, amount: float = 1.0, help: str = "", **labels: str) -> None:
        if name not in self._help:
            self._help[name] = ("counter", help)
        if labels:
            # hot paths count per request: the rendered (escaped) label set is made once per distinct set
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
                lines.append(f"# HELP {full} {(help_text or name).translate(_HELP_ESCAPES)}")
                lines.append(f"# TYPE {full} {kind}")
                seen.add(name)
            lines.append(f'{full}{labels[:-1] + "," if labels else "{"}{self._service_label}}} {_number(value)}')
        return "\n".join(lines) + "\n"
