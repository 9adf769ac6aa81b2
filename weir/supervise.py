"""What `weir up` does when a service process dies: start it again after a backoff, or give up on it.

A pure decision over the service's recent deaths (tested without processes; weir/up.py's Supervisor applies it). A
death is quick when the process ran less than `quick_seconds`; the n-th quick death in a row waits
`backoff_ms * 2 ** (n - 1)` (at most `backoff_max_ms`), a long run's death `backoff_ms` and resets the count. After
`max_quick_deaths` quick deaths it is not restarted: it cannot start (a bad setting, a port in use, a missing
dependency), and restarting it for ever would only hide that.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SuperviseSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_SUPERVISE_", extra="ignore", frozen=True)

    quick_seconds: float = Field(30.0, gt=0, description="a death this soon after a (re)start counts as quick")
    max_quick_deaths: int = Field(5, ge=1, description="quick deaths in a row after which `weir up` stops restarting")
    backoff_ms: int = Field(500, ge=0, description="wait before the first restart; doubled after each quick death")
    backoff_max_ms: int = Field(30_000, ge=0, description="the longest wait before a restart")


@dataclass(frozen=True)
class Restart:
    delay_s: float
    quick_deaths: int  # in a row, this one included (0: it had run long enough)


@dataclass(frozen=True)
class GiveUp:
    quick_deaths: int
    reason: str


def after_death(ran_s: float, quick_before: int, policy: SuperviseSettings) -> Restart | GiveUp:
    """The decision after a service died `ran_s` seconds after it was (re)started, having died quickly
    `quick_before` times in a row before that."""
    if ran_s >= policy.quick_seconds:
        return Restart(policy.backoff_ms / 1000, 0)
    quick = quick_before + 1
    if quick >= policy.max_quick_deaths:
        return GiveUp(quick, f"it died {quick} times in a row within {policy.quick_seconds:g} s of starting; "
                             "not restarting it (its last lines are above)")
    delay_ms = min(policy.backoff_max_ms, policy.backoff_ms * 2 ** (quick - 1))
    return Restart(delay_ms / 1000, quick)
