"""`/metrics` in the Prometheus text exposition format: label values that carry quotes, backslashes or newlines
stay inside their series, read back by a strict parser of the format written here."""

from __future__ import annotations

import math
import re

import pytest

from shared.metrics import Metrics

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|Inf|NaN)")
HELP_OR_TYPE = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*)")
UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}

Series = tuple[str, frozenset[tuple[str, str]]]


def _labels(line: str, i: int) -> tuple[dict[str, str], int]:
    """The label set starting after `{` at `i`; returns it and the index after `}`. Fails on anything the format
    does not allow (an unknown escape, a raw newline, a stray quote, a repeated label)."""
    labels: dict[str, str] = {}
    while True:
        if line[i] == "}":
            return labels, i + 1
        name = LABEL_NAME.match(line, i)
        assert name is not None, f"label name expected at {i}: {line!r}"
        i = name.end()
        assert line[i : i + 2] == '="', f"'=\"' expected at {i}: {line!r}"
        i += 2
        chars: list[str] = []
        while line[i] != '"':
            c = line[i]
            assert c != "\n", line
            if c == "\\":
                assert line[i + 1] in UNESCAPE, f"unknown escape {line[i:i + 2]!r} in {line!r}"
                chars.append(UNESCAPE[line[i + 1]])
                i += 2
            else:
                chars.append(c)
                i += 1
        i += 1
        assert name.group() not in labels, f"label {name.group()} twice: {line!r}"
        labels[name.group()] = "".join(chars)
        if line[i] == ",":
            i += 1
        else:
            assert line[i] == "}", f"',' or '}}' expected at {i}: {line!r}"


def parse(text: str) -> tuple[dict[Series, float], dict[str, tuple[str, str]]]:
    """Every sample line as (name, labels) -> value, and each family's (help, type); strict about the grammar."""
    assert text.endswith("\n")
    samples: dict[Series, float] = {}
    help_text: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text[:-1].split("\n"):
        if line.startswith("#"):
            m = HELP_OR_TYPE.fullmatch(line)
            assert m is not None, f"bad comment line: {line!r}"
            kind, family, rest = m.groups()
            if kind == "HELP":
                assert family not in help_text, line
                help_text[family] = re.sub(r"\\(.)", lambda e: {"\\": "\\", "n": "\n"}[e.group(1)], rest)
            else:
                assert rest in ("counter", "gauge", "untyped", "histogram", "summary"), line
                types[family] = rest
            continue
        name = NAME.match(line)
        assert name is not None, f"metric name expected: {line!r}"
        i = name.end()
        labels: dict[str, str] = {}
        if line[i] == "{":
            labels, i = _labels(line, i + 1)
        assert line[i] == " ", f"space expected at {i}: {line!r}"
        value = VALUE.fullmatch(line, i + 1)
        assert value is not None, f"sample value expected: {line!r}"
        assert name.group() in types, f"sample before its TYPE line: {line!r}"
        series = (name.group(), frozenset(labels.items()))
        assert series not in samples, f"series twice: {line!r}"
        samples[series] = float(value.group().replace("Inf", "inf"))
    return samples, {f: (help_text[f], types[f]) for f in types}


def series(name: str, **labels: str) -> Series:
    return f"weir_{name}", frozenset(labels.items())


NASTY = [
    'say "hi"',
    "line one\nline two",
    "back\\slash",
    'all \\ of " them\n at once\\n',
    '"',
    "\\",
    "\n",
    "trailing backslash\\",
    "} 1\nweir_forged_total 99",  # would inject a series of its own if not escaped
    "plain",
    "",
]


def test_label_values_with_quotes_backslashes_and_newlines_keep_every_series_intact() -> None:
    m = Metrics("auth")
    for i, nasty in enumerate(NASTY):
        m.inc("requests_total", i + 1, help="requests", route=nasty, status="200")
        m.inc("requests_total", i + 1, help="requests", route=nasty, status="200")  # the cached label set again
        m.set("mode", float(i), help="a gauge\nwith a two-line \\ help", reason=nasty)
    m.inc("plain_total", help="no labels")

    samples, families = parse(m.render())

    expected: dict[Series, float] = {}
    for i, nasty in enumerate(NASTY):
        expected[series("requests_total", route=nasty, status="200", service="auth")] = 2 * (i + 1)
        expected[series("mode", reason=nasty, service="auth")] = float(i)
    expected[series("plain_total", service="auth")] = 1
    assert samples == expected  # every series once, its labels exactly as given; nothing forged, nothing split
    assert families == {
        "weir_requests_total": ("requests", "counter"),
        "weir_mode": ("a gauge\nwith a two-line \\ help", "gauge"),
        "weir_plain_total": ("no labels", "counter"),
    }
    # reading a value back takes the labels as given, not escaped
    assert m.value("requests_total", route=NASTY[0], status="200") == 2
    assert m.value("mode", reason=NASTY[1]) == 1.0


def test_the_service_label_is_escaped_too_and_sample_values_keep_their_digits() -> None:
    m = Metrics('we"ird\nservice')
    big = 2**40 + 1  # `:g` would round this to six digits
    m.inc("big_total", big)
    m.set("ratio", 0.125)
    m.set("nothing", math.nan)
    m.set("everything", math.inf)
    samples, _ = parse(m.render())
    service = 'we"ird\nservice'
    assert samples[series("big_total", service=service)] == big
    assert samples[series("ratio", service=service)] == 0.125
    assert math.isnan(samples[series("nothing", service=service)])
    assert samples[series("everything", service=service)] == math.inf


@pytest.mark.parametrize("broken", [
    'weir_x{a="unterminated} 1\n',
    'weir_x{a="bad \\t escape"} 1\n',
    'weir_x{a="raw "quote""} 1\n',
    "weir_x{a=\"split\nline\"} 1\n",
])
def test_the_parser_refuses_what_an_unescaped_label_would_produce(broken: str) -> None:
    """The parser above can fail: a label rendered without escapes is refused, not read as something else."""
    with pytest.raises((AssertionError, IndexError)):
        parse("# TYPE weir_x counter\n" + broken)
