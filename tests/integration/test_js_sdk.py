"""The JavaScript upload SDK (sdk/js) against the real stack: node's built-in test runner, api and auth as processes
beside the session's PostgreSQL, S3 and NATS.

Issue 14 (tests): the SDK's logic (part planning, retries, backoff, resume from a listing, 429 handling) and its
uploads end to end (a 12 MiB Blob in 3 parts; a resume after an interruption sends only the missing parts).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.settings import CommonSettings
from tests.integration.apihelpers import UNLIMITED, Services, run_services

pytestmark = pytest.mark.asyncio(loop_scope="session")

SDK = Path(__file__).resolve().parents[2] / "sdk" / "js"
NODE_TIMEOUT = 240  # seconds, within pytest's own timeout
E2E = (
    "a 12 MiB Blob completes in 3 parts with progress",
    "interrupted after one part, started again with the same video and token: only the missing parts",
    "with a storage hook a second upload() of the same file resumes the stored video",
    "abort ends the upload at the api",
    "getVideo: the token's own video only, and a problem's code on refusal",
    "a signed video: playback before encoding, and playbackUrls reach the api's player routes",
)


@pytest.fixture(scope="module")
def services(stack_env: dict[str, str], prepared: CommonSettings, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Services]:
    with run_services(stack_env, tmp_path_factory.mktemp("logs"), **UNLIMITED) as s:
        yield s


async def test_the_js_sdk_passes_nodes_tests_against_the_stack(services: Services, prepared: CommonSettings) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (>= 20) is not on PATH: the JavaScript SDK's tests need it (apt-get install nodejs)")
    nc = await connect(prepared, name="test")
    try:
        _, app = await create_account_with_app(nc, "js-sdk", allowed_origins=("http://localhost:3000",))
    finally:
        await nc.close()
    env = {**services.env, "WEIR_SDK_API_URL": services.api_url, "WEIR_SDK_PUBLISHABLE_KEY": app.publishable_key,
           "NODE_OPTIONS": ""}
    proc = await asyncio.create_subprocess_exec(
        node, "--test", "--test-reporter=spec", "test/", cwd=SDK, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), NODE_TIMEOUT)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        pytest.fail(f"node --test did not finish in {NODE_TIMEOUT}s:\n{out.decode(errors='replace')}")
    output = out.decode(errors="replace")
    assert proc.returncode == 0, f"node --test sdk/js/test/ exited {proc.returncode}:\n{output}"
    for name in E2E:  # a skipped suite still exits 0: each end-to-end test must have passed by name
        assert f"✔ {name}" in output, f"{name!r} did not pass (skipped?):\n{output}"
