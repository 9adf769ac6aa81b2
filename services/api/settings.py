from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class ApiSettings(CommonSettings):
    http_port: int = Field(8080, description="port of the public HTTP API")
    part_url_ttl_seconds: int = Field(3600, description="lifetime of a presigned part URL")
    auth_timeout_ms: int = Field(2000, description="how long the api waits for auth.check before answering 503")
