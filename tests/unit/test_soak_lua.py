"""bench/soak.py's reading of bench/soak.lua's document, without wrk or a stack: percentiles from its histograms,
which statuses are errors, how many wrk connections a rate gets."""

from __future__ import annotations

from bench.soak import Minute, hist_pct, merge_wrk, pct, wrk_threads


def test_hist_pct_ranks_as_pct_does() -> None:
    values_us = [100.0] * 50 + [1000.0] * 49 + [20000.5]
    hist: dict[str, int] = {}
    for v in values_us:
        hist[f"{v:.1f}"] = hist.get(f"{v:.1f}", 0) + 1
    for q in (0.0, 0.5, 0.98, 0.99, 1.0):
        assert hist_pct(hist, q) == pct([v / 1e6 for v in values_us], q)
    assert hist_pct({}, 0.5) is None
    assert hist_pct({"5.0": 0}, 0.5) is None


def test_wrk_threads_one_request_per_200_ms_per_connection_within_8_to_160() -> None:
    assert wrk_threads(10) == 8
    assert wrk_threads(617) == 124
    assert wrk_threads(5000) == 160


def test_merge_wrk_counts_unexpected_statuses_and_lost_requests_as_errors() -> None:
    doc = {"minutes": [
        {"read": {"hist": {"900.5": 3}, "status": {"200": 3, "500": 1}, "no_response": 0},
         "bad_credential": {"hist": {"400.5": 4}, "status": {"401": 3, "429": 1, "200": 2}, "no_response": 1}},
        {"create": {"hist": {}, "status": {"201": 0}, "no_response": 2}},
    ]}
    minutes = [Minute()]
    minutes[0].answered["upload"] = 1
    hists = merge_wrk(doc, minutes)
    assert len(minutes) == 2
    assert hists["0/read"] == {"900.5": 3}
    assert {k: dict(v) for k, v in minutes[0].errors.items()} == {
        "read": {"500": 1}, "bad_credential": {"200": 2, "no_response": 1}}
    assert dict(minutes[0].expected) == {"bad_credential": 4}
    assert dict(minutes[0].answered) == {"upload": 1, "read": 4, "bad_credential": 6}
    assert {k: dict(v) for k, v in minutes[1].errors.items()} == {"create": {"no_response": 2}}
