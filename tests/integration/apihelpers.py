"""The api and auth as processes on the session's servers, and what HTTP tests do with them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.api import domain
from shared.authcheck import AppCreated
from shared.authclient import create_account_with_app
from shared.bus import connect
from shared.devstack.ports import free_port
from shared.settings import CommonSettings
from tests.integration.authhelpers import LONG_WINDOW, STORE_BUDGET_MS, TEST_SECRETS
from tests.integration.privatenats import PrivateNats, wait_until_up
from tests.stored import events_waited
from tests.waiting import wait_service_ready
from weir.up import prepare

# requests reach the api from 127.0.0.1, which the test stack trusts as a proxy: each test names its own client
# address in X-Forwarded-For, so per-address limits do not leak between tests
TRUSTED = "127.0.0.1/32"




@dataclass
class Services:
    api_url: str
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]]
    urls: dict[str, str]  # each service's own HTTP address (/metrics, /readyz)


@contextmanager
def run_services(stack_env: dict[str, str], logs: Path, names: tuple[str, ...] = ("auth", "api"),
                 extra_env: dict[str, str] | None = None, **settings: str) -> Iterator[Services]:
    """`python -m services.<name>` for each, as `weir up` runs them; stopped with SIGTERM at the end.
    `settings` are WEIR_* settings by their names; `extra_env` other variables, as a deployment might set them."""
    env = {
        **os.environ, **stack_env, **(extra_env or {}),
        **{f"WEIR_{k.upper()}": v for k, v in TEST_SECRETS.items()},
        "WEIR_TRUSTED_PROXIES": TRUSTED, "PYTHONUNBUFFERED": "1",
        "WEIR_COUNTER_STORE_TIMEOUT_MS": str(STORE_BUDGET_MS),
        # a test that counts to a limit through HTTP never straddles a window boundary by accident (a minute's
        # window ending between its requests starts the count again): windows of an hour unless a test sets its own
        "WEIR_LIMIT_WINDOW_SECONDS": str(LONG_WINDOW),
        **{f"WEIR_{k.upper()}": v for k, v in settings.items()},
    }
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for name in names:
            port = free_port()
            log = logs / f"{name}-{port}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", f"services.{name}"],
                                        env={**env, "WEIR_HTTP_PORT": str(port)}, stdout=out, stderr=out)
            procs.append(proc)
            wait_service_ready(f"http://127.0.0.1:{port}", proc, log)
            urls[name] = f"http://127.0.0.1:{port}"
        yield Services(urls.get("api", ""), env, procs, urls)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# every request of a browser's or node's tests comes from 127.0.0.1: limits high enough that only the client's own
# behaviour counts
UNLIMITED = {f"limit_{rule}_per_minute": "100000" for rule in ("address", "upload_token", "key", "owner")}


@contextmanager
def private_bus(stack_env: dict[str, str], data_dir: Path) -> Iterator[dict[str, str]]:
    """A nats-server of the test's own, its streams applied, beside the session's PostgreSQL and S3: the limit
    counters and the auth queue group then hold only what the test's own services do."""
    server = PrivateNats(data_dir)
    server.start()
    try:
        env = {**stack_env, "WEIR_NATS_URL": server.url}
        settings = CommonSettings(**{k[len("WEIR_"):].lower(): v for k, v in env.items()})  # type: ignore[arg-type]
        # on a thread of its own: asyncio.run must not touch the event loop of the test session
        with ThreadPoolExecutor(1) as one:
            one.submit(asyncio.run, wait_until_up(server.url, 30)).result()  # the server takes a moment to listen
            one.submit(asyncio.run, prepare(settings)).result()
        yield env
    finally:
        server.stop()


class Client:
    def __init__(self, services: Services, secret_key: str, address: str) -> None:
        self.http = httpx.AsyncClient(base_url=services.api_url, timeout=60)
        self.key = secret_key
        self.address = address

    def headers(self, credential: str | None = "secret", **extra: str) -> dict[str, str]:
        h = {"X-Forwarded-For": self.address, **extra}
        token = self.key if credential == "secret" else credential
        if token:
            h["Authorization"] = f"Bearer {token}"
        return h

    async def call(self, method: str, path: str, credential: str | None = "secret", **kw: Any) -> httpx.Response:
        headers = {**self.headers(credential), **kw.pop("headers", {})}
        return await self.http.request(method, path, headers=headers, **kw)


async def upload(c: Client, video_id: str, data: bytes, *, prefix: str = "/v1", credential: str | None = "secret",
                 part_size: int = domain.PART_SIZE_MIN) -> httpx.Response:
    r = await c.call("POST", f"{prefix}/videos/{video_id}/upload", credential, json={"content_type": "video/mp4"})
    assert r.status_code == 200, r.text
    chunks = [data[i:i + part_size] for i in range(0, len(data), part_size)] or [b""]
    r = await c.call("POST", f"{prefix}/videos/{video_id}/upload/parts", credential,
                     json={"part_numbers": list(range(1, len(chunks) + 1))})
    assert r.status_code == 200, r.text
    parts = []
    async with httpx.AsyncClient(timeout=60) as s3:
        for part, chunk in zip(r.json()["parts"], chunks, strict=True):
            put = await s3.put(part["url"], content=chunk)  # straight to storage
            assert put.status_code == 200, put.text
            parts.append({"part_number": part["part_number"], "etag": put.headers["etag"]})
    return await c.call("POST", f"{prefix}/videos/{video_id}/upload/complete", credential, json={"parts": parts})


async def new_app(settings: CommonSettings, name: str) -> AppCreated:
    """An account with one app, made through auth as the operator makes them."""
    nc = await connect(settings, name="test")
    try:
        _, created = await create_account_with_app(nc, name)
    finally:
        await nc.close()
    return created


async def create(c: Client, **body: Any) -> dict[str, Any]:
    r = await c.call("POST", "/v1/videos", json={"name": "clip", **body})
    assert r.status_code == 201, r.text
    return dict(r.json())


async def completed_events(
    prepared: CommonSettings, video_id: str, expect: int, wait: float = 5.0
) -> list[dict[str, Any]]:
    """Every upload.completed for the video in the stream (waits up to `wait` s for `expect` of them)."""
    return await events_waited(prepared, "VIDEOS", "upload.completed.*", lambda e: e.data["video_id"] == video_id,
                               expect=expect, wait=wait)


EXPOSED = {"retry-after", "ratelimit", "ratelimit-policy"}  # what a player must read of a refusal (not safelisted)


def readable_from_any_page(r: httpx.Response) -> bool:
    """Whether a page on any origin reads the answer and its Retry-After and rate-limit headers, as a browser
    decides: exactly one Access-Control-Allow-Origin, `*` (two, even both `*`, are refused), those headers exposed."""
    if r.headers.get_list("access-control-allow-origin") != ["*"]:
        return False
    exposed = {h.strip().lower() for h in r.headers.get("access-control-expose-headers", "").split(",")}
    return EXPOSED <= exposed
