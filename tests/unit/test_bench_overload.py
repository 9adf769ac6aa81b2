"""bench/overload.py's arithmetic: a step's goodput by kind from bench/soak.lua's counts, and its work (each kind's
2xx/s over that kind's capacity alone), on a made-up counting period."""

from __future__ import annotations

import argparse

import pytest

from bench import overload

SECONDS = 10.0
CAPACITIES = {"read": 2000.0, "list": 500.0, "create": 200.0}


def period(**answers: tuple[int, int]) -> dict[str, dict[str, dict[str, int]]]:
    """bench/soak.lua's cells: per kind, (answers with the kind's expected status, 503 `overloaded` answers)."""
    row: dict[str, dict[str, dict[str, int]]] = {}
    for kind, (ok, shed) in answers.items():
        expected = str(overload.EXPECTED[kind][0])
        row[kind] = {"status": {expected: ok, **({"503": shed} if shed else {})}, "hist": {}}
        if shed:
            row[kind + overload.SHED] = {"status": {"503": shed}, "hist": {}}
    return row


def test_goodput_by_kind_counts_the_expected_answers_of_each_public_kind() -> None:
    row = period(read=(5000, 700), list=(1000, 0), create=(400, 90), internal=(100, 0))
    got = overload.tally(row, SECONDS)
    assert got["goodput_by_kind"] == {"read": 500.0, "list": 100.0, "create": 40.0}
    assert got["goodput_per_s"] == sum(got["goodput_by_kind"].values())
    assert got["shed"] == 700 + 90
    assert got["n_errors"] == 0  # a 503 `overloaded` is a refusal, not an error


def test_work_weighs_each_kind_by_its_capacity() -> None:
    by_kind = {"read": 1000.0, "list": 100.0, "create": 50.0}
    expected = sum(n / CAPACITIES[k] for k, n in by_kind.items())
    assert overload.work(by_kind, CAPACITIES) == round(expected, 3)
    # the same requests/s with the writes' share up: fewer requests, as much work
    heavier = {"read": 600.0, "list": 100.0, "create": 50.0 + 400.0 / (CAPACITIES["read"] / CAPACITIES["create"])}
    assert sum(heavier.values()) < sum(by_kind.values())
    assert overload.work(heavier, CAPACITIES) == pytest.approx(overload.work(by_kind, CAPACITIES), abs=1e-3)
    assert overload.work(by_kind, {}) is None  # capacities not calibrated


def test_policy_variants_and_kind_capacities_parse() -> None:
    assert overload.split_policy("fixed") == ("fixed", "")
    assert overload.split_policy("gradient-nosteps") == ("gradient", "-nosteps")
    assert overload.split_policy("codel-flat") == ("codel", "-flat")
    assert overload.edged("off-edge") == ("off", True)
    assert overload.edged("fixed-nosteps") == ("fixed-nosteps", False)
    assert overload.split_policy("fixed-nosteps-edge") == ("fixed", "-nosteps")
    assert overload.policy_env("off-edge") == {"WEIR_SHED_POLICY": "off"}
    assert overload.kind_capacities("read=1970,list=720,create=284") == {"read": 1970.0, "list": 720.0,
                                                                         "create": 284.0}
    with pytest.raises(argparse.ArgumentTypeError):
        overload.kind_capacities("read=1970")
    assert overload.policy_env("fixed-nosteps") == {"WEIR_SHED_POLICY": "fixed", "WEIR_SHED_PRIORITY_STEP": "0"}
    assert overload.unloaded_policies(["fixed", "off", "gradient-flat"]) == ["off", "fixed", "gradient-flat"]


def test_drained_counts_the_stacks_own_durables_not_an_outside_readers() -> None:
    """A durable the operator made for an outside reader (`publisher_videos`: nobody in the stack reads it) keeps
    its backlog until that reader comes; the stack is drained when its own services' durables are."""
    from bench.soak import drained

    doc = {"outbox": {"api": 0}, "dlq": {},
           "consumers": [{"stream": "VIDEOS", "name": "publisher_videos", "pending": 34909},
                         {"stream": "VIDEOS", "name": "webhooks_videos", "pending": 0}]}
    assert not any(drained(doc).values())
    doc["consumers"][1]["pending"] = 3
    assert drained(doc)["consumers_pending"] == {"VIDEOS/webhooks_videos": 3}


