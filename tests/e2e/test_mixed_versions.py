"""The previous release's services beside the current ones, on the real servers (SPEC 11, issue 28 part 4).

The previous release (releases.toml) is checked out from its commit into a temp worktree; its services run from there
with the same venv. For each of auth, api, encode, media and sweep: that service at the previous release with the rest
current, and that service current with the rest at the previous release (ten configurations). One process per service,
replaced only where two configurations differ: a full current set, then each service in turn at the old release; a full
old set, then each in turn at the current one. The schema is the current one (the session's `prepared` migrated
it with this code; the old services start on it: expand-then-contract). api and sweep share the videos table: the
configurations with one of them old and the other current run a sweep that retires a video the other one wrote.

Every configuration runs the whole flow (run_flow: create, a key rotation with an upload token re-minted, the upload
through the SDK routes, encode to ready, the listing, a limit reached, a sweep run, delete) and every answer must be
what a single-version stack gives: the same flow on the all-current set and on the all-old set are the two references,
and each step's answer (status, problem code, the body's shape, the values of its states) must equal one of theirs.
Either, not only the current one: a change between the releases that a single-version stack of either shows (the
listing of an all-current stack shows encode's own state of a video in processing, a 1.0.0 stack the api's
projection) is not a mixed-version fault. And every JSON answer of either release's api must validate against this
code's OpenAPI document: what verifies the findings contracts/accepted.toml accepts against the previous release.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from shared import acceptances, contractsnap
from shared.bus import connect
from shared.contracts import DLQ_STREAM
from shared.contractsnap import public_openapi
from shared.devstack.addresses import StackAddresses
from shared.release import VERSION, previous_release, read_releases
from shared.settings import CommonSettings
from tests.e2e.mixedhelpers import (
    CURRENT,
    ROOT,
    SERVICES,
    Flow,
    FlowSettings,
    MixedStack,
    base_env,
    differences,
    env_of,
    operator_connection,
    release_tree,
    run_flow,
)
from tests.integration.apihelpers import TRUSTED
from tests.integration.authhelpers import LONG_WINDOW, STORE_BUDGET_MS, TEST_SECRETS
from tests.integration.test_encode_helpers import (
    clean_encode_state,
    fast_farm,
    make_source,
    prepare_encode_consumers,
)
from tests.openapianswers import HttpAnswer, OpenApiAnswers
from tests.stored import stored_messages

# twelve flows and some 27 service starts: about a minute beside another test file on 2 cores, and up to three on a
# machine busy with more than that, so more than the suite's 300 s per test
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow, pytest.mark.timeout(600)]

ADDRESS_LIMIT = 4  # requests without a credential from one address: the flow reaches it in a few requests
SWEEP_MIN_AGE_S = 1  # a never-uploaded video is a candidate a second after it was made
SETTINGS: dict[str, Any] = {
    **TEST_SECRETS,
    # one developer slot beside the kept one; the source read at real time, so that "processing" lasts a while
    **fast_farm(media_slots=2, shutdown_grace_seconds=3, media_read_rate=1),
    "trusted_proxies": TRUSTED,
    "counter_store_timeout_ms": STORE_BUDGET_MS,
    "limit_window_seconds": LONG_WINDOW,
    "limit_address_per_minute": ADDRESS_LIMIT,
    "sweep_min_age_seconds": SWEEP_MIN_AGE_S,
    "sweep_daily_enabled": "false",
}
FLOW = FlowSettings(address_limit=ADDRESS_LIMIT, sweep_min_age_s=SWEEP_MIN_AGE_S, ready_timeout_s=60,
                    revocation_s=10)


@pytest.fixture(scope="module")
def old_tree() -> Iterator[tuple[str, Path]]:
    release = previous_release()
    assert release is not None, "releases.toml lists no release to run beside this code"
    assert release.version != VERSION
    with release_tree(release) as tree:
        yield release.version, tree


@pytest.fixture(scope="module")
async def mixed(old_tree: tuple[str, Path], stack_env: dict[str, str], prepared: CommonSettings,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MixedStack]:
    await prepare_encode_consumers(prepared)
    await clean_encode_state(prepared)
    version, tree = old_tree
    stack = MixedStack(env={**base_env(stack_env), **env_of(SETTINGS)}, logs=tmp_path_factory.mktemp("mixed-logs"),
                       trees={CURRENT: ROOT, version: tree}, stop_timeout_s=SETTINGS["shutdown_grace_seconds"] + 10)
    try:
        yield stack
    finally:
        stack.stop_all()
        await clean_encode_state(prepared)


async def on_account_subjects(nc: NATS, flow: Flow) -> dict[str, int]:
    """How many of the flow's video's events of each type are on its account's subject."""
    js = nc.jetstream()
    found: dict[str, int] = {}
    for stream, event_type in (("VIDEOS", "upload.completed"), ("ENCODE", "encode.completed"),
                               ("ENCODE", "encode.progress")):
        stored = await stored_messages(js, stream, f"{event_type}.{flow.account_id}")
        found[event_type] = sum(1 for m in stored if json.loads(m.data).get("subject") == flow.video_id)
    return found


def describe(versions: dict[str, str]) -> str:
    """auth 1.0.0, api current, ...: a configuration's name."""
    return ", ".join(f"{s} {versions[s]}" for s in SERVICES)


