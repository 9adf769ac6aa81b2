from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shared.settings import ShedSettings


class ApiSettings(ShedSettings):
    http_port: int = Field(8080, description="port of the public HTTP API")
    part_url_ttl_seconds: int = Field(3600, description="lifetime of a presigned part URL")
    status_max_videos: int = Field(100, ge=1, description="most videos the api asks encode about in one "
                                   "encode.status.v2 request (a listing page up to this many asks in one); the same "
                                   "setting as encode's, which refuses more")
    auth_timeout_ms: int = Field(2000, description="how long the api waits for auth.check before answering 503")
    demo_publishable_key: str = Field("", description="the demo app's publishable key, which the /demo page uploads "
                                      "with (a publishable key is meant for pages; `weir up` sets it); unset: the "
                                      "page asks for one")
    sdk_js_dir: Path = Field(Path(__file__).resolve().parents[2] / "sdk" / "js" / "src",
                             description="where @weir/upload's index.js is, which /demo loads")
    demo_webhook_file: Path | None = Field(None, description="where `weir up` keeps the demo app's endpoint for "
                                           "the demo page's receiver (POST /demo/receiver): a JSON file with its "
                                           "id and signing secret (mode 0600); unset: no receiver")
    demo_receiver_keep: int = Field(200, ge=1, description="deliveries the demo page's receiver keeps in memory "
                                    "(the newest; older ones are forgotten)")
    service_pages: str = Field("", description="the other services' HTTP addresses as name=url, comma-separated, "
                               "which the index page (/) links to (their /asyncapi pages); `weir up` sets it")
