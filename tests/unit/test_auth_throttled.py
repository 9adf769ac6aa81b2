"""Who is throttled, without servers (services/auth/domain/throttled.py): the caller class of every credential outcome
and internal-token verdict, what is shown of a caller (never a secret), the space-saving table's bounds, the windows
of `RecentRefusals`, and summing counts across windows or instances."""

from __future__ import annotations

import itertools
import random
import typing

import pytest

from services.auth.domain.access import (
    AcceptedAccountToken,
    AcceptedPublishableKey,
    AcceptedSecretKey,
    CredentialOutcome,
    NoCredential,
    RejectedCredential,
    RejectionReason,
    UnusableReason,
    UnusableUploadToken,
    ValidUploadToken,
)
from services.auth.domain.credentials import FormKind, InternalToken, mint_key
from services.auth.domain.throttled import (
    CallerClass,
    RecentRefusals,
    RefusedCaller,
    RefusedCount,
    SpaceSaving,
    caller_class,
    merge_counts,
    presented_key_prefix,
    refused_caller,
)
from services.auth.domain.upload_tokens import UploadTokenClaims
from services.auth.settings import AuthSettings
from shared.events.catalog import KEY_PREFIX_MAX_LENGTH

CLAIMS = UploadTokenClaims(video_id="vid", app_id="app-u", key_id="key-u", expires_at=2_000_000_000)
ADDRESS = "203.0.113.7"

# one of each credential outcome (CredentialOutcome's members), and the class it is when no internal token is present
OUTCOMES: dict[type, tuple[CredentialOutcome, CallerClass]] = {
    NoCredential: (NoCredential(), CallerClass.NO_CREDENTIAL),
    AcceptedSecretKey: (AcceptedSecretKey("key-s", "acct-s", "app-s"), CallerClass.SECRET_KEY),
    AcceptedPublishableKey: (AcceptedPublishableKey("key-p", "acct-p", "app-p"), CallerClass.PUBLISHABLE_KEY),
    AcceptedAccountToken: (AcceptedAccountToken("user-a", "acct-a"), CallerClass.ACCOUNT_TOKEN),
    ValidUploadToken: (ValidUploadToken("tok", CLAIMS), CallerClass.UPLOAD_TOKEN),
    UnusableUploadToken: (UnusableUploadToken("tok", CLAIMS, UnusableReason.EXPIRED), CallerClass.UPLOAD_TOKEN),
    RejectedCredential: (RejectedCredential("secret_key", RejectionReason.UNKNOWN, "wsk_abcdefgh"),
                         CallerClass.REJECTED),
}


def test_every_credential_outcome_has_a_case() -> None:
    """A new kind of outcome fails here until it is given a class (and `caller_class` would raise KeyError)."""
    assert set(OUTCOMES) == set(typing.get_args(CredentialOutcome))


@pytest.mark.parametrize(("kind", "internal"), list(itertools.product(OUTCOMES, InternalToken)))
def test_the_caller_class_of_every_outcome_and_internal_token(kind: type, internal: InternalToken) -> None:
    outcome, alone = OUTCOMES[kind]
    if internal is InternalToken.REAL:
        expected = CallerClass.INTERNAL  # Weir's own traffic, whatever customer credential it carries along
    elif internal is InternalToken.FORGED and kind is NoCredential:
        expected = CallerClass.REJECTED  # a forged internal token is a rejected credential (SPEC 2)
    else:
        expected = alone
    assert caller_class(outcome, internal) is expected


def test_the_caller_classes_are_the_issues_and_two_more() -> None:
    assert {c.value for c in CallerClass} == {"internal", "secret_key", "publishable_key", "upload_token",
                                              "no_credential", "account_token", "rejected"}


@pytest.mark.parametrize("kind", list(FormKind))
def test_only_a_secret_or_publishable_keys_prefix_is_shown(kind: FormKind) -> None:
    keys = {FormKind.SECRET_KEY: mint_key(FormKind.SECRET_KEY, bytes(range(32))),
            FormKind.PUBLISHABLE_KEY: mint_key(FormKind.PUBLISHABLE_KEY, bytes(range(1, 33))),
            FormKind.ACCOUNT_TOKEN: mint_key(FormKind.ACCOUNT_TOKEN, bytes(range(2, 34))),
            FormKind.UPLOAD_TOKEN: "wut_" + "A" * 40 + "." + "b" * 43,
            FormKind.INTERNAL_TOKEN_CANDIDATE: "the-real-internal-token-or-a-guess",
            FormKind.MALFORMED: "wsk_short",
            FormKind.NONE: ""}
    raw = keys[kind]
    prefix = presented_key_prefix(f"Bearer {raw}")
    if kind in (FormKind.SECRET_KEY, FormKind.PUBLISHABLE_KEY):
        assert prefix == raw[:KEY_PREFIX_MAX_LENGTH] and len(prefix) == KEY_PREFIX_MAX_LENGTH
    else:
        assert prefix is None
    assert presented_key_prefix(None) is None


