from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class SweepSettings(CommonSettings):
    claim_stale_seconds: int = Field(900, description="age after which a completion claim no longer protects a video")
    sweep_min_age_seconds: int = Field(86400, description="age a video must reach before it is a candidate")
    sweep_max_retire_share: float = Field(0.5, description="share of candidates a run may retire without --force")
    sweep_valve_min_candidates: int = Field(20, description="candidates below which the safety valve does not apply")
    sweep_daily_at: str = Field("03:00", pattern=r"^([01]\d|2[0-3]):[0-5]\d$", description="daily run time, UTC")
    sweep_daily_enabled: bool = Field(True, description="run the daily sweep from this instance")
    sweep_daily_retry_seconds: float = Field(300.0, gt=0, description="wait before a failed daily run is tried again")
    sweep_storage_concurrency: int = Field(32, ge=1, description="storage calls in flight at once")
    sweep_storage_timeout_seconds: float = Field(10.0, gt=0, description="a storage call slower than this is uncertain")
    sweep_listing_max_pages: int = Field(100, ge=1, description="pages of one upload listing before it is uncertain")
    sweep_page_size: int = Field(1000, ge=1, description="candidates read from the index per survey page")
    sweep_batch_size: int = Field(100, ge=1, description="rows locked together while storage is read again")
    sweep_batch_concurrency: int = Field(4, ge=1, description="locked batches in flight at once")
