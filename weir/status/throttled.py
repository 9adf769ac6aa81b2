"""Who is throttled: each auth instance's `GET /throttled` (its most refused callers, 429s only, in its last windows),
asked with Weir's internal token, and the instances' answers summed into one list (`merged`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.auth.domain.throttled import CallerClass, merge_counts
from services.auth.throttled import PATH, ThrottledCaller, ThrottledReport
from weir.status.model import Snapshot, Unavailable, reason_of
from weir.status.services import service_kind

INTERNAL_HEADER = "X-Weir-Internal-Token"


def merged(reports: Iterable[ThrottledReport], top: int) -> list[ThrottledCaller]:
    """The `top` most refused callers of every instance together: a caller's 429s (and over-count bounds) summed
    across instances, the most refused first."""
    summed = merge_counts([c.count() for c in report.callers] for report in reports)
    return [ThrottledCaller.of(c) for c in summed[:top]]


@dataclass(frozen=True)
class ThrottledView:
    """What `weir status` shows of who is throttled: the most refused of every instance read, summed, and each
    instance's own total (None: not read)."""

    window_seconds: int
    windows: int
    top: list[ThrottledCaller]
    instances: dict[str, int | None]


def throttled_view(s: Snapshot) -> ThrottledView | None:
    """None when nothing was read (no internal token to ask with, or no instance answered)."""
    if s.throttled is None or isinstance(s.throttled, Unavailable):
        return None
    read = [r for r in s.throttled.values() if isinstance(r, ThrottledReport)]
    if not read:
        return None
    return ThrottledView(
        window_seconds=max(r.window_seconds for r in read), windows=max(r.windows for r in read),
        top=merged(read, s.throttled_top),
        instances={name: sum(c.refused for c in r.callers) if isinstance(r, ThrottledReport) else None
                   for name, r in s.throttled.items()})


def internal_refusals(s: Snapshot) -> dict[str, int]:
    """Weir's own internal traffic refused lately, by rule (every instance's, not only the top shown)."""
    found: dict[str, int] = {}
    if s.throttled is None or isinstance(s.throttled, Unavailable):
        return found
    for report in s.throttled.values():
        if isinstance(report, ThrottledReport):
            for c in report.callers:
                if c.caller == CallerClass.INTERNAL:
                    found[c.rule] = found.get(c.rule, 0) + c.refused
    return found


async def read_throttled(services: Mapping[str, str], timeout: float, token: str
                         ) -> dict[str, ThrottledReport | Unavailable] | Unavailable | None:
    """Each auth instance's report; None when there is no internal token to ask with (not read: the route is for
    operators only)."""
    import httpx

    if not token:
        return None
    auths = {name: url for name, url in services.items() if service_kind(name) == "auth"}
    if not auths:
        return Unavailable("no auth service address (its /throttled tells who is refused): pass --service auth=URL")

    async with httpx.AsyncClient(timeout=timeout, headers={INTERNAL_HEADER: token}) as http:

        async def one(url: str) -> ThrottledReport | Unavailable:
            try:
                r = await http.get(f"{url}{PATH}")
                if r.status_code != 200:  # the problem's code says why (a wrong token: invalid_credential)
                    code = r.json().get("code") if r.headers.get("content-type", "").endswith("json") else None
                    return Unavailable(f"{url}{PATH}: HTTP {r.status_code}" + (f" {code}" if code else ""))
                return ThrottledReport.model_validate_json(r.content)
            except Exception as exc:
                return Unavailable(f"{url}{PATH}: {reason_of(exc)}")

        read = await asyncio.gather(*(one(url) for url in auths.values()))
    return dict(zip(auths, read, strict=True))
