"""The edge's config (weir/edge.py): derived from the api's routes and settings, accepted by the HAProxy that
`make edge` installs, its own answers problem bodies. What it does with requests: tests/e2e/test_weir_up_edge.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from services.api.guard import CORS_EXPOSE
from tests.unit.apiapp import api_table
from weir.edge import (
    ERRORS,
    INSTANCES,
    INTERNAL,
    LIMITED,
    OPERATIONS,
    PUBLIC,
    TOKEN_DIGEST_ENV,
    UNAVAILABLE_FILE,
    EdgeSettings,
    api_paths,
    edge_config,
    edge_load,
    error_files,
    token_digest,
)

APIS = ["10.0.0.5:8080", "10.0.0.6:8080", "10.0.0.7:8080"]


def config(settings: EdgeSettings, apis: list[str] = APIS, source: str = "") -> str:
    return edge_config(bind="127.0.0.1:8080", admin_bind="127.0.0.1:8404", apis=apis, files_dir="/etc/edge",
                       settings=settings, paths=api_paths(), cors_expose=CORS_EXPOSE.decode(), source=source)


@pytest.mark.parametrize("maxconn", [2, 5, 48, 200])
def test_each_api_instance_gets_maxconn_slots_a_reserve_share_of_them_for_the_internal_token(maxconn: int) -> None:
    settings = EdgeSettings(edge_maxconn=maxconn)
    reserve = max(1, round(maxconn * settings.shed_reserve_share))
    text = config(settings)
    for i, api in enumerate(APIS, 1):
        assert f"server {PUBLIC}-{i} {api} maxconn {maxconn - reserve} check" in text
        assert f"server {INTERNAL}-{i} {api} maxconn {reserve} track {PUBLIC}/{PUBLIC}-{i}" in text
        assert f"server {OPERATIONS}-{i} {api} track {PUBLIC}/{PUBLIC}-{i}" in text  # no maxconn: never limited
        assert f"server {INSTANCES}-{i} {api} track" in text
    assert f"timeout queue {settings.edge_queue_ms}ms" in text
    # the token is matched by its digest, read from the environment: the config holds no secret
    assert f'sha2(256),hex -m str "${{{TOKEN_DIGEST_ENV}}}"' in text


def test_the_paths_come_from_the_apis_route_table() -> None:
    table = api_table()
    text = config(EdgeSettings())
    operations = next(line for line in text.splitlines() if line.startswith("    acl operations path "))
    assert set(operations.split()[3:]) == set(table.operations_paths)
    for pattern in (*table.operations_patterns, *table.player_patterns):
        assert f"path_reg '{pattern.pattern}'" in text
    assert "acl open path_beg /sdk/" in text


def test_the_edge_connects_from_its_source_address_when_given() -> None:
    text = config(EdgeSettings(), source="127.0.0.2")
    servers = [line for line in text.splitlines() if line.strip().startswith("server ") and "abns@" not in line
               and INSTANCES not in line]
    assert servers and all(" source 127.0.0.2" in line for line in servers)
    assert " source " not in config(EdgeSettings())


def test_the_edges_own_answers_are_problem_bodies_with_stable_codes() -> None:
    settings = EdgeSettings(shed_window_ms=2500)
    files = error_files(settings)
    for status, (code, _) in ERRORS.items():
        head, body = files[f"{status}.http"].split("\r\n\r\n", 1)
        lines = head.split("\r\n")
        assert lines[0].startswith(f"HTTP/1.1 {status} ")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        assert headers["content-type"] == "application/problem+json"
        assert int(headers["content-length"]) == len(body.encode())
        problem = json.loads(body)
        assert problem["status"] == status and problem["code"] == code
        if status == 503:
            assert code == "overloaded" and headers["retry-after"] == "3"  # the api's own Retry-After
    assert json.loads(files[UNAVAILABLE_FILE])["code"] == "unavailable"


def test_the_token_digest_is_what_haproxys_converters_print() -> None:
    assert token_digest("abc") == "BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD"


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="`make edge` installs haproxy")
@pytest.mark.parametrize("apis", [APIS[:1], APIS])
def test_haproxy_accepts_the_config(apis: list[str], tmp_path: Path) -> None:
    for name, content in error_files(EdgeSettings()).items():
        (tmp_path / name).write_text(content)
    text = config(EdgeSettings(edge_access_log=True), apis).replace("/etc/edge", str(tmp_path))
    (tmp_path / "haproxy.cfg").write_text(text)
    checked = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                             env={**os.environ, TOKEN_DIGEST_ENV: token_digest("t")}, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr


EXPOSITION = """\
# TYPE haproxy_backend_http_responses_total counter
haproxy_backend_http_responses_total{proxy="api",code="2xx"} 90
haproxy_backend_http_responses_total{proxy="api",code="5xx"} 12
haproxy_backend_http_responses_total{proxy="internal",code="5xx"} 1
haproxy_backend_http_responses_total{proxy="operations",code="5xx"} 7
# TYPE haproxy_server_http_responses_total counter
haproxy_server_http_responses_total{proxy="api",server="api-1",code="5xx"} 2
haproxy_server_http_responses_total{proxy="api",server="unavailable",code="5xx"} 3
haproxy_server_http_responses_total{proxy="operations",server="operations-1",code="5xx"} 7
# TYPE haproxy_server_limit_sessions gauge
haproxy_server_limit_sessions{proxy="api",server="api-1"} 38
haproxy_server_limit_sessions{proxy="api",server="unavailable"} NaN
haproxy_server_limit_sessions{proxy="internal",server="internal-1"} 10
# TYPE haproxy_backend_current_sessions gauge
haproxy_backend_current_sessions{proxy="api"} 30
haproxy_backend_current_sessions{proxy="internal"} 2
haproxy_backend_current_sessions{proxy="operations"} 1
# TYPE haproxy_backend_current_queue gauge
haproxy_backend_current_queue{proxy="api"} 4
"""


def test_the_edges_refusals_are_the_limited_backends_503s_that_no_server_sent() -> None:
    load = edge_load(EXPOSITION)
    assert set(LIMITED) == {PUBLIC, INTERNAL}
    assert load.refused == 12 + 1 - 2 - 3  # the api's own 5xx and the `unavailable` answers are not refusals
    assert (load.slots, load.in_flight, load.waiting) == (48, 32, 4)
    assert edge_load("").refused == 0 and edge_load("").slots is None
