"""`weir up`'s restart policy (weir/supervise.py), every case from the settings."""

from __future__ import annotations

import pytest

from weir.supervise import GiveUp, Restart, SuperviseSettings, after_death

POLICY = SuperviseSettings(quick_seconds=10, max_quick_deaths=5, backoff_ms=200, backoff_max_ms=1000)


def test_a_death_after_running_long_enough_restarts_after_the_base_backoff_and_starts_the_count_over() -> None:
    for before in range(POLICY.max_quick_deaths):
        assert after_death(POLICY.quick_seconds, before, POLICY) == Restart(POLICY.backoff_ms / 1000, 0)


def test_quick_deaths_double_the_wait_up_to_the_maximum_then_give_up() -> None:
    quick, delays = 0, []
    while True:
        decision = after_death(POLICY.quick_seconds / 2, quick, POLICY)
        if isinstance(decision, GiveUp):
            break
        assert decision.quick_deaths == quick + 1
        quick = decision.quick_deaths
        delays.append(decision.delay_s)
    assert decision.quick_deaths == POLICY.max_quick_deaths and "not restarting" in decision.reason
    expected = [min(POLICY.backoff_max_ms, POLICY.backoff_ms * 2 ** i) / 1000
                for i in range(POLICY.max_quick_deaths - 1)]
    assert delays == expected and max(delays) == POLICY.backoff_max_ms / 1000


@pytest.mark.parametrize("ran", [0.0, 0.001, POLICY.quick_seconds - 0.001])
def test_any_run_shorter_than_quick_counts(ran: float) -> None:
    assert after_death(ran, 0, POLICY) == Restart(POLICY.backoff_ms / 1000, 1)


def test_one_quick_death_allowed_gives_up_at_once() -> None:
    strict = POLICY.model_copy(update={"max_quick_deaths": 1})
    assert isinstance(after_death(0.0, 0, strict), GiveUp)


def test_defaults() -> None:
    d = SuperviseSettings()
    assert (d.quick_seconds, d.max_quick_deaths, d.backoff_ms, d.backoff_max_ms) == (30.0, 5, 500, 30_000)
