"""The rate-limit headers of a response: the tightest rule that applied, what is left of it, and when it resets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from services.auth.domain.rules import RULE_ORDER, Rule


class AppliedLimit(NamedTuple):
    """The tightest rule that applied to a request: what is left of it and when it resets (seconds).

    Made for every request, like `Decision`: a named tuple is as immutable as a frozen dataclass and about a
    fifth as dear to make (a frozen dataclass sets each field through object.__setattr__)."""

    rule: Rule
    remaining: int
    reset: int


def _sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rate_limit_headers(applied: AppliedLimit, retry_after_seconds: int | None = None) -> dict[str, str]:
    """RateLimit-Policy and RateLimit as in draft-ietf-httpapi-ratelimit-headers-11 (list items named by rule id),
    the common X-RateLimit-* trio (reset in seconds), and Retry-After on a refusal."""
    name = _sf_string(applied.rule.id)
    headers = {
        "RateLimit-Policy": f"{name};q={applied.rule.limit};w={applied.rule.window_seconds}",
        "RateLimit": f"{name};r={applied.remaining};t={applied.reset}",
        "X-RateLimit-Limit": str(applied.rule.limit),
        "X-RateLimit-Remaining": str(applied.remaining),
        "X-RateLimit-Reset": str(applied.reset),
    }
    if retry_after_seconds is not None:
        headers["Retry-After"] = str(retry_after_seconds)
    return headers


def rate_limit_headers_json(applied: AppliedLimit | None, retry_after_seconds: int | None = None) -> str:
    """`rate_limit_headers(...)` (or only Retry-After, or nothing) as a JSON object, written directly: a rule id is
    a plain word, so its structured-field string needs no escaping beyond JSON's for the quotes."""
    retry = "" if retry_after_seconds is None else f',"Retry-After":"{int(retry_after_seconds)}"'
    if applied is None:
        return "{" + retry[1:] + "}"
    head, middle = applied.rule.headers_json_parts
    remaining, reset = applied.remaining, applied.reset
    return f'{head}{remaining};t={reset}",{middle}{remaining}","X-RateLimit-Reset":"{reset}"{retry}}}'


def tightness(remaining: int, reset: int, rule: Rule) -> tuple[int, int, int]:
    """How tight a rule is, smallest first: fewest remaining; ties to the shortest reset, then to SPEC order."""
    return remaining, reset, RULE_ORDER[rule.id]


def tightest(applied: Iterable[AppliedLimit]) -> AppliedLimit | None:
    """The tightest of the rules that applied (see `tightness`)."""
    return min(applied, key=lambda a: tightness(a.remaining, a.reset, a.rule), default=None)
