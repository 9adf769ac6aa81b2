"""Fixed, clock-aligned windows."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.rules import HOUR_SECONDS
from services.auth.domain.windows import WindowsAt, retry_after, seconds_until, window_end, window_start
from tests.unit.authfixtures import T0, WINDOW


@pytest.mark.parametrize("seconds", [WINDOW, HOUR_SECONDS])
def test_windows_are_aligned_to_the_clock(seconds: int) -> None:
    boundary = T0 + seconds
    assert window_start(boundary, seconds) == boundary
    assert window_start(math.nextafter(boundary, 0), seconds) == T0
    assert window_start(boundary - 0.001, seconds) == T0
    assert window_end(T0, seconds) == boundary
    assert window_end(math.nextafter(boundary, 0), seconds) == boundary
    assert window_end(boundary, seconds) == boundary + seconds


@pytest.mark.parametrize("seconds", [WINDOW, HOUR_SECONDS])
def test_retry_after_is_whole_seconds_to_the_window_end_rounded_up(seconds: int) -> None:
    assert retry_after(T0, seconds) == seconds
    assert retry_after(T0 + 0.5, seconds) == seconds
    assert retry_after(T0 + 1, seconds) == seconds - 1
    assert retry_after(T0 + seconds - 1, seconds) == 1
    assert retry_after(T0 + seconds - 0.001, seconds) == 1
    assert retry_after(math.nextafter(T0 + seconds, 0), seconds) == 1
    assert retry_after(T0 + seconds, seconds) == seconds


def test_a_window_must_last() -> None:
    with pytest.raises(ValueError):
        window_start(T0, 0)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.sampled_from([1, 7, WINDOW, HOUR_SECONDS]))
def test_window_properties(now: float, seconds: int) -> None:
    start = window_start(now, seconds)
    assert start <= now < start + seconds and start % seconds == 0
    assert 1 <= retry_after(now, seconds) <= seconds
    assert now + retry_after(now, seconds) >= window_end(now, seconds)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.sampled_from([1, 7, WINDOW, HOUR_SECONDS]))
def test_windows_at_a_moment_are_the_window_functions(now: float, window: int) -> None:
    at = WindowsAt(now)
    assert at.end_and_reset(window) == (window_end(now, window), seconds_until(now, window_end(now, window)))
    assert at.end_and_reset(window) == at.end_and_reset(window)
