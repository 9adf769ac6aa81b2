"""`GET /throttled` on each auth instance: the callers it refused 429 most in the last few windows (operators only,
with Weir's internal token, as /settings). `weir status` sums the instances' answers (weir/status/throttled.py).

What is shown of a caller: its class, the rule, account and app ids, a key's first characters (at most 12), or the
client address when no account is known. Never a credential. 401s are not here: a credential refused is not a
caller throttled (they are counted by code on /metrics, `weir_check_decisions_total`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.auth.checker import Checker
from services.auth.domain.throttled import RefusedCaller, RefusedCount
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH
from shared.problems import problem
from shared.routeclass import OPERATIONS_ROUTE
from shared.runtime import OPERATORS_ONLY_RESPONSES, Runtime, operators_only

PATH = "/throttled"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # read by `weir status` of another release: tolerant


class ThrottledCaller(_Model):
    caller: str = Field(description="internal, secret_key, publishable_key, upload_token, account_token, rejected or "
                        "no_credential")
    rule: str = Field(description="the limit rule that refused it (SPEC 3)")
    account_id: str | None = None
    app_id: str | None = None
    key_prefix: Annotated[str, StringConstraints(max_length=KEY_PREFIX_MAX_LENGTH)] | None = Field(
        None, description="the first characters of the key it presented")
    address: str | None = Field(None, description="the client address, only when no account or app is known")
    refused: int = Field(description="429s in the windows summed")
    error: int = Field(0, description="at most this many of them may be other callers' (bounded counting)")

    @classmethod
    def of(cls, c: RefusedCount) -> ThrottledCaller:
        w = c.who
        return cls(caller=w.caller, rule=c.rule, account_id=w.account_id, app_id=w.app_id, key_prefix=w.key_prefix,
                   address=w.address, refused=c.count, error=c.error)

    def count(self) -> RefusedCount:
        return RefusedCount(RefusedCaller(self.caller, self.account_id, self.app_id, self.key_prefix, self.address),
                            self.rule, self.refused, self.error)


class ThrottledReport(_Model):
    """One auth instance's 429s by caller and rule since `since` (the start of its oldest window counted)."""

    window_seconds: int
    windows: int
    since: float = Field(description="Unix time: the start of the oldest window summed")
    callers: list[ThrottledCaller] = Field(description="the most refused first")


def report(checker: Checker, now: float) -> ThrottledReport:
    refusals = checker.refusals
    return ThrottledReport(window_seconds=refusals.window_seconds, windows=refusals.windows,
                           since=refusals.oldest_start(now),
                           callers=[ThrottledCaller.of(c) for c in refusals.top(now)])


def routes(app: FastAPI, rt: Runtime) -> None:
    @app.get(PATH, tags=["operations"], response_model=None, **OPERATIONS_ROUTE, responses={
        200: {"model": ThrottledReport}, **OPERATORS_ONLY_RESPONSES,
        503: {"description": "auth has not started checking yet", "content": {"application/problem+json": {}}}})
    async def throttled(request: Request) -> ThrottledReport | JSONResponse:
        """The callers this instance refused 429 most in its last windows, for operators only: the request must
        carry Weir's internal token."""
        refused = operators_only(rt.settings, request)
        if refused is not None:
            return refused
        checker: Checker | None = rt.state.get("checker")
        if checker is None:
            return problem(503, "unavailable", "not started yet", headers={"Retry-After": "1"})
        return report(checker, checker.clock())
