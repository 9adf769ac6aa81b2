"""Waiting in tests, with a deadline and never a fixed sleep: `wait_for` polls a check (sync or async) inside an event
loop, `wait_for_sync` in a plain test; both return the value that satisfied it, or fail naming what was awaited and
the last value seen. Built on them: a service process until /readyz says ready, and a child process until stopped."""

from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, cast

import httpx

T = TypeVar("T")


def _truthy(value: object) -> bool:
    return bool(value)


class TimedOut(AssertionError):
    """A wait's deadline passed; `last` is the last value seen (a caller may add what it knows: a log, a state)."""

    def __init__(self, message: str, last: object = None) -> None:
        super().__init__(message)
        self.last = last


def _timed_out(what: str, timeout: float, last: object) -> TimedOut:
    return TimedOut(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})", last)


async def wait_for(check: Callable[[], Awaitable[T] | T], timeout: float, what: str = "condition", *,
                   interval: float = 0.05, until: Callable[[T], bool] = _truthy) -> T:
    """Call `check` every `interval` s until `until(value)` holds (by default: the value is truthy); return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        got = cast(T, value)
        if until(got):
            return got
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, got)
        await asyncio.sleep(interval)


def wait_for_sync(check: Callable[[], T], timeout: float, what: str = "condition", *, interval: float = 0.1,
                  until: Callable[[T], bool] = _truthy) -> T:
    """`wait_for` for a test without an event loop (it sleeps its thread between calls)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if until(got):
            return got
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, got)
        time.sleep(interval)


def wait_service_ready(url: str, proc: subprocess.Popen[bytes], log: Path | None = None,
                       timeout: float = 60.0) -> httpx.Response:
    """Until the service process `proc` answers `GET {url}/readyz` with 200 (that answer returned); fails at once if it
    exits, and with the tail of its output (`log`, else its stdout pipe) either way."""

    def output() -> str:
        if log is not None:
            return log.read_text(errors="replace")[-3000:]
        return (proc.communicate()[0] or b"").decode(errors="replace")[-3000:] if proc.poll() is not None else ""

    def answer() -> httpx.Response | None:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited with {proc.returncode}:\n{output()}")
        try:
            r = httpx.get(f"{url}/readyz", timeout=2)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 200 else None

    try:
        ready = wait_for_sync(answer, timeout, f"{url}/readyz", interval=0.05)
    except TimedOut as e:
        raise TimedOut(f"{e}\n{output()}", e.last) from None
    assert ready is not None  # wait_for_sync returns only a truthy answer
    return ready


def stop_process(proc: subprocess.Popen[bytes], timeout: float, sig: int = signal.SIGTERM) -> int:
    """Stop a child by its own pid: `sig`, then SIGKILL if it has not exited after `timeout` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
