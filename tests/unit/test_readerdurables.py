"""weir/readerdurables.py: what `weir streams apply` does to the publishers' durables, decided purely."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.identities import PUBLISHER_IDENTITY, publisher_like
from shared.settings import CommonSettings
from weir.readerdurables import (
    MADE_BY,
    MADE_BY_OPERATOR,
    READER,
    Existing,
    consumer_config,
    plan,
    reader_durables,
    reader_identities,
)

ACME = publisher_like("acme", ["acme1"])
WANTED = reader_durables([ACME])
VIDEOS = next(d for _, d in WANTED if d.stream == "VIDEOS")
ENCODE = next(d for _, d in WANTED if d.stream == "ENCODE")


def ours(stream: str, name: str, flt: str, **kw: object) -> Existing:
    return Existing(stream, name, (flt,), ours=True, **kw)  # type: ignore[arg-type]


def actions(steps: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {f"{s.stream}/{s.name}": s.action for s in steps}


def test_every_publisher_durable_is_made_by_the_operator_and_none_exists_yet() -> None:
    assert {d.name for _, d in WANTED} == {"acme_videos_acme1", "acme_encode_acme1"}
    assert all(d.made_by_operator for _, d in reader_durables([PUBLISHER_IDENTITY, ACME]))
    assert actions(plan(WANTED, [])) == {"VIDEOS/acme_videos_acme1": "create", "ENCODE/acme_encode_acme1": "create"}


def test_a_durable_as_wanted_is_kept_and_one_made_by_its_team_is_adopted() -> None:
    existing = [ours("VIDEOS", VIDEOS.name, "*.*.acme1"), Existing("ENCODE", ENCODE.name, ("encode.*.acme1",))]
    assert actions(plan(WANTED, existing)) == {"VIDEOS/acme_videos_acme1": "keep",
                                                 "ENCODE/acme_encode_acme1": "adopt"}


def test_the_push_attack_left_behind_is_made_pull_again() -> None:
    """A team's durable made push onto farm.result (before teams lost the right) is recreated pull."""
    existing = [Existing("VIDEOS", VIDEOS.name, ("*.*.acme1",), deliver_subject="farm.result"),
                ours("ENCODE", ENCODE.name, "encode.*.acme1")]
    steps = plan(WANTED, existing)
    assert actions(steps) == {"VIDEOS/acme_videos_acme1": "recreate", "ENCODE/acme_encode_acme1": "keep"}
    assert "farm.result" in next(s for s in steps if s.name == VIDEOS.name).line()


@pytest.mark.parametrize("existing", [
    ours("VIDEOS", "acme_videos_acme1", "*.*.*"),  # another filter
    ours("VIDEOS", "acme_videos_acme1", "*.*.acme1", ack_explicit=False),
])
def test_a_durable_unlike_its_declaration_is_recreated(existing: Existing) -> None:
    assert actions(plan(WANTED, [existing]))["VIDEOS/acme_videos_acme1"] == "recreate"


def test_a_lost_accounts_durables_and_push_consumers_are_removed_and_others_left_alone() -> None:
    existing = [
        ours("VIDEOS", "acme_videos_acme2", "*.*.acme2"),  # the account acme lost
        ours("ENCODE", "gone_encode_x1", "encode.*.x1"),  # a team removed altogether
        Existing("VIDEOS", "leftover", ("*.*.acme1",), deliver_subject="farm.result"),  # a push consumer
        Existing("VIDEOS", "encode_uploads", ("upload.completed", "upload.completed.*")),  # a service's
        Existing("REPLAY", "x", (), deliver_subject="somewhere"),  # not a public stream: not ours to judge
    ]
    got = actions(plan(WANTED, existing))
    assert {k: v for k, v in got.items() if v == "delete"} == {
        "VIDEOS/acme_videos_acme2": "delete", "ENCODE/gone_encode_x1": "delete", "VIDEOS/leftover": "delete"}
    assert "VIDEOS/encode_uploads" not in got and "REPLAY/x" not in got