def test_the_probe_counts_every_period_not_the_first_only() -> None:
    # a soak's probe has one period a minute: a slow shed answer in the last minute is in its p99, and every
    # minute's refusals are counted
    quick, slow = {"1500": 98}, {"1500": 1, "40000": 3}

    def minute(shed_hist: dict[str, int]) -> dict[str, dict[str, dict[str, int]]]:
        n = sum(shed_hist.values())
        return {"read": {"status": {"200": 50}, "hist": {"2000": 50}},
                "read" + overload.SHED: {"status": {"503": n}, "hist": {}},
                "read" + overload.SHED_SENT: {"status": {"503": n}, "hist": shed_hist}}

    got = overload.probe_figures([minute(quick), minute(slow)])
    assert got["shed"] == sum(quick.values()) + sum(slow.values())
    assert got["shed_sent_p99_ms"] == 40.0
    assert got["admitted_p99_ms"] == 2.0
    assert overload.probe_figures([])["shed"] == 0


def exposition(lag: dict[float, int], refusals: dict[str, dict[float, int]]) -> str:
    """The api's /metrics as prometheus_client writes it: cumulative buckets."""
    def lines(name: str, buckets: dict[float, int], labels: str = "") -> list[str]:
        out, total = [f"# TYPE {name} histogram"], 0
        for le in sorted(buckets):
            total += buckets[le]
            bound = "+Inf" if le == float("inf") else repr(le)
            out.append(f'{name}_bucket{{{labels}le="{bound}",service="api"}} {total}')
        return [*out, f'{name}_count{{{labels}service="api"}} {total}']
    text = lines("weir_event_loop_lag_seconds", lag)
    for how, buckets in refusals.items():
        text += lines("weir_shed_refusal_seconds", buckets, f'how="{how}",')[(1 if how != "at_once" else 0):]
    return "\n".join([*text, "# TYPE weir_shed_limit gauge", 'weir_shed_limit{service="api"} 32.0', ""])


def test_what_the_api_saw_is_read_from_its_histograms_between_two_scrapes() -> None:
    inf = float("inf")
    before = overload.scraped(exposition({0.001: 900, 0.025: 0, inf: 0},
                                         {"at_once": {0.001: 10, 0.025: 0, inf: 0},
                                          "queued": {0.001: 0, 0.025: 0, inf: 0}}))
    assert before["limit"] == 32.0
    # between the scrapes: 100 lag samples, 2 of them over 10 ms; 100 refusals, 3 of them after queueing 10-25 ms
    after = overload.scraped(exposition({0.001: 998, 0.025: 2, inf: 0},
                                        {"at_once": {0.001: 107, 0.025: 0, inf: 0},
                                         "queued": {0.001: 0, 0.025: 3, inf: 0}}))
    got = overload.inside_api(before, after)
    assert got["api_loop_lag_p50_ms"] == 1.0
    assert got["api_loop_lag_p99_ms"] == 25.0  # the 99th of 100 is past the 98 quick ones
    assert got["refusal_p99_ms"] == 25.0
    assert got["refused_after_queueing"] == 3
    assert overload.inside_api(after, after)["refusal_p99_ms"] is None  # nothing refused between them
    assert overload.inside_api({}, {})["api_loop_lag_p99_ms"] is None  # scrapes that did not answer


def test_checks_judge_the_top_step_against_1x_and_the_shed_p99_both_ways() -> None:
    top = {"goodput_ratio": overload.GOODPUT_RATIO_MIN, "p99_ratio": overload.P99_RATIO_MAX + 0.1,
           "shed_p99_ms": overload.SHED_P99_MAX_MS * 4, "shed_sent_p99_ms": overload.SHED_P99_MAX_MS,
           "internal_ok": None}
    got = overload.checks([{"policy": "off-edge", "steps": [{}, top]}])["off-edge"]
    assert got == {"goodput_ratio": True, "p99_ratio": False, "shed_p99": False, "shed_p99_sent": True,
                   "internal_ok": None}