def test_what_is_shown_of_each_refused_caller() -> None:
    def shown(kind: type, internal: InternalToken = InternalToken.ABSENT, account: str | None = None,
              prefix: str | None = None) -> RefusedCaller:
        return refused_caller(OUTCOMES[kind][0], internal, ADDRESS, account_id=account, presented_prefix=prefix)

    assert shown(AcceptedSecretKey, prefix="wsk_12345678") == RefusedCaller(
        "secret_key", "acct-s", "app-s", "wsk_12345678")
    assert shown(AcceptedPublishableKey, prefix="wpk_12345678") == RefusedCaller(
        "publishable_key", "acct-p", "app-p", "wpk_12345678")
    assert shown(AcceptedAccountToken) == RefusedCaller("account_token", "acct-a")
    # an upload token names its app; its account is the identity's (the key that minted it)
    assert shown(ValidUploadToken, account="acct-u") == RefusedCaller("upload_token", "acct-u", "app-u")
    assert shown(UnusableUploadToken) == RefusedCaller("upload_token", None, "app-u")
    # no account known: the address is all there is; a rejected key's characters are the sender's, not shown, so
    # that an address spraying made-up keys is one caller
    assert shown(RejectedCredential, account="ignored") == RefusedCaller("rejected", address=ADDRESS)
    assert shown(NoCredential) == RefusedCaller("no_credential", address=ADDRESS)
    assert shown(NoCredential, InternalToken.FORGED) == RefusedCaller("rejected", address=ADDRESS)
    assert shown(NoCredential, InternalToken.REAL) == RefusedCaller("internal", address=ADDRESS)
    assert shown(AcceptedSecretKey, InternalToken.REAL, prefix="wsk_12345678") == RefusedCaller(
        "internal", "acct-s", "app-s", "wsk_12345678")
    # never more than a prefix's length, whatever is handed in
    assert shown(AcceptedSecretKey, prefix="wsk_" + "x" * 40).key_prefix == "wsk_" + "x" * (KEY_PREFIX_MAX_LENGTH - 4)


# --- the space-saving table -------------------------------------------------------------------------------------------


def test_under_capacity_the_table_counts_exactly() -> None:
    table: SpaceSaving[str] = SpaceSaving(4)
    for key, n in (("a", 3), ("b", 1), ("a", 2), ("c", 5)):
        table.add(key, n)
    assert table.items() == [("a", 5, 0), ("c", 5, 0), ("b", 1, 0)]  # ties in the order first seen
    assert table.total == 11


def test_a_new_key_takes_the_smallest_counters_place_and_count() -> None:
    table: SpaceSaving[str] = SpaceSaving(2)
    table.add("a", 5)
    table.add("b", 2)
    table.add("c")
    assert dict((k, (c, e)) for k, c, e in table.items()) == {"a": (5, 0), "c": (3, 2)}
    with pytest.raises(ValueError):
        SpaceSaving(0)


@pytest.mark.parametrize("seed", range(5))
def test_the_tables_bounds_hold_on_a_skewed_stream(seed: int) -> None:
    """At most `capacity` keys; each held count is over by at most its error; every key seen more than total/capacity
    times is held (the guarantee that makes the heavy callers visible)."""
    rng = random.Random(seed)
    capacity = 8
    table: SpaceSaving[int] = SpaceSaving(capacity)
    true: dict[int, int] = {}
    for _ in range(2000):
        key = min(int(rng.paretovariate(1.2)), 200)
        true[key] = true.get(key, 0) + 1
        table.add(key)
    held = {k: (c, e) for k, c, e in table.items()}
    assert len(held) <= capacity and table.total == 2000
    for key, (count, error) in held.items():
        assert count - error <= true[key] <= count
    for key, n in true.items():
        if n > table.total / capacity:
            assert key in held, (key, n)


# --- windows ----------------------------------------------------------------------------------------------------------

WHO = RefusedCaller("secret_key", "acct", "app", "wsk_12345678")
OTHER = RefusedCaller("no_credential", address=ADDRESS)


def test_recent_refusals_sum_the_last_windows_and_forget_older_ones() -> None:
    s = AuthSettings()
    w, n = s.throttled_window_seconds, s.throttled_windows
    recent = RecentRefusals(w, n, s.throttled_capacity)
    start = 1_000_000 * w  # aligned to the window
    recent.record(WHO, "key", start)  # the oldest window, about to go
    for i in range(1, n):
        recent.record(WHO, "key", start + i * w + 0.5)
    recent.record(OTHER, "address", start + (n - 1) * w, n + 1)
    now = start + (n - 1) * w + 1
    assert recent.oldest_start(now) == start
    assert recent.top(now) == [RefusedCount(OTHER, "address", n + 1), RefusedCount(WHO, "key", n)]
    later = now + w  # the first window is no longer counted, and goes at the next record
    assert recent.top(later) == [RefusedCount(OTHER, "address", n + 1), RefusedCount(WHO, "key", n - 1)]
    assert len(recent) == n + 1
    recent.record(WHO, "key", later)
    assert len(recent) == n + 1  # one entry more in the new window, the first window's gone
    assert recent.top(start + 10 * n * w) == []


def test_recent_refusals_stay_bounded_under_a_flood_of_callers() -> None:
    w, n, capacity = 60, 3, 16
    recent = RecentRefusals(w, n, capacity)
    heavy = RefusedCaller("internal", address="10.0.0.1")
    for i in range(20 * capacity * n):
        now = i * (w * n * 2) / (20 * capacity * n)  # across twice the windows counted
        recent.record(RefusedCaller("no_credential", address=f"198.51.{i // 250 % 250}.{i % 250}"), "address", now)
        if i % 4 == 0:
            recent.record(heavy, "key", now)
        assert len(recent) <= n * capacity
    assert recent.top(now)[0].who == heavy


def test_merge_sums_by_caller_and_rule_most_refused_first() -> None:
    merged = merge_counts([
        [RefusedCount(WHO, "key", 4, 1), RefusedCount(OTHER, "address", 2)],
        [RefusedCount(WHO, "key", 3), RefusedCount(WHO, "owner", 6), RefusedCount(OTHER, "address", 1, 1)],
    ])
    assert merged == [RefusedCount(WHO, "key", 7, 1), RefusedCount(WHO, "owner", 6),
                      RefusedCount(OTHER, "address", 3, 1)]
    assert merge_counts([]) == []
