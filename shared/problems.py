"""RFC 9457 problem responses with Weir's stable `code` member."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

PROBLEM_TYPE_BASE = "https://weir.dev/problems/"


def problem_body(status: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": PROBLEM_TYPE_BASE + code,
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
        **extra,
    }


def www_authenticate(code: object) -> str:
    """A 401's challenge (RFC 9110 11.6.1 requires one), in RFC 6750's terms: a credential that was sent and
    refused is an `invalid_token`; none sent, the bare scheme."""
    return 'Bearer realm="weir"' + ("" if code in ("missing_credential", "playback_token_required") else
                                    ', error="invalid_token"')


def problem(
    status: int, code: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    if status == 401:
        headers = {"WWW-Authenticate": www_authenticate(code), **(headers or {})}
    return JSONResponse(
        problem_body(status, code, detail, **extra),
        status_code=status,
        media_type="application/problem+json",
        headers=headers,
    )


class Problem(Exception):
    """Raised by a route to answer with a problem body."""

    def __init__(self, status: int, code: str, detail: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers, self.extra = status, code, detail, headers, extra

    def response(self) -> JSONResponse:
        return problem(self.status, self.code, self.detail, headers=self.headers, **self.extra)
