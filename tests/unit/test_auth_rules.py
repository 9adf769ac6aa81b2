"""The limit rules from the settings, and their counters' keys and subjects."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.auth.domain.rules import (
    HOUR_SECONDS,
    CounterKey,
    Rule,
    RuleId,
    counter_subject,
    rules_from,
    subject_token,
    subject_value,
)
from services.auth.settings import AuthSettings
from tests.unit.authfixtures import ADDRESS, BOTH, DEFAULTS, SMALL, T0


@BOTH
def test_rules_come_from_the_settings(cfg: AuthSettings) -> None:
    rules = rules_from(cfg)
    assert list(rules) == list(RuleId)
    assert [r.value for r in RuleId] == [
        "address", "auth_failure", "key", "owner", "upload_token", "app_create", "key_rotate"
    ]
    expected = {
        RuleId.ADDRESS: (cfg.limit_address_per_minute, cfg.limit_window_seconds),
        RuleId.AUTH_FAILURE: (cfg.limit_auth_failure_per_minute, cfg.limit_window_seconds),
        RuleId.KEY: (cfg.limit_key_per_minute, cfg.limit_window_seconds),
        RuleId.OWNER: (cfg.limit_owner_per_minute, cfg.limit_window_seconds),
        RuleId.UPLOAD_TOKEN: (cfg.limit_upload_token_per_minute, cfg.limit_window_seconds),
        RuleId.APP_CREATE: (cfg.limit_app_create_per_hour, HOUR_SECONDS),
        RuleId.KEY_ROTATE: (cfg.limit_key_rotate_per_hour, HOUR_SECONDS),
    }
    assert {rid: (r.limit, r.window_seconds) for rid, r in rules.items()} == expected
    assert all(r.id is rid for rid, r in rules.items())


_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


@pytest.mark.parametrize(
    "value",
    ["0190e3c1-7b7a-7c6e-9a53-8d7f1c2b3a4d", "key-1", ADDRESS, "2001:db8:1:2::/64", "a.b", "*", ">", "x y", "_x"],
)
def test_subject_tokens_are_safe_and_reversible(value: str) -> None:
    token = subject_token(value)
    assert _SUBJECT_TOKEN.fullmatch(token)
    assert subject_value(token) == value


def test_ids_stay_readable_in_subjects_and_addresses_are_encoded() -> None:
    assert subject_token("key-1") == "key-1"
    assert subject_token(ADDRESS).startswith("_")


@given(st.text(min_size=1, max_size=80))
def test_every_value_has_a_safe_distinct_token(value: str) -> None:
    token = subject_token(value)
    assert _SUBJECT_TOKEN.fullmatch(token)
    assert subject_value(token) == value


def test_counter_subject() -> None:
    rule = rules_from(SMALL)[RuleId.ADDRESS]
    key = CounterKey.of(rule, ADDRESS)
    start = key.window_start(T0 + 1)
    subject = counter_subject("weir.limits", key, start)
    assert subject == f"weir.limits.address.{subject_token(ADDRESS)}.{int(T0)}"
    assert not any(ch in subject for ch in " *>")
    for bad in ("", "a.", ".a", "a.*", "a b", "a.>"):
        with pytest.raises(ValueError):
            counter_subject(bad, key, start)


def test_key_of_a_counter_is_hashed_once() -> None:
    rule = Rule(RuleId.KEY, DEFAULTS.limit_key_per_minute, DEFAULTS.limit_window_seconds)
    a, b = CounterKey(rule, "k"), CounterKey(rule, "k")
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert CounterKey(rule, "other") != a
