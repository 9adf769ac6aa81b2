"""auth's routes for operators, beside the ones every service has (shared/runtime.py): `GET /throttled`, who this
instance refused 429 lately (services/auth/throttled.py), with Weir's internal token only, as /settings."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.auth.checker import Checker
from services.auth.throttled import PATH, ThrottledReport, report
from shared.problems import problem
from shared.routeclass import OPERATIONS_ROUTE
from shared.runtime import OPERATORS_ONLY_RESPONSES, NotStarted, Runtime, operators_only


def routes(app: FastAPI, rt: Runtime, checker: Callable[[], Checker]) -> None:
    """`checker`: the one auth's start made (NotStarted before)."""
    @app.get(PATH, tags=["operations"], response_model=None, **OPERATIONS_ROUTE, responses={
        200: {"model": ThrottledReport}, **OPERATORS_ONLY_RESPONSES,
        503: {"description": "auth has not started checking yet", "content": {"application/problem+json": {}}}})
    async def throttled(request: Request) -> ThrottledReport | JSONResponse:
        """The callers this instance refused 429 most in its last windows, for operators only: the request must
        carry Weir's internal token."""
        refused = operators_only(rt.settings, request)
        if refused is not None:
            return refused
        try:
            made = checker()
        except NotStarted:
            return problem(503, "unavailable", "not started yet", headers={"Retry-After": "1"})
        return report(made.refusals, made.clock())
