from __future__ import annotations

from pydantic import Field, SecretStr

from shared.settings import CommonSettings


class ApiSettings(CommonSettings):
    http_port: int = Field(8080, description="port of the public HTTP API")
    part_url_ttl_seconds: int = Field(3600, description="lifetime of a presigned part URL")
    internal_token: SecretStr = Field(SecretStr(""), description="secret shared by Weir's own services and edges")
    trusted_proxies: str = Field("", description="comma-separated addresses/CIDRs whose X-Forwarded-For is read")
    auth_timeout_ms: int = Field(2000, description="how long the api waits for auth.check before answering 503")
