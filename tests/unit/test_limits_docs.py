"""The request limits as README.md and sdk/js/README.md state them are auth's settings' defaults: a changed default
(or rule) fails here until the docs say it (the expected table is printed, to paste)."""

from __future__ import annotations

from pathlib import Path

from services.api.settings import ApiSettings
from services.auth.domain.applicable import RULE_WORDS
from services.auth.domain.rules import Rule, RuleId, rules_from
from services.auth.settings import AuthSettings

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = AuthSettings.model_construct()  # the declared defaults, whatever WEIR_* the environment sets
RULES = rules_from(DEFAULTS)


def window(seconds: int) -> str:
    return {60: "1 minute", 3600: "1 hour"}.get(seconds, f"{seconds} s")


def setting_of(rule: RuleId) -> str:
    """The WEIR_ setting that sets the rule's limit (`limit_<rule>_per_minute` or `..._per_hour`)."""
    (name,) = [n for n in AuthSettings.model_fields if n.startswith(f"limit_{rule}_per_")]
    return f"WEIR_{name.upper()}"


def row(rule: Rule) -> str:
    shown = window(rule.window_seconds)
    if rule.window_seconds == DEFAULTS.limit_window_seconds:
        shown += " (`WEIR_LIMIT_WINDOW_SECONDS`)"
    words = RULE_WORDS[rule.id]
    return (f"| `{rule.id}` | {words.keyed_by} | {rule.limit:,} | {shown} | `{setting_of(rule.id)}` | "
            f"{words.counts} |")


def expected_table() -> str:
    lines = ["| rule | keyed by | limit | window | setting | what counts |", "|---|---|---|---|---|---|"]
    return "\n".join(lines + [row(RULES[rule]) for rule in RuleId]) + "\n"


def test_the_readme_table_is_the_settings_defaults() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = expected_table()
    assert table in readme, f"README.md's request-limits table should read:\n{table}"
    key = RULES[RuleId.KEY]
    assert f'`RateLimit-Policy: "key";q={key.limit};w={key.window_seconds}`' in readme
    refresh = ApiSettings.model_fields["limits_refresh_seconds"].default
    assert f"`WEIR_LIMITS_REFRESH_SECONDS` ({refresh:g})" in readme


def test_the_sdk_readme_states_the_limits_its_requests_meet() -> None:
    readme = (ROOT / "sdk" / "js" / "README.md").read_text(encoding="utf-8")
    for rule in (RuleId.ADDRESS, RuleId.UPLOAD_TOKEN):
        limit = RULES[rule]
        said = f"{limit.limit:,} requests per {window(limit.window_seconds)} (`{rule}`)"
        assert said in " ".join(readme.split()), f"sdk/js/README.md should say: {said}"
