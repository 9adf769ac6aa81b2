"""`/metrics` through prometheus_client: the facade the services count with (`inc`, `set`, `observe`, `value`), one
registry per service, every family of a service there from the start, and label values that carry quotes,
backslashes or newlines kept inside their series, read back by a strict parser of the text format and by
prometheus_client's own."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import FAMILIES, Family, Metrics, families_of
from shared.runtime import LOOP_LAG_SAMPLE_SECONDS, sample_loop_lag

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
        family = next((f for f in (name.group(), re.sub(r"_(bucket|sum|count)$", "", name.group())) if f in types),
                      None)
        assert family is not None, f"sample before its TYPE line: {line!r}"
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
    m = Metrics("auth", families=())
    for i, nasty in enumerate(NASTY):
        m.inc("requests_total", i + 1, help="requests", route=nasty, status="200")
        m.inc("requests_total", i + 1, help="requests", route=nasty, status="200")  # the cached label set again
        m.set("mode", float(i), help="a gauge\nwith a two-line \\ help", reason=nasty)
    m.inc("plain_total", help="no labels")

    text = m.render()
    samples, families = parse(text)

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
    # prometheus_client's parser reads the same series back
    parsed = {(s.name, frozenset(s.labels.items())): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert parsed == expected
    # reading a value back takes the labels as given, not escaped
    assert m.value("requests_total", route=NASTY[0], status="200") == 2
    assert m.value("mode", reason=NASTY[1]) == 1.0


def test_the_service_label_is_escaped_too_and_sample_values_keep_their_digits() -> None:
    m = Metrics('we"ird\nservice', families=())
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


# ----------------------------------------------------------------------------------------------- the facade


def families(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    """Each family on /metrics (as prometheus_client's parser names it) -> (type, samples)."""
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)}


def test_every_family_of_a_service_is_there_from_the_start_in_a_registry_of_its_own() -> None:
    first, second = Metrics("encode"), Metrics("encode")  # two in one process: no clash (no default registry)
    first.inc("dispatch_answers_total", answer="busy")
    parsed = families(first.render())
    for family in families_of("encode"):
        name = family.name.removesuffix("_total") if family.kind == "counter" else family.name
        kind, samples = parsed[f"weir_{name}"]
        assert kind == family.kind
        if not family.labels and family.kind == "counter":  # its one series is there at once, at 0
            assert samples == [(family.samples[0], {"service": "encode"}, 0.0)], (family, samples)
        elif family.name != "dispatch_answers_total":  # a gauge has no series until it is set
            assert samples == [], (family, samples)
    assert not any(f"weir_{f.name}" in parsed for f in FAMILIES if "encode" not in f.services)
    assert second.value("dispatch_answers_total", answer="busy") == 0
    assert first.value("dispatch_answers_total", answer="busy") == 1


def test_inc_set_observe_and_value() -> None:
    m = Metrics("media", families=())
    m.inc("jobs_total", help="jobs", outcome="completed")
    m.inc("jobs_total", 2.5, "jobs", outcome="completed")
    m.set("media_busy_slots", 3, "busy")
    m.set("media_busy_slots", 1, "busy")
    for seconds in (0.002, 0.02, 7.0):
        m.observe("job_duration_seconds", seconds, "a histogram", buckets=(0.01, 1.0), outcome="completed")
    assert m.value("jobs_total", outcome="completed") == 3.5
    assert m.value("jobs_total", outcome="failed") == 0
    assert m.value("media_busy_slots") == 1
    assert m.value("job_duration_seconds", outcome="completed") == 3  # a histogram's value: its count
    assert m.value("never_made") == 0
    kind, samples = families(m.render())["weir_job_duration_seconds"]
    buckets = {labels["le"]: value for name, labels, value in samples if name.endswith("_bucket")}
    assert kind == "histogram" and buckets == {"0.01": 1, "1.0": 2, "+Inf": 3}
    total = next(v for name, _, v in samples if name.endswith("_sum"))
    assert total == pytest.approx(7.022)


def test_a_counter_is_one_series_whatever_the_order_of_its_labels() -> None:
    m = Metrics("sweep", families=())
    m.inc("runs_total", trigger="daily", outcome="completed")
    m.inc("runs_total", outcome="completed", trigger="daily")  # another cache key, the same series
    _, samples = families(m.render())["weir_runs"]
    assert samples == [("weir_runs_total", {"trigger": "daily", "outcome": "completed", "service": "sweep"}, 2.0)]


def test_labels_are_the_first_calls_a_missing_one_is_empty_an_unknown_one_dropped_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = Metrics("api", families=())
    m.inc("answers_total", route="/a", status="200")
    m.inc("answers_total", route="/a")  # status missing: ""
    with caplog.at_level(logging.ERROR, logger="weir.metrics"):
        m.inc("answers_total", route="/a", status="200", video_id="v1")
        m.inc("answers_total", route="/a", status="200", video_id="v2")
    assert m.value("answers_total", route="/a", status="200") == 3
    assert m.value("answers_total", route="/a") == 1
    assert [r.getMessage() for r in caplog.records] == [
        "metric answers_total has no label video_id (its labels: route, status): counted without it"]


def test_a_name_keeps_its_kind_and_service_is_every_series_own_label() -> None:
    m = Metrics("api", families=())
    m.inc("things_total")
    with pytest.raises(TypeError):
        m.set("things_total", 1)
    with pytest.raises(ValueError):
        m.declare(Family("things_total", "counter", "again, with labels", ("kind",)))
    with pytest.raises(ValueError):
        m.inc("other_total", service="forged")


def test_clear_drops_the_series_of_things_that_went_away() -> None:
    m = Metrics("encode")
    m.set("farm_worker_slots", 4, worker="media-1")
    m.set("farm_worker_slots", 2, worker="media-2")
    m.clear("farm_worker_slots")
    m.set("farm_worker_slots", 2, worker="media-2")
    _, samples = families(m.render())["weir_farm_worker_slots"]
    assert samples == [("weir_farm_worker_slots", {"worker": "media-2", "service": "encode"}, 2.0)]
    assert m.value("farm_worker_slots", worker="media-1") == 0


def test_the_exposition_has_no_created_series() -> None:
    """`_created` timestamps (one more series per counter and histogram series) are off: Prometheus reads none."""
    m = Metrics("auth")
    m.inc("checks_total", status="200")
    assert "_created" not in m.render()


async def test_the_loop_lag_sampler_sees_a_blocked_event_loop() -> None:
    blocked_s = 5 * LOOP_LAG_SAMPLE_SECONDS
    metrics, stop = Metrics("api"), asyncio.Event()
    task = asyncio.create_task(sample_loop_lag(metrics, stop))
    await asyncio.sleep(3 * LOOP_LAG_SAMPLE_SECONDS)
    time.sleep(blocked_s)  # the loop runs nothing meanwhile: the next sample is at least this late, less its period
    await asyncio.sleep(3 * LOOP_LAG_SAMPLE_SECONDS)
    stop.set()
    await task
    text = metrics.render()
    assert metrics.value("event_loop_lag_seconds") >= 4
    late = [line for line in text.splitlines() if line.startswith("weir_event_loop_lag_seconds_bucket")
            and 'le="0.025"' in line]
    total = metrics.value("event_loop_lag_seconds")
    assert late and float(late[0].rsplit(" ", 1)[1]) < total, "no sample later than 25 ms: the block was not seen"