def test_with_the_teams_unknown_no_teams_durable_is_removed_but_a_push_consumer_still_is() -> None:
    """No teams file (a run from another directory): the operator's durables it does not list may be teams', so
    they are kept where a file listing no teams would have them removed; the stack's publisher's are still made."""
    existing = [
        ours("ENCODE", "Acme_encode_x2", "encode.*.x2"),  # a team's, which no file lists now
        ours("VIDEOS", VIDEOS.name, "*.*.acme1"),
        Existing("VIDEOS", "leftover", ("*.*.acme1",), deliver_subject="farm.result"),  # a push consumer
    ]
    publisher = reader_durables([PUBLISHER_IDENTITY])
    unknown = plan(publisher, existing, teams_known=False)
    assert actions(unknown) == {**{f"{d.stream}/{d.name}": "create" for _, d in publisher},
                                "ENCODE/Acme_encode_x2": "keep", f"VIDEOS/{VIDEOS.name}": "keep",
                                "VIDEOS/leftover": "delete"}
    assert "teams are unknown" in next(s for s in unknown if s.name == "Acme_encode_x2").line()
    listed_none = actions(plan(publisher, existing))  # the file is there and lists no team: they are removed
    assert listed_none["ENCODE/Acme_encode_x2"] == listed_none[f"VIDEOS/{VIDEOS.name}"] == "delete"
    with pytest.raises(ValueError, match="teams are unknown"):
        plan(publisher, existing, {"Acme_encode_x2": None}, teams_known=False)


def test_a_team_starts_over_when_the_operator_says_so() -> None:
    since = datetime(2025, 1, 2, tzinfo=UTC)
    existing = [ours("VIDEOS", VIDEOS.name, "*.*.acme1"), ours("ENCODE", ENCODE.name, "encode.*.acme1")]
    steps = {s.name: s for s in plan(WANTED, existing, {VIDEOS.name: since, ENCODE.name: None})}
    assert steps[VIDEOS.name].action == "recreate" and steps[VIDEOS.name].start == since
    assert steps[ENCODE.name].action == "recreate" and steps[ENCODE.name].start is None
    assert "2025-01-02" in steps[VIDEOS.name].line() and "stream's start" in steps[ENCODE.name].line()
    with pytest.raises(ValueError, match="encode_uploads"):
        plan(WANTED, existing, {"encode_uploads": None})  # a service's durable is not the operator's to restart


def test_the_configuration_is_pull_explicit_ack_one_filter_marked() -> None:
    settings = CommonSettings()
    config = consumer_config("acme", VIDEOS, settings)
    body = config.as_dict()
    assert "deliver_subject" not in body and body["ack_policy"] == "explicit" and body["deliver_policy"] == "all"
    assert body["filter_subject"] == "*.*.acme1" and body["name"] == body["durable_name"] == VIDEOS.name
    assert body["metadata"] == {MADE_BY: MADE_BY_OPERATOR, READER: "acme"}
    since = datetime(2025, 1, 2, tzinfo=UTC)
    later = consumer_config("acme", VIDEOS, settings, since).as_dict()
    assert later["deliver_policy"] == "by_start_time" and str(later["opt_start_time"]).startswith("2025-01-02T00:00")


def test_the_readers_are_the_stacks_publisher_and_the_teams_file(tmp_path: Path) -> None:
    missing, known = reader_identities(tmp_path / "missing.json")
    assert [i.name for i in missing] == ["publisher"] and not known  # no file: the teams are unknown, not none
    teams = tmp_path / "teams.json"
    teams.write_text(json.dumps({"teams": {}}))
    assert reader_identities(teams) == ([PUBLISHER_IDENTITY], True)  # a file listing no team: none
    teams.write_text(json.dumps({"teams": {"acme": {"accounts": ["acme1"], "first_party": False},
                                           "old": {"accounts": [], "first_party": False}}}))
    found, known = reader_identities(teams)
    readers = {i.name: i for i in found}
    assert known
    assert set(readers) == {"publisher", "acme", "old"} and readers["old"].durables == ()
    assert {d.name for d in readers["acme"].durables} == {"acme_videos_acme1", "acme_encode_acme1"}
