"""The S3 server stopped, then started again, under a `weir up --external` stack.

While it is down: every upload route, by secret key and by upload token, answers 503 with Retry-After within the
settings' bound, and a sweep run retires nothing, leaving each candidate `storage_uncertain` (SPEC 5). After, with the
same pids: a video with a part stored before the outage completes from it, one with none uploads from scratch, both
become ready with exactly one upload.completed and one encode inbox row, and a sweep retires the never-uploaded
candidates and leaves the open upload.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.sweep.settings import SweepSettings
from tests.faults.stackhelpers import (
    WeirUp,
    all_ready,
    data_root,
    database,
    farm_env,
    own_servers,
    request_bound_s,
    same_processes,
    settled_delivery,
    stack_env,
    stream_events,
    sweep_run,
    weir_up,
)
from tests.integration.test_encode_helpers import make_source
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NEVER_UPLOADED = 3  # sweep candidates with no upload at all
RECOVERY_WITHIN_S = 60.0  # from storage's start to the api's first successful initiate
PREFIXES = ("/v1", "/sdk/v1")  # secret key, upload token


class Api:
    """One client of the public API that records what it was answered."""

    def __init__(self, up: WeirUp, bound: float) -> None:
        self.http = httpx.AsyncClient(base_url=up.api_url, timeout=bound)
        self.secret = up.secret_key
        self.answers: list[tuple[str, int, float, httpx.Headers, dict[str, Any]]] = []

    async def call(self, method: str, path: str, credential: str | None = None, **kw: Any) -> httpx.Response:
        t0 = time.monotonic()
        r = await self.http.request(method, path, headers={"Authorization": f"Bearer {credential or self.secret}"},
                                    **kw)
        try:
            body = r.json()
        except ValueError:
            body = {}
        self.answers.append((f"{method} {path}", r.status_code, time.monotonic() - t0, r.headers,
                             body if isinstance(body, dict) else {}))
        return r

    async def create(self, name: str) -> dict[str, Any]:
        r = await self.call("POST", "/v1/videos", json={"name": name})
        assert r.status_code == 201, r.text
        return dict(r.json())


async def test_a_storage_outage_answers_503_retires_nothing_and_recovers_without_a_restart(tmp_path: Path) -> None:
    t_test = time.monotonic()
    source = make_source(tmp_path / "clip.mp4", height=240, seconds=1, fps=10).read_bytes()
    with data_root() as root, own_servers(root) as (dev, servers):
        env = stack_env(**farm_env(), **servers)
        bound = request_bound_s(env)
        with weir_up(root, env, "--external", "--media", "1", keep_log=tmp_path / "weir-up.log") as up:
            pids = up.pids()
            api = Api(up, bound)
            async with api.http, httpx.AsyncClient(timeout=bound) as storage:
                # --- before: the sweep's candidates, and two uploads to carry through the outage
                never = [(await api.create(f"never uploaded {i}"))["id"] for i in range(NEVER_UPLOADED)]
                opened = (await api.create("open upload, old"))["id"]
                assert (await api.call("POST", f"/v1/videos/{opened}/upload",
                                       json={"content_type": "video/mp4"})).status_code == 200
                candidates = [*never, opened]
                await _age(up, candidates)
                u, v = await api.create("U: one part stored before the outage"), await api.create("V: nothing yet")
                tokens = {u["id"]: u["upload_token"], v["id"]: v["upload_token"]}
                assert (await api.call("POST", f"/v1/videos/{u['id']}/upload",
                                       json={"content_type": "video/mp4"})).status_code == 200
                part = await api.call("POST", f"/v1/videos/{u['id']}/upload/parts", json={"part_numbers": [1]})
                put = await storage.put(part.json()["parts"][0]["url"], content=source)
                assert put.status_code == 200, put.text
                etag = put.headers["etag"]

                # --- storage down
                t0 = time.monotonic()
                await asyncio.to_thread(dev.stop_server, "s3")
                stopped_s = time.monotonic() - t0
                during = len(api.answers)
                for prefix in PREFIXES:
                    def cred(video: str, prefix: str = prefix) -> str | None:
                        return tokens[video] if prefix == "/sdk/v1" else None

                    await api.call("POST", f"{prefix}/videos/{v['id']}/upload", cred(v["id"]),
                                   json={"content_type": "video/mp4"})
                    await api.call("POST", f"{prefix}/videos/{u['id']}/upload/parts", cred(u["id"]),
                                   json={"part_numbers": [1]})
                    await api.call("GET", f"{prefix}/videos/{u['id']}/upload/parts", cred(u["id"]))
                    await api.call("POST", f"{prefix}/videos/{u['id']}/upload/complete", cred(u["id"]),
                                   json={"parts": [{"part_number": 1, "etag": etag}]})
                outage_answers = api.answers[during:]
                readiness_down = await all_ready(up)
                swept = await sweep_run(up, force=True, timeout=60)
                assert swept.report is not None
                async with database(up) as conn:
                    retired_during = await conn.fetchval(
                        "SELECT count(*) FROM videos.videos WHERE status = 'retired'")

                # --- storage back
                t1 = time.monotonic()
                await asyncio.to_thread(dev.start_server, "s3")
                started_s = time.monotonic() - t1
                t2 = time.monotonic()
                initiated = await wait_for(lambda: _initiate(api, v["id"]), RECOVERY_WITHIN_S,
                                           "an initiate to succeed once storage is back")
                recovered_s = time.monotonic() - t2
                assert initiated.status_code == 200, initiated.text
                stored = await api.call("GET", f"/v1/videos/{u['id']}/upload/parts")
                assert stored.status_code == 200, stored.text
                assert [(p["part_number"], p["etag"]) for p in stored.json()["parts"]] == [(1, etag)], stored.text
                done_u = await api.call("POST", f"/sdk/v1/videos/{u['id']}/upload/complete", tokens[u["id"]],
                                        json={"parts": [{"part_number": 1, "etag": etag}]})
                assert done_u.status_code == 200, done_u.text
                part_v = await api.call("POST", f"/sdk/v1/videos/{v['id']}/upload/parts", tokens[v["id"]],
                                        json={"part_numbers": [1]})
                assert part_v.status_code == 200, part_v.text
                put_v = await storage.put(part_v.json()["parts"][0]["url"], content=source)
                assert put_v.status_code == 200, put_v.text
                done_v = await api.call("POST", f"/v1/videos/{v['id']}/upload/complete",
                                        json={"parts": [{"part_number": 1, "etag": put_v.headers["etag"]}]})
                assert done_v.status_code == 200, done_v.text
                swept_after = await sweep_run(up, force=True, timeout=60)
                assert swept_after.report is not None

            print(f"\ns3 stopped in {stopped_s:.1f} s, started in {started_s:.1f} s; the api initiated again "
                  f"{recovered_s:.1f} s after its start; readiness while down {readiness_down}")
            print(f"request bound {bound:.2f} s; while down:")
            for what, status, seconds, headers, body in outage_answers:
                print(f"  {what:<70} {status} {body.get('code')} Retry-After={headers.get('retry-after')} "
                      f"{seconds:.2f} s")
            print(f"sweep during the outage: {_brief(swept.report)}")
            print(f"sweep after: {_brief(swept_after.report)}")

            # while down: 503 unavailable with Retry-After, at once
            wrong = [(what, status, body.get("code"), headers.get("retry-after"))
                     for what, status, _, headers, body in outage_answers
                     if status != 503 or body.get("code") != "unavailable" or not headers.get("retry-after")]
            assert not wrong, f"upload routes while storage is down: {wrong}"
            assert max(seconds for _, _, seconds, _, _ in api.answers) < bound
            assert not readiness_down["api"], "the api says it is ready without its storage"
            # the sweep during the outage: nothing retired, every candidate left as uncertain
            report = swept.report
            assert report["outcome"] == "completed", report
            assert report["examined"] == len(candidates), report
            assert report["retired"] == {} and retired_during == 0, report
            assert report["left_alone"] == {"storage_uncertain": len(candidates)}, report
            assert "storage could not say for certain" in report["note"], report
            # after: the same processes; the sweep decides again, definitely now
            same_processes(up, pids)
            after = swept_after.report
            assert after["retired"] == {"never_uploaded": NEVER_UPLOADED}, after
            assert after["left_alone"] == {"upload_open": 1}, after
            found, took = await settled_delivery(up, 45)  # every outbox sent: the sweep's video.retired too
            print(f"settled in {took:.1f} s: {found.summary()}")
            found.check()
            assert found.recorded == {u["id"], v["id"]}
            retired = Counter(str(e.data["video_id"]) for _, e in await stream_events(up, "VIDEOS", "video.retired.*"))
            assert retired == Counter({vid: 1 for vid in never}), retired
            print(f"test took {time.monotonic() - t_test:.1f} s")


async def _age(up: WeirUp, ids: list[str]) -> None:
    """Older than the sweep's minimum age (as its own tests make candidates)."""
    older = SweepSettings().sweep_min_age_seconds + 3600
    async with database(up) as conn:
        await conn.execute("UPDATE videos.videos SET created_at = created_at - make_interval(secs => $2)"
                           " WHERE id = ANY($1::uuid[])", ids, float(older))


async def _initiate(api: Api, video: str) -> httpx.Response | None:
    r = await api.call("POST", f"/v1/videos/{video}/upload", json={"content_type": "video/mp4"})
    return r if r.status_code != 503 else None


def _brief(report: dict[str, Any] | None) -> str:
    assert report is not None
    return (f"{report['outcome']}, examined {report['examined']}, retired {report['retired']}, left alone "
            f"{report['left_alone']}, errors {report['errors']}, {report['duration_seconds']:.2f} s; "
            f"note {report['note']!r}")
