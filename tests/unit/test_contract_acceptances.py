"""Findings accepted on purpose (contracts/accepted.toml, shared/acceptances.py): an accepted problem fails nothing and
is shown with its reason; anything not listed still fails; an entry that matches no finding any more fails."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from typer.testing import CliRunner

from shared import acceptances, compat, contractsnap, release
from shared.acceptances import Acceptance, AcceptanceError
from shared.compat import ReleaseCheck, check_release
from weir.cli import app

OLD = "1.0.0"
FORWARD_API = compat.DIRECTIONS[compat.API][1]  # new client -> old server
BACKWARD_API = compat.DIRECTIONS[compat.API][0]


class Thing(BaseModel):
    id: str
    name: str


def document(answer: Any, *, required_query: bool = False) -> dict[str, Any]:
    """A small API: `GET /v1/things/{thing_id}` answering `answer`, `POST /v1/things`."""
    api = FastAPI()

    async def read(thing_id: str) -> Any:
        raise NotImplementedError

    async def create() -> Any:
        raise NotImplementedError

    async def create_flavoured(flavour: str) -> Any:
        raise NotImplementedError

    read.__annotations__ = {"thing_id": str}
    create_flavoured.__annotations__ = {"flavour": str}
    api.add_api_route("/v1/things/{thing_id}", read, methods=["GET"], response_model=answer)
    api.add_api_route("/v1/things", create_flavoured if required_query else create, methods=["POST"],
                      response_model=dict[str, Any])
    built: dict[str, Any] = api.openapi()
    return {"openapi": {"api": built}}


@pytest.fixture(scope="module")
def current() -> dict[str, Any]:
    return contractsnap.collect()


def typed_check(**new: Any) -> ReleaseCheck:
    """The release documented the answer as any object; this code types it (as issue 32 did the video)."""
    return check_release(document(Thing, **new), (OLD, document(dict[str, Any])))


def entry(check: ReleaseCheck, contract: str, direction: str, *, reason: str = "it wrote these members") -> Acceptance:
    """An entry accepting every problem the check finds in that contract and direction."""
    change = next(c for c in check.changes if f"{c.kind} {c.name}" == contract)
    verdict = change.backward if change.backward.direction == direction else change.forward
    assert verdict.problems, (contract, direction)
    return Acceptance(OLD, contract, direction, verdict.problems, reason)


def test_typing_an_answer_the_release_documented_as_any_object_is_a_finding() -> None:
    check = typed_check()
    (change,) = [c for c in check.changes if c.breaking]
    assert (change.name, change.mode) == ("GET /v1/things/{thing_id}", compat.BACKWARD)
    assert change.forward.problems == (
        "response 200 (application/json) `id`: the reader requires it, the writer does not write it",
        "response 200 (application/json) `name`: the reader requires it, the writer does not write it")


def test_an_accepted_finding_fails_nothing_and_keeps_its_reason() -> None:
    check = typed_check()
    accepted = acceptances.apply(check, [entry(check, "api GET /v1/things/{thing_id}", FORWARD_API)])
    assert accepted.breaking == [] and accepted.stale == ()
    (change,) = [c for c in accepted.changes if c.accepted]
    (was,) = [c for c in check.changes if c.name == change.name]
    assert change.mode == compat.FULL and change.mode_as_written == compat.BACKWARD == was.mode
    assert change.forward.accepted == was.forward.problems and change.forward.problems == ()
    assert change.forward.reason == "it wrote these members"


def test_a_problem_the_entry_does_not_list_still_fails() -> None:
    check = typed_check()
    whole = entry(check, "api GET /v1/things/{thing_id}", FORWARD_API)
    partly = Acceptance(OLD, whole.contract, whole.direction, whole.problems[:1], whole.reason)
    result = acceptances.apply(check, [partly])
    assert result.breaking == [f"api GET /v1/things/{{thing_id}} (BACKWARD): {FORWARD_API}: {whole.problems[1]}"]


def test_an_unrelated_break_still_fails() -> None:
    check = typed_check(required_query=True)  # and POST /v1/things now requires a query parameter
    result = acceptances.apply(check, [entry(check, "api GET /v1/things/{thing_id}", FORWARD_API)])
    assert len(result.breaking) == 1 and result.breaking[0].startswith(f"api POST /v1/things (FORWARD): {BACKWARD_API}")
    assert "`flavour`" in result.breaking[0]


def test_an_entry_that_matches_no_finding_is_stale_and_fails() -> None:
    check = typed_check()
    good = entry(check, "api GET /v1/things/{thing_id}", FORWARD_API)
    other_route = Acceptance(OLD, "api POST /v1/things", FORWARD_API, ("response 200 (application/json) x",), "why")
    result = acceptances.apply(check, [good, other_route])
    assert result.stale == (f"api POST /v1/things ({FORWARD_API}) against {OLD}: matches no finding",)
    assert result.breaking == [f"stale acceptance: {result.stale[0]}"]
    # the break fixed (the answer documented as before): the entry excuses nothing any more
    fixed = check_release(document(dict[str, Any]), (OLD, document(dict[str, Any])))
    assert acceptances.apply(fixed, [good]).stale == (f"{good}: matches no finding",)


def test_a_problem_an_entry_lists_that_is_no_longer_found_is_stale() -> None:
    check = typed_check()
    whole = entry(check, "api GET /v1/things/{thing_id}", FORWARD_API)
    more = Acceptance(OLD, whole.contract, whole.direction, (*whole.problems, "response 200 (application/json) "
                      "`size`: the reader requires it, the writer does not write it"), whole.reason)
    result = acceptances.apply(check, [more])
    assert [c for c in result.changes if c.breaking] == []
    assert result.stale == (f"{more}: no longer found: {more.problems[-1]}",)


def test_entries_against_a_release_not_compared_are_left_alone() -> None:
    check = typed_check()
    earlier = Acceptance("0.9.0", "api GET /v1/things/{thing_id}", FORWARD_API, ("x",), "why")
    assert acceptances.apply(check, [earlier]) == check
    # an older release is compared for its events only (replays): an api entry against it is not in scope
    with_older = check_release(document(Thing), (OLD, document(dict[str, Any])), (("0.9.0", document(Thing)),))
    assert acceptances.apply(with_older, [earlier]).stale == ()


def test_an_event_finding_against_an_older_release_may_be_accepted(current: dict[str, Any]) -> None:
    label = release.previous_release()
    assert label is not None
    old = contractsnap.load(contractsnap.snapshot_dir(label.version))
    older = copy.deepcopy(old)  # a release whose encode.completed had no `worker` yet: replays bring those back
    schema = older["events"]["encode.completed"]["schema"]
    del schema["properties"]["worker"]
    schema["required"].remove("worker")
    check = check_release(current, (label.version, old), (("0.9.0", older),))
    [(_, change)] = check.older
    accepted = Acceptance("0.9.0", "event encode.completed", change.backward.direction, change.backward.problems,
                          "no 0.9.0 event is kept in any stream")
    result = acceptances.apply(check, [accepted])
    assert not [line for line in result.breaking if "0.9.0" in line]
    assert result.older[0][1].backward.accepted == change.backward.problems


# --- the file -------------------------------------------------------------------------------------------------

GOOD = """
[[accepted]]
against = "1.0.0"
contract = "api GET /v1/videos/{video_id}"
direction = "new client -> old server"
reason = "1.0.0 wrote these members"
problems = ["response 200 (application/json) `id`: the reader requires it, the writer does not write it"]
"""


def test_an_entry_is_read_with_every_member() -> None:
    (read,) = acceptances.parse(GOOD, releases=["1.0.0"])
    assert read == Acceptance("1.0.0", "api GET /v1/videos/{video_id}", FORWARD_API, (
        "response 200 (application/json) `id`: the reader requires it, the writer does not write it",),
        "1.0.0 wrote these members")


@pytest.mark.parametrize(("edit", "said"), [
    (('contract = "api GET /v1/videos/{video_id}"', 'contract = "api GET /v1/videos/*"'), "no wildcard"),
    (('contract = "api GET /v1/videos/{video_id}"', 'contract = "event *"'), "no wildcard"),
    (('contract = "api GET /v1/videos/{video_id}"', 'contract = "GET /v1/videos/{video_id}"'), "<kind> <name>"),
    (('direction = "new client -> old server"', 'direction = "new publisher -> old consumer"'), "`direction`"),
    (('against = "1.0.0"', 'against = "1.0"'), "MAJOR.MINOR.PATCH"),
    (('against = "1.0.0"', 'against = "0.9.0"'), "not a release listed"),
    (('reason = "1.0.0 wrote these members"', 'reason = " "'), "`reason`"),
    (('reason = "1.0.0 wrote these members"\n', ""), "missing reason"),
    (("problems = [", 'whatever = 1\nproblems = ['), "unknown whatever"),
    (('problems = ["response', 'problems = []\nx = ["response'), "unknown x"),
    (("problems = [", 'problems = ["a", "a", '), "listed twice"),
])
def test_an_entry_must_be_complete_and_specific(edit: tuple[str, str], said: str) -> None:
    with pytest.raises(AcceptanceError, match=said.replace("*", r"\*")):
        acceptances.parse(GOOD.replace(*edit), releases=["1.0.0"])


def test_one_entry_per_contract_and_direction() -> None:
    with pytest.raises(AcceptanceError, match="a second entry"):
        acceptances.parse(GOOD + GOOD, releases=["1.0.0"])
    with pytest.raises(AcceptanceError, match="non-empty list"):
        acceptances.parse(GOOD.replace('problems = ["', 'problems = []\n#'), releases=["1.0.0"])


def test_the_entry_the_check_prints_for_a_break_accepts_it_when_given_a_reason() -> None:
    check = typed_check()
    (change,) = [c for c in check.changes if c.breaking]
    text = acceptances.entry_text(OLD, change, change.forward)
    (read,) = acceptances.parse(text, releases=[OLD])
    assert acceptances.apply(check, [read]).breaking == []


def test_the_committed_entries_accept_only_answers_the_mixed_version_test_validates() -> None:
    """Each accepted finding is an answer of an older api that this document types (a new client reading that
    server): tests/e2e/test_mixed_versions.py validates every answer of both releases' apis against this document, so
    the acceptance is verified by real answers, not only asserted."""
    listed = [r.version for r in release.read_releases()]
    found = acceptances.read(contractsnap.CONTRACTS_DIR / acceptances.FILE_NAME, releases=listed)
    assert found, "contracts/accepted.toml lists nothing: remove the file, or this test"
    for a in found:
        assert a.contract.startswith(f"{compat.API} ") and a.direction == FORWARD_API, a
        assert all(p.startswith("response 2") for p in a.problems), a
        assert "test_mixed_versions" in a.reason, a


# --- `weir contracts check` ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("wide_console")
def test_weir_contracts_check_shows_the_accepted_findings_with_their_reason() -> None:
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 0, out.output
    assert "accepted on purpose" in out.output and "accepted (" in out.output and "test_mixed_versions" in out.output


@pytest.fixture()
def contracts_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of contracts/ that the check reads instead."""
    copied = tmp_path / "contracts"
    shutil.copytree(contractsnap.CONTRACTS_DIR, copied)
    monkeypatch.setattr(contractsnap, "CONTRACTS_DIR", copied)
    return copied


@pytest.mark.usefixtures("wide_console")
def test_weir_contracts_check_fails_on_a_stale_entry(contracts_copy: Path) -> None:
    path = contracts_copy / acceptances.FILE_NAME
    path.write_text(path.read_text(encoding="utf-8") + GOOD.replace("/v1/videos/{video_id}", "/v1/account/keys"),
                    encoding="utf-8")
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 1
    assert "stale acceptance" in out.output and "api GET /v1/account/keys" in out.output


@pytest.mark.usefixtures("wide_console")
def test_weir_contracts_check_fails_on_an_invalid_file(contracts_copy: Path) -> None:
    (contracts_copy / acceptances.FILE_NAME).write_text(GOOD.replace("{video_id}", "*"), encoding="utf-8")
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 1 and "no wildcard" in out.output


def test_without_the_file_the_typed_video_answers_fail_the_check(contracts_copy: Path) -> None:
    (contracts_copy / acceptances.FILE_NAME).unlink()
    out = CliRunner().invoke(app, ["contracts", "check"])
    assert out.exit_code == 1
    assert "api GET /v1/videos/{video_id}" in out.output and "[[accepted]]" in out.output
