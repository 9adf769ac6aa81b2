"""Two releases side by side on the session's servers (SPEC 11, issue 28 part 4); no tests here.

`release_tree`: the previous release's commit checked out with `git worktree add --detach` into a temp dir (removed,
and the worktree list pruned, at the end). `MixedStack`: one process per service, each from the current checkout or
from that tree (same venv, `PYTHONPATH` and cwd the tree), swapped one or two at a time. `run_flow`: the whole flow a
developer goes through, each answer recorded as what a client relies on (status, problem code and rule, the body's
shape with the values of closed sets), so that a mixed stack's answers can be compared with a single-version stack's;
and every JSON answer of either release's api kept (`MixedStack.api_answers`), to be held to this code's OpenAPI
document.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS

from services.sweep.trigger import RUN_SUBJECT, RunAccepted, RunRequest, RunUpdate
from shared.authclient import create_account_with_app
from shared.devstack.addresses import StackAddresses
from shared.devstack.ports import free_port
from shared.identities import OPERATOR
from shared.natsconn import inbox_prefix
from shared.release import Release
from tests.integration.authhelpers import fresh_address
from tests.openapianswers import HttpAnswer
from tests.waiting import stop_process, wait_for, wait_service_ready

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("auth", "api", "encode", "media", "sweep")
CURRENT = "current"
# the headers a limited route carries (SPEC 3); a refusal adds Retry-After
RATE_HEADERS = ("ratelimit", "ratelimit-policy", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
# members whose value, not only their type, is part of an answer's shape: closed sets a client branches on
VALUE_KEYS = frozenset({"status", "code", "rule", "outcome", "accepted", "kind", "state"})
# members a client must read as "X or null" whatever the releases, by the label their shape gets: a video's playback
# URLs are null until the farm has made what they point at (SPEC 14), and a farm of 1.0.0 (encode or media) makes none;
# `busy_at` is the farm's last busy answer (SPEC 6), set only when it happened to be full while the video was offered
OR_NULL_KEYS = {"hls": "url or null", "thumbnail": "url or null", "storyboard": "url or null", "embed": "url or null",
                "mp4": "url or null",
                "busy_at": "time or null"}


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=120, check=False)


@contextlib.contextmanager
def release_tree(release: Release) -> Iterator[Path]:
    """The release's commit in a temp worktree (detached), removed afterwards. Fails, saying why, when this clone has
    no history for it (a shallow clone: CI clones with full history)."""
    if _git("cat-file", "-e", f"{release.commit}^{{commit}}").returncode != 0:
        pytest.fail(f"release {release.version} (commit {release.commit}, releases.toml) is not in this clone's "
                    f"history: the mixed-version test runs that commit's code. Clone with full history "
                    f"(`git fetch --unshallow`, or actions/checkout with fetch-depth: 0).", pytrace=False)
    with tempfile.TemporaryDirectory(prefix=f"weir-release-{release.version}-") as tmp:
        tree = Path(tmp) / "tree"
        added = _git("worktree", "add", "--detach", str(tree), release.commit)
        assert added.returncode == 0, f"git worktree add failed: {added.stderr}"
        try:
            yield tree
        finally:
            _git("worktree", "remove", "--force", str(tree))
            _git("worktree", "prune")


# ------------------------------------------------------------------------------------------------ processes


@dataclass
class Running:
    service: str
    version: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class MixedStack:
    """One process per service, each at a version named in `trees` (CURRENT: this checkout)."""

    env: dict[str, str]
    logs: Path
    trees: dict[str, Path]
    stop_timeout_s: float
    running: dict[str, Running] = field(default_factory=dict)
    # every JSON answer of an api (`Api.call`), each naming the api's release: held to the current OpenAPI document
    api_answers: list[HttpAnswer] = field(default_factory=list)

    def versions(self) -> dict[str, str]:
        return {s: r.version for s, r in self.running.items()}

    @property
    def api_url(self) -> str:
        return self.running["api"].url

    def _popen(self, service: str, version: str) -> Running:
        tree = self.trees[version]
        port = free_port()
        env = {**self.env, "PYTHONPATH": str(tree), "WEIR_HTTP_PORT": str(port),
               "WEIR_MEDIA_WORKER_ID": f"media-{version}-{port}"}
        if not (tree / "web" / "node_modules").is_dir():  # a fresh checkout: the docs pages' assets of this one
            env["WEIR_WEB_ASSETS_DIR"] = str(ROOT / "web" / "node_modules")
        log = self.logs / f"{service}-{version}-{port}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", f"services.{service}"], cwd=tree, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return Running(service, version, popen, port, log)

    def become(self, versions: dict[str, str]) -> None:
        """Run each service at the version named: the processes of another version are told to stop (SIGTERM: they
        drain) and their replacements started at the same time; returns once every replacement is ready and every
        process told to stop has exited, so that no answer comes from a version not named."""
        changing = [s for s, v in versions.items() if s not in self.running or self.running[s].version != v]
        leaving = [self.running.pop(s) for s in changing if s in self.running]
        for r in leaving:
            r.popen.terminate()
        try:
            started = [self._popen(s, versions[s]) for s in changing]
            for r in started:
                self.running[r.service] = r
            for r in started:
                wait_service_ready(r.url, r.popen, r.log)
        finally:
            self._ended(leaving)

    def stop_all(self) -> None:
        """SIGTERM every process, by pid; SIGKILL past the bound."""
        leaving = list(self.running.values())
        self.running.clear()
        for r in leaving:
            r.popen.terminate()
        self._ended(leaving)

    def _ended(self, told: list[Running]) -> None:
        """Wait for processes told to stop (SIGKILL past the bound), then end what they left in their process group
        (a media worker's ffmpeg)."""
        for r in told:
            stop_process(r.popen, self.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.popen.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ answers


def shape(value: Any, key: str = "", depth: int = 99) -> Any:
    """What a client relies on in a JSON value: objects by their members, lists by their items' shapes, scalars by
    type, and the value itself for members that name a state or an outcome (VALUE_KEYS); below `depth` levels of
    objects, an object or a list is only that."""
    if key in VALUE_KEYS and isinstance(value, str | bool):
        return f"={value}"
    if key in OR_NULL_KEYS and (value is None or isinstance(value, str)):
        return OR_NULL_KEYS[key]
    if isinstance(value, dict):
        return {k: shape(v, k, depth - 1) for k, v in sorted(value.items())} if depth > 0 else "object"
    if isinstance(value, list):
        if depth <= 0:
            return "array"
        shapes: list[Any] = []
        for item in value:
            s = shape(item, "", depth)
            if s not in shapes:
                shapes.append(s)
        return shapes
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


@dataclass(frozen=True)
class Answer:
    """One answer as a client sees it."""

    status: int
    body: Any  # shape() of the JSON body, or of none ("" for an empty body, "not json" otherwise)
    headers: tuple[str, ...] = ()  # which of the rate-limit headers it carries, when the step asks

    @staticmethod
    def of(r: httpx.Response, *, headers: tuple[str, ...] = (), depth: int = 99) -> Answer:
        body: Any
        if not r.content:
            body = ""
        else:
            try:
                body = shape(r.json(), depth=depth)
            except ValueError:
                body = "not json"
        return Answer(r.status_code, body, tuple(h for h in headers if h in r.headers))

    def __str__(self) -> str:
        return f"{self.status} {self.body}" + (f" headers {list(self.headers)}" if self.headers else "")


@dataclass
class FlowSettings:
    address_limit: int  # WEIR_LIMIT_ADDRESS_PER_MINUTE of this stack
    sweep_min_age_s: float  # WEIR_SWEEP_MIN_AGE_SECONDS
    ready_timeout_s: float
    revocation_s: float  # how long the old key may still be accepted after a rotation (SPEC 2: 1 s, plus slack)


@dataclass
class Flow:
    """Every answer of one run of the flow, by step, in order."""

    answers: dict[str, Answer] = field(default_factory=dict)
    account_id: str = ""
    video_id: str = ""  # the video uploaded and encoded

    def record(self, step: str, r: httpx.Response, *, headers: tuple[str, ...] = (), depth: int = 99
               ) -> httpx.Response:
        self.answers[step] = Answer.of(r, headers=headers, depth=depth)
        return r


class Api:
    """HTTP to whichever api process runs now, as one client address; its JSON answers kept on the stack."""

    def __init__(self, stack: MixedStack, address: str) -> None:
        self.stack = stack
        self.address = address
        self.http = httpx.AsyncClient(timeout=30)

    async def call(self, method: str, path: str, credential: str | None, **kw: Any) -> httpx.Response:
        headers = {"X-Forwarded-For": self.address}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        api = self.stack.running["api"]
        r = await self.http.request(method, f"{api.url}{path}", headers=headers, **kw)
        if (answer := HttpAnswer.of(r, source=f"api {api.version}")) is not None:
            self.stack.api_answers.append(answer)
        return r


async def operator_connection(addresses: StackAddresses, harness: NATS) -> NATS:
    """A connection as `operator` (the `weir` CLI's identity): the sweep sends a run's progress and report only to
    the operator's inbox. Against servers with no identities (external ones), the harness connection itself."""
    seed = addresses.nats_identities.get(OPERATOR)
    if not seed:
        return harness
    nc: NATS = await nats.connect(addresses.nats_url.split(","), nkeys_seed=seed, inbox_prefix=inbox_prefix(OPERATOR),
                                  name="weir-mixed-versions-test")
    return nc


async def run_flow(stack: MixedStack, nc: NATS, operator: NATS, clip: bytes, fs: FlowSettings) -> Flow:
    """Create, a key rotation (the create's upload token refused, one re-minted by the new key), the upload through
    the SDK routes with it, encode to ready, the listing, a limit reached, a sweep run that retires a never-uploaded
    video, delete. Every HTTP answer is recorded; a step that got no usable answer ends the flow (recorded so)."""
    flow = Flow()
    account, app = await create_account_with_app(nc, f"mixed-{uuid.uuid4().hex[:8]}")
    flow.account_id = account.account_id
    api = Api(stack, fresh_address())
    try:
        await _flow(api, operator, clip, fs, flow, account.account_token, app.id, app.secret_key)
    finally:
        await api.http.aclose()
    return flow


async def _flow(api: Api, operator: NATS, clip: bytes, fs: FlowSettings, flow: Flow, account_token: str, app_id: str,
                old_key: str) -> None:
    r = flow.record("create", await api.call("POST", "/v1/videos", old_key, json={"name": "clip"}))
    if r.status_code != 201:
        return
    video = r.json()
    vid, first_token = video["id"], video["upload_token"]
    flow.video_id = vid

    # a key rotation: the old pair stops working within the revocation bound, with it the upload token it minted
    r = flow.record("rotate keys", await api.call("POST", f"/v1/account/apps/{app_id}/keys/rotate", account_token))
    if r.status_code != 200:
        return
    new_key, new_publishable_key = r.json()["secret_key"], r.json()["publishable_key"]

    async def refused(credential: str, method: str, path: str, **kw: Any) -> httpx.Response:
        async def answer() -> httpx.Response:
            return await api.call(method, path, credential, **kw)
        return await wait_for(answer, fs.revocation_s, f"{method} {path} with a revoked credential refused",
                              until=lambda resp: resp.status_code != 200 and resp.status_code < 500)

    with contextlib.suppress(AssertionError):  # a timeout is recorded as the last answer seen
        flow.record("old key after rotation", await refused(old_key, "GET", f"/v1/videos/{vid}"))
    if "old key after rotation" not in flow.answers:
        flow.record("old key after rotation", await api.call("GET", f"/v1/videos/{vid}", old_key))
    upload_path = f"/sdk/v1/videos/{vid}/upload"
    flow.record("old upload token after rotation",
                await api.call("POST", upload_path, first_token, json={"content_type": "video/mp4"}))
    r = flow.record("mint upload token", await api.call("POST", f"/v1/videos/{vid}/upload-token", new_key))
    if r.status_code != 200:
        return
    token = r.json()["upload_token"]

    # the upload through the SDK routes, with the re-minted token: initiate, part URLs, PUT to storage, complete
    r = flow.record("initiate", await api.call("POST", upload_path, token, json={"content_type": "video/mp4"}))
    if r.status_code != 200:
        return
    part_size = int(r.json()["part_size_min"])
    chunks = [clip[i:i + part_size] for i in range(0, len(clip), part_size)]
    r = flow.record("part urls", await api.call("POST", f"{upload_path}/parts", token,
                                                json={"part_numbers": list(range(1, len(chunks) + 1))}))
    if r.status_code != 200:
        return
    parts = []
    for part, chunk in zip(r.json()["parts"], chunks, strict=True):
        put = flow.record("put part", await api.http.put(part["url"], content=chunk))  # straight to storage
        parts.append({"part_number": part["part_number"], "etag": put.headers.get("etag", "")})
    flow.record("stored parts", await api.call("GET", f"{upload_path}/parts", token))
    r = flow.record("complete", await api.call("POST", f"{upload_path}/complete", token, json={"parts": parts}))
    if r.status_code != 200:
        return
    # the calls not recorded in `flow` (what they show depends on the moment) are there for their JSON answers, which
    # the test holds to the current OpenAPI document: completing again returns the first result (SPEC 4)
    await api.call("POST", f"/v1/videos/{vid}/upload/complete", new_key, json={"parts": parts})

    # encode to ready, read as a developer reads it: while it is processing (the api asks encode, each of either
    # release; what processing shows then changes by the moment, so only the members of the video are compared),
    # and once it is ready
    async def settled() -> httpx.Response:
        return await api.call("GET", f"/v1/videos/{vid}", new_key)

    def moving(resp: httpx.Response) -> bool:
        return resp.status_code != 200 or resp.json().get("status") not in ("created", "uploading", "uploaded")

    with contextlib.suppress(AssertionError):
        await wait_for(settled, fs.ready_timeout_s, "the video processing", until=moving, interval=0.1)
    flow.record("video while processing", await settled(), depth=1)

    # the listing: an api of 1.0.0 shows its projection of encode's events there, which follows a moment later
    async def listing() -> httpx.Response:
        return await api.call("GET", "/v1/videos?limit=5", new_key)

    def listed_moving(resp: httpx.Response) -> bool:
        return resp.status_code != 200 or any(
            v.get("status") not in ("created", "uploading", "uploaded") for v in resp.json().get("videos", []))

    with contextlib.suppress(AssertionError):
        await wait_for(listing, fs.ready_timeout_s, "the listing to show it processing", until=listed_moving,
                       interval=0.1)
    flow.record("listing while processing", await listing(), depth=2)

    def final(resp: httpx.Response) -> bool:
        return resp.status_code != 200 or resp.json().get("status") in ("ready", "failed")

    with contextlib.suppress(AssertionError):
        await wait_for(settled, fs.ready_timeout_s, "the video ready", until=final, interval=0.2)
    r = flow.record("video when encoded", await settled())
    await api.call("GET", f"/sdk/v1/videos/{vid}", token)  # the video as the page that uploaded it reads it
    renditions = r.json().get("renditions", []) if r.status_code == 200 else []
    if renditions:
        flow.record("rendition", await api.http.get(renditions[0]["url"]))
    flow.record("listing", await api.call("GET", "/v1/videos?limit=5", new_key))
    # a video created from a page (a publishable key counts against the address: one of its own), after the listings;
    # never uploaded, the sweep run below retires it too
    page = Api(api.stack, fresh_address())
    try:
        await page.call("POST", "/sdk/v1/videos", new_publishable_key, json={"name": "from a page"})
    finally:
        await page.http.aclose()

    # a limit reached: requests without a credential count against the address's limit, one address of its own
    limited = Api(api.stack, fresh_address())
    try:
        answers = [await limited.call("GET", "/v1/videos", None) for _ in range(fs.address_limit + 1)]
    finally:
        await limited.http.aclose()
    flow.record("within the address limit", answers[0], headers=RATE_HEADERS)
    flow.record("past the address limit", answers[-1], headers=(*RATE_HEADERS, "retry-after"))
    flow.answers["admitted before the limit"] = Answer(
        sum(1 for a in answers if a.status_code != 429), f"of {len(answers)} (limit {fs.address_limit})")

    # a sweep run retires a video that never got a file (it is old enough by the stack's sweep settings)
    r = flow.record("create never uploaded", await api.call("POST", "/v1/videos", new_key, json={"name": "stale"}))
    if r.status_code == 201:
        stale = r.json()
        old_enough = datetime.fromisoformat(stale["created_at"]).timestamp() + fs.sweep_min_age_s + 0.2
        await wait_for(lambda: time.time() > old_enough, fs.sweep_min_age_s + 5, "the video to be a candidate")
        flow.answers["sweep run"] = await sweep_run(operator, timeout=30)
        flow.record("never uploaded after the sweep", await api.call("GET", f"/v1/videos/{stale['id']}", new_key))

    flow.record("delete", await api.call("DELETE", f"/v1/videos/{vid}", new_key))
    flow.record("deleted video", await api.call("GET", f"/v1/videos/{vid}", new_key))


async def sweep_run(nc: NATS, *, timeout: float) -> Answer:
    """What `weir sweep run --force` does (sweep.run, then the report on the updates inbox), as an Answer: 200 with
    the report's shape, or 503 with why there was none. --force: the session's earlier tests leave videos behind,
    and the valve must not hold this run back."""
    reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_update(msg: Any) -> None:
        update = RunUpdate.model_validate_json(msg.data)
        if update.kind == "report" and update.report is not None:
            reports.put_nowait(update.report)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_update)
    try:
        request = RunRequest(force=True, updates=inbox).model_dump_json().encode()
        deadline = time.monotonic() + timeout

        async def accepted() -> RunAccepted:
            try:
                reply = await nc.request(RUN_SUBJECT, request, timeout=5)
            except Exception as exc:  # no responders, a timeout: asked again until the deadline
                return RunAccepted(accepted=False, detail=repr(exc))
            return RunAccepted.model_validate_json(reply.data)

        def is_accepted(a: RunAccepted) -> bool:
            return a.accepted

        try:
            await wait_for(accepted, timeout, "the sweep to accept a run", until=is_accepted, interval=0.2)
            report = await asyncio.wait_for(reports.get(), max(1.0, deadline - time.monotonic()))
        except (AssertionError, TimeoutError) as exc:
            return Answer(503, f"no report: {exc}")
        # the report's tallies are maps by reason, whose keys depend on what the session left behind: their presence
        return Answer(200, {k: "map" if isinstance(v, dict) else shape(v, k) for k, v in sorted(report.items())})
    finally:
        await sub.unsubscribe()


def differences(flow: Flow, references: dict[str, Flow]) -> list[str]:
    """Each step whose answer is none of the references' answers to that step (a single-version stack of either
    release), the steps the flow did not get to, and any step no reference had."""
    found = []
    steps = list(dict.fromkeys(s for ref in references.values() for s in ref.answers))
    for step in steps:
        got = flow.answers.get(step)
        expected = {name: ref.answers.get(step) for name, ref in references.items()}
        if got is not None and got not in expected.values():
            shown = "; ".join(f"{name}: {a}" for name, a in expected.items())
            found.append(f"{step}: got {got}; a single-version stack gives {shown}")
    if missing := [step for step in steps if step not in flow.answers]:
        found.append(f"steps the flow did not get to: {', '.join(missing)}")
    found += [f"{step}: no single-version stack gives this step ({flow.answers[step]})"
              for step in flow.answers if step not in steps]
    return found


def env_of(settings: dict[str, Any]) -> dict[str, str]:
    return {f"WEIR_{k.upper()}": str(v) for k, v in settings.items()}


def base_env(stack_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **stack_env, "PYTHONUNBUFFERED": "1", "WEIR_LOG_LEVEL": "INFO"}