async def test_each_service_at_either_release_beside_the_other_answers_as_a_single_version_stack(
    mixed: MixedStack, old_tree: tuple[str, Path], prepared: CommonSettings, stack: StackAddresses, tmp_path: Path
) -> None:
    old, _ = old_tree
    clip = make_source(tmp_path / "clip.mp4", height=240, seconds=2, fps=10).read_bytes()
    nc = await connect(prepared, name="mixed-versions-test")
    operator = await operator_connection(stack, nc)
    flows: dict[str, Flow] = {}
    moved: dict[str, dict[str, int]] = {}  # each configuration's video: its events on its account's subjects
    timings: list[str] = []

    async def parked() -> int:
        return int((await nc.jetstream().stream_info(DLQ_STREAM)).state.messages)

    try:
        parked_before = await parked()
        async def flow_of(name: str) -> Flow:
            t0 = time.monotonic()
            flows[name] = flow = await run_flow(mixed, nc, operator, clip, FLOW)
            timings.append(f"{name}: {time.monotonic() - t0:.1f} s")
            print(timings[-1], flush=True)
            return flow

        # one process per service; between two configurations only the services that differ are replaced
        order: list[tuple[str, dict[str, str]]] = []
        for base, other in ((CURRENT, old), (old, CURRENT)):
            order.append((f"all {base}", dict.fromkeys(SERVICES, base)))  # a reference: one release alone
            order += [(describe(v), v) for v in ({**dict.fromkeys(SERVICES, base), s: other} for s in SERVICES)]
        for name, versions in order:
            mixed.become(versions)
            assert mixed.versions() == versions
            flow = await flow_of(name)
            moved[name] = await on_account_subjects(nc, flow)
        # no message between the releases was unreadable to its consumer (parked after its delivery attempts)
        parked_after = await parked()
    finally:
        if operator is not nc:
            await operator.close()
        await nc.close()
    print("\n".join(timings))

    # the references are what the flow promises (SPEC 2-5), so that agreeing with them means something
    reference_current, reference_old = flows[f"all {CURRENT}"], flows[f"all {old}"]
    for name, ref in ((CURRENT, reference_current), (old, reference_old)):
        got = {step: a.status for step, a in ref.answers.items()}
        assert got["create"] == 201 and got["rotate keys"] == 200, (name, got)
        assert got["old key after rotation"] == 401 and got["old upload token after rotation"] == 401, (name, got)
        assert got["complete"] == 200 and got["rendition"] == 200, (name, got)
        processing = ref.answers["video while processing"]
        assert processing.body["status"] == "=processing", (name, processing)
        assert ref.answers["video when encoded"].body["status"] == "=ready", (name, ref.answers["video when encoded"])
        limited = ref.answers["past the address limit"]
        assert limited.status == 429 and limited.body["rule"] == "=address", (name, limited)
        assert "retry-after" in limited.headers and "ratelimit" in limited.headers, (name, limited)
        assert got["admitted before the limit"] == ADDRESS_LIMIT, (name, got)
        assert got["sweep run"] == 200, (name, ref.answers["sweep run"])
        assert ref.answers["never uploaded after the sweep"].body["status"] == "=retired", (name, ref.answers)
        assert got["delete"] == 204 and got["deleted video"] == 404, (name, got)

    assert parked_after == parked_before, f"{parked_after - parked_before} messages parked on the DLQ"
    references = {f"all {CURRENT}": reference_current, f"all {old}": reference_old}
    configurations = [name for name in flows if name not in references]
    assert len(configurations) == 2 * len(SERVICES)
    # api and sweep share the videos table: a video one release's api wrote, the other's sweep retired
    split = [name for name, versions in order if versions["api"] != versions["sweep"]]
    assert len(split) == 4, split
    for name in split:
        retired = flows[name].answers.get("never uploaded after the sweep")
        assert retired is not None and retired.body["status"] == "=retired", (name, retired)
    # the subject move (SPEC 11, 12): a current publisher puts the video's events on its account's subject (and a copy
    # on the bare type, which is all the flow of a 1.0.0 consumer had to go on, and it reached ready); 1.0.0's do not
    for name, versions in order:
        current = {s: versions[s] == CURRENT for s in SERVICES}
        expected = {"upload.completed": current["api"], "encode.completed": current["encode"]}
        assert {t: moved[name][t] > 0 for t in expected} == expected, (name, moved[name])
        if not (current["media"] and current["encode"]):  # media learns the account from a current encode's offer
            assert moved[name]["encode.progress"] == 0, (name, moved[name])
    faults = {name: found for name in configurations if (found := differences(flows[name], references))}
    assert not faults, "answers no single-version stack gives:\n" + "\n".join(
        f"[{name}]\n  " + "\n  ".join(found) for name, found in faults.items())
    held_to_the_document(mixed.api_answers, old)


def held_to_the_document(answers: list[HttpAnswer], old: str) -> None:
    """Every JSON answer of either release's api (2xx and problem bodies) validates against this code's OpenAPI
    document, and among them are answers of the older api to each route whose typing contracts/accepted.toml accepts
    against it: the acceptance (its document said "any object", its api wrote what this document types) is verified
    by real answers."""
    document = OpenApiAnswers(public_openapi())
    assert {a.source for a in answers} == {f"api {CURRENT}", f"api {old}"}, {a.source for a in answers}
    drift = document.unexplained(answers)
    assert not drift, f"{len(drift)} answers the OpenAPI document does not describe as served:\n" + "\n".join(drift)
    answered = {(a.source, a.method, document.template(a.method, a.path), str(a.status)) for a in answers}
    listed = [r.version for r in read_releases()]
    for entry in acceptances.read(contractsnap.CONTRACTS_DIR / acceptances.FILE_NAME, releases=listed):
        if entry.against != old:
            continue
        _, method, template = entry.contract.split(" ", 2)
        statuses = {p.split(" ", 2)[1] for p in entry.problems}  # "response 200 (application/json) ..."
        for status in statuses:
            assert (f"api {old}", method, template, status) in answered, (
                f"{entry}: the flow got no {status} answer from the {old} api to verify it with")
