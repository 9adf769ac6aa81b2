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
    COMPOSE,
    COMPOSE_DIR,
    CONFIG_FILE,
    ERRORS,
    FILES_DIR,
    INSTANCES,
    INTERNAL,
    LIMITED,
    OPERATIONS,
    PUBLIC,
    TOKEN_ENV,
    UNAVAILABLE_FILE,
    EdgeSettings,
    api_paths,
    edge_config,
    edge_files,
    edge_load,
    error_files,
    write_files,
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
    # the token is read from the environment (the config holds no secret) and compared by digest
    assert f'str("${{{TOKEN_ENV}}}"),sha2(256),hex,strcmp(txn.digest) eq 0' in text


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
        # a refusal keeps the connection, as the api's own does: closing it made every client connect again per
        # refusal, which doubled the edge's CPU and its refusals' p99 at 4x (bench/RESULTS.md, 2026-12-07 04:34)
        assert "connection" not in headers
    assert json.loads(files[UNAVAILABLE_FILE])["code"] == "unavailable"


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="`make edge` installs haproxy")
@pytest.mark.parametrize("apis", [APIS[:1], APIS])
def test_haproxy_accepts_the_config(apis: list[str], tmp_path: Path) -> None:
    for name, content in error_files(EdgeSettings()).items():
        (tmp_path / name).write_text(content)
    text = config(EdgeSettings(edge_access_log=True), apis).replace("/etc/edge", str(tmp_path))
    (tmp_path / "haproxy.cfg").write_text(text)
    checked = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                             env={**os.environ, TOKEN_ENV: "t"}, timeout=30)
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


def test_compose_mounts_the_current_config_in_front_of_the_api_replicas(tmp_path: Path) -> None:
    """deploy/edge/ is `weir edge config`'s output from this code (run it after changing the api's routes or the
    settings), mounted where its config names its files, for as many api replicas as compose runs."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    expected = edge_files(settings=EdgeSettings(), **COMPOSE)  # type: ignore[arg-type]
    committed = {str(p.relative_to(root / COMPOSE_DIR)): p.read_bytes().decode()
                 for p in (root / COMPOSE_DIR).rglob("*") if p.is_file()}
    assert committed == expected, "deploy/edge/ is stale: run `weir edge config`"
    services = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    edge = services["edge"]
    assert edge["profiles"] == ["edge"]
    mount = f"./{COMPOSE_DIR}:{Path(str(COMPOSE['files_dir'])).parent}:ro"
    assert mount in edge["volumes"]
    assert COMPOSE["replicas"] == services["api"]["deploy"]["replicas"]
    assert COMPOSE["apis"] == (f"api:{services['api']['environment']['WEIR_HTTP_PORT']}",)
    assert any(str(p).endswith(f":{str(COMPOSE['bind']).rsplit(':', 1)[1]}") for p in edge["ports"])
    assert edge["environment"][TOKEN_ENV].startswith(f"${{{TOKEN_ENV}:?")
    scrape = yaml.safe_load((root / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]
    job = next(j for j in scrape if j["job_name"] == "edge")
    assert job["dns_sd_configs"][0]["port"] == int(str(COMPOSE["admin_bind"]).rsplit(":", 1)[1])
    if shutil.which("haproxy"):  # and HAProxy takes it, its files where the config says
        write_files(tmp_path, expected)
        text = expected[CONFIG_FILE].replace(str(COMPOSE["files_dir"]), str(tmp_path / FILES_DIR))
        (tmp_path / CONFIG_FILE).write_text(text)
        checked = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / CONFIG_FILE)], capture_output=True, text=True,
                                 env={**os.environ, TOKEN_ENV: "t"}, timeout=30)
        assert checked.returncode == 0 and "WARNING" not in checked.stdout + checked.stderr, checked.stderr
