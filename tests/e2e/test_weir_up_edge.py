"""`weir up --edge` as a user meets it: HAProxy on the public port lets a burst wait for a slot to the api and
refuses a standing queue at once (503 `overloaded`, Retry-After, the api's problem body, CORS where a page reads it),
keeps the internal token's reserve, never limits the operations routes, hands auth the client's address, says
`unavailable` while no api instance is up, and `weir status` counts its refusals (weir/edge.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shared.overload.domain import retry_after_seconds
from tests.faults.stackhelpers import WeirUp, everything_ready, weir_up
from tests.waiting import wait_for_sync
from weir.edge import LOCAL_SOURCE, EdgeLoad, EdgeSettings, edge_load

pytestmark = pytest.mark.slow
MAXCONN = 2  # one public slot to the api, one for the internal token (shed_reserve_share rounds up to one)
QUEUE_MAX = 1  # one request may wait for the slot
QUEUE_MS = 20_000  # and may wait long: what is refused while it waits was refused at once


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weir-edge-") as tmp:
        yield Path(tmp)


def _edge_load(up: WeirUp) -> EdgeLoad:
    return edge_load(httpx.get(f"{up.info['edge']['admin_url']}/metrics", timeout=5).text)


def _hold_the_public_slot(up: WeirUp) -> socket.socket:
    """A create whose body never finishes: the api holds its slot while it waits for the rest."""
    host, port = up.info["api_url"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {up.secret_key}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    wait_for_sync(lambda: (_edge_load(up).in_flight or 0) >= 1, 10, "the held create in flight at the edge")
    return sock


def _assert_overloaded(r: httpx.Response, settings: EdgeSettings) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "overloaded"
    assert r.headers["retry-after"] == str(retry_after_seconds(settings.shed_window_ms / 1000))


def test_a_burst_waits_at_the_edge_a_standing_queue_is_refused_at_once_the_reserve_probes_and_cors_kept(
        root: Path) -> None:
    """One public slot held, one request waiting for it (QUEUE_MAX): every further public request is refused at
    once while that one still waits; internal-token requests have their own slot and the operations routes none;
    when the slot frees, the waiting request is answered."""
    env = {**os.environ, "WEIR_EDGE_MAXCONN": str(MAXCONN), "WEIR_EDGE_QUEUE_MAX": str(QUEUE_MAX),
           "WEIR_EDGE_QUEUE_MS": str(QUEUE_MS)}
    settings = EdgeSettings(edge_maxconn=MAXCONN, edge_queue_max=QUEUE_MAX, edge_queue_ms=QUEUE_MS)
    with weir_up(root, env, "--edge") as up:
        wait_for_sync(lambda: asyncio.run(everything_ready(up)), 60, "every service and the edge ready")
        public, api = up.info["api_url"], up.url("api")
        assert public == up.info["edge"]["url"] and public != api
        auth = {"Authorization": f"Bearer {up.secret_key}"}
        internal = {"X-Weir-Internal-Token": up.info["internal_token"]}
        with httpx.Client(base_url=public, timeout=30, trust_env=False) as http, \
                httpx.Client(base_url=public, timeout=30, trust_env=False) as other, \
                ThreadPoolExecutor(1) as pool:
            assert http.get("/v1/videos", headers=auth).status_code == 200
            refused_before = _edge_load(up).refused
            sock = _hold_the_public_slot(up)
            try:
                waiter = pool.submit(other.get, "/v1/videos", headers=auth)  # a burst: it waits for the slot
                wait_for_sync(lambda: (_edge_load(up).waiting or 0) >= QUEUE_MAX, 10, "a request waiting")
                _assert_overloaded(http.get("/v1/videos", headers=auth), settings)
                # a page reads the refusal on the SDK's and the player's routes
                for path in ("/sdk/v1/videos/vid_x/upload", "/v1/playback/vid_x/master.m3u8"):
                    r = http.get(path, headers={"Origin": "https://app.example"})
                    _assert_overloaded(r, settings)
                    assert r.headers["access-control-allow-origin"] == "*"
                    assert "Retry-After" in r.headers["access-control-expose-headers"]
                # the operations routes are never limited, and the internal token has its own slot
                assert http.get("/healthz").status_code == 200
                assert http.get("/readyz").status_code == 200
                r = http.get("/internal/v1/videos/vid_nothere", headers=internal)
                assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
                # a wrong token is a public request like any other
                _assert_overloaded(http.get("/internal/v1/videos/vid_nothere",
                                            headers={"X-Weir-Internal-Token": "x" * 64}), settings)
                assert not waiter.done(), "the refusals came at once, not after the queue's timeout"
                refused = _edge_load(up).refused
                assert refused - refused_before == 4
            finally:
                sock.close()
            assert waiter.result(timeout=QUEUE_MS / 1000 + 10).status_code == 200  # its slot came in time
            wait_for_sync(lambda: (_edge_load(up).in_flight or 0) == 0, 10, "nothing in flight")

        status = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--json", "--stack",
                                 str(up.data_dir / "stack.json")], capture_output=True, text=True, timeout=60)
        shown = json.loads(status.stdout)
        edge = shown["shedding"]["edge"]
        assert edge["shed"] == {"all": refused}, edge
        assert edge["limit"] == MAXCONN
        assert shown["services"]["edge"]["ready"] is True


def test_the_edge_hands_auth_the_clients_address_and_says_unavailable_while_no_api_is_up(root: Path) -> None:
    """The api sees the edge's own address (LOCAL_SOURCE), whose X-Forwarded-For auth reads: rejected credentials sent
    through the edge, claiming another address, block the address the edge saw, so that the same client calling the
    api directly is refused too (by the edge's address, or by the claimed one, it would not be). Then the api is
    killed: the edge says `unavailable` until weir up has started it again."""
    failures = 3
    env = {**os.environ, "WEIR_LIMIT_AUTH_FAILURE_PER_MINUTE": str(failures)}
    with weir_up(root, env, "--edge") as up:
        wait_for_sync(lambda: asyncio.run(everything_ready(up)), 60, "every service and the edge ready")
        wrong = {"Authorization": "Bearer sk_live_" + "x" * 40}
        with httpx.Client(base_url=up.info["api_url"], timeout=10, trust_env=False) as http:
            for _ in range(failures):
                r = http.get("/v1/videos", headers={**wrong, "X-Forwarded-For": "203.0.113.9"})
                assert r.status_code == 401, r.text
            r = httpx.get(f"{up.url('api')}/v1/videos", headers=wrong, timeout=10, trust_env=False)
            assert r.status_code == 429 and r.json()["code"] == "rate_limited", r.text
            assert LOCAL_SOURCE != "127.0.0.1"  # else the direct call would share the edge's address

            os.kill(up.pids()["api"], signal.SIGKILL)

            def unavailable() -> httpx.Response | None:  # on a route a page reads: with CORS headers
                try:
                    r = http.get("/sdk/v1/videos/vid_x/upload", headers={"Origin": "https://app.example"})
                except httpx.TransportError:  # the kept-alive connection closed with the api's (a client sends again)
                    return None
                return r if r.status_code == 503 and r.json().get("code") == "unavailable" else None

            down = wait_for_sync(unavailable, 10, "the edge saying unavailable", interval=0.05)
            assert down is not None and down.headers["content-type"] == "application/problem+json"
            assert down.headers["retry-after"] and down.headers["access-control-allow-origin"] == "*"
            admin = up.info["edge"]["admin_url"]
            assert httpx.get(f"{admin}/readyz", timeout=5).status_code == 503
            # weir up starts the api again; the edge finds it
            wait_for_sync(lambda: httpx.get(f"{admin}/readyz", timeout=5).status_code == 200, 30, "the api back")
            assert http.get("/healthz").status_code == 200
