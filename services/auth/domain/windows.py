"""Fixed, clock-aligned windows: where one starts and ends, and how long a client waits for the next."""

from __future__ import annotations

import math


def window_start(now: float, window_seconds: int) -> int:
    """Start of the fixed, clock-aligned window holding `now` (a minute window starts on the minute)."""
    if window_seconds <= 0:
        raise ValueError("a window must last at least one second")
    return math.floor(now) // window_seconds * window_seconds


def window_end(now: float, window_seconds: int) -> int:
    return window_start(now, window_seconds) + window_seconds


def retry_after(now: float, window_seconds: int) -> int:
    """Whole seconds until the window holding `now` ends, rounded up, at least 1."""
    return max(1, math.ceil(window_end(now, window_seconds) - now))


def seconds_until(now: float, moment: float) -> int:
    return max(1, math.ceil(moment - now))


class WindowsAt:
    """Each window length's end and reset (`window_end`, `seconds_until` it) at one moment, worked out once: a batch
    of requests is decided at one `now`, and its requests share a few window lengths."""

    __slots__ = ("_ends", "now")

    def __init__(self, now: float) -> None:
        self.now = now
        self._ends: dict[int, tuple[int, int]] = {}

    def end_and_reset(self, window_seconds: int) -> tuple[int, int]:
        got = self._ends.get(window_seconds)
        if got is None:
            end = window_end(self.now, window_seconds)
            got = self._ends[window_seconds] = (end, seconds_until(self.now, end))
        return got
