from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class SweepSettings(CommonSettings):
    claim_stale_seconds: int = Field(900, description="age after which a completion claim no longer protects a video")
    sweep_min_age_seconds: int = Field(86400, description="age a video must reach before it is a candidate")
    sweep_max_retire_share: float = Field(0.5, description="share of candidates a run may retire without --force")
    sweep_valve_min_candidates: int = Field(20, description="candidates below which the safety valve does not apply")
    sweep_daily_at: str = Field("03:00", pattern=r"^\d{2}:\d{2}$", description="daily run time, UTC")
