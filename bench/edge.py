"""HAProxy in front of a stack's api, for bench.overload's POLICY-edge: refusing before the api's Python event loop.

A fixed number of requests at once goes through to the api (the api's reserve share of them kept for requests with
Weir's internal token, on a server entry of their own); one that finds no slot waits a short queue, then gets the
api's own 503 `overloaded` problem, with Retry-After, from HAProxy (Debian's package: apt-get install haproxy).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from shared.devstack.ports import free_port
from shared.overload.domain import retry_after_seconds
from shared.overload.edge import INTERNAL_HEADER, OVERLOADED_DETAIL
from shared.problems import problem_body
from shared.settings import ShedSettings

MAXCONN = 48  # requests at once to the api, and how long one waits for a slot (bench/RESULTS.md, 2026-12-07)
QUEUE_MS = 1


def edge_config(api: str, port: int, token: str, refusal: Path, maxconn: int, queue_ms: int) -> str:
    """HAProxy in front of the api (POLICY-edge): at most `maxconn` requests at once to it, a share of them kept
    for internal-token requests (the api's shed_reserve_share, on a server entry of their own); one
    that finds no slot waits `queue_ms`, then gets the api's own 503 `overloaded` problem from HAProxy."""
    reserve = max(1, round(maxconn * ShedSettings().shed_reserve_share))
    return f"""global
    maxconn 8000
    nbthread 1
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout queue {queue_ms}ms
    timeout http-keep-alive 60s
    option http-keep-alive
    http-reuse always
    errorfile 503 {refusal}
frontend edge
    bind 127.0.0.1:{port}
    default_backend api
backend api
    use-server internal if {{ req.hdr({INTERNAL_HEADER.decode()}) -m str {token} }}
    server public {api} maxconn {maxconn - reserve}
    server internal {api} maxconn {reserve} backup
"""


def start_edge(info: dict[str, Any], workdir: Path, maxconn: int, queue_ms: int
               ) -> tuple[subprocess.Popen[bytes], str]:
    """`edge_config`'s HAProxy, started in front of the stack's api; its URL."""
    body = json.dumps(problem_body(503, "overloaded", OVERLOADED_DETAIL))
    refusal = workdir / "edge-503.http"
    refusal.write_text(f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n"
                       f"retry-after: {retry_after_seconds(ShedSettings().shed_window_ms / 1000)}\r\n"
                       f"content-length: {len(body)}\r\n\r\n{body}")
    port = free_port()
    config = workdir / "haproxy.cfg"
    config.write_text(edge_config(info["api_url"].split("://", 1)[1], port, info["internal_token"], refusal, maxconn,
                                  queue_ms))
    log = (workdir / "haproxy.log").open("wb")
    proc = subprocess.Popen(["haproxy", "-f", str(config), "-db"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                print(f"  edge: haproxy on {port}, maxconn {maxconn}, queue {queue_ms} ms", file=sys.stderr,
                      flush=True)
                return proc, url
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"haproxy did not start: {(workdir / 'haproxy.log').read_text()[-2000:]}")
