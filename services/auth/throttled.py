"""What `GET /throttled` answers on each auth instance (services/auth/operators.py): the callers it refused 429 most in
its last few windows. `weir status` sums the instances' answers (weir/status/throttled.py).

What is shown of a caller: its class, the rule, account and app ids, a key's first characters (at most 12), or the
client address when no account is known. Never a credential. 401s are not here: a credential refused is not a
caller throttled (they are counted by code on /metrics, `weir_check_decisions_total`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.auth.domain.throttled import RecentRefusals, RefusedCaller, RefusedCount
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH

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


def report(refusals: RecentRefusals, now: float) -> ThrottledReport:
    return ThrottledReport(window_seconds=refusals.window_seconds, windows=refusals.windows,
                           since=refusals.oldest_start(now),
                           callers=[ThrottledCaller.of(c) for c in refusals.top(now)])
