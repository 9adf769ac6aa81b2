"""Every service starts as its own process, reports ready only when its dependencies answer, and stops on SIGTERM."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys

import httpx
import pytest

from shared import db
from shared.devstack.ports import free_port
from shared.runtime import messaging_document
from shared.settings import CommonSettings
from tests.integration.authhelpers import TEST_SECRETS
from tests.waiting import wait_service_ready


@pytest.mark.parametrize("service", sorted(db.SCHEMAS))
def test_service_starts_reports_ready_and_stops_on_sigterm(
    service: str, stack_env: dict[str, str], prepared: CommonSettings
) -> None:
    port = free_port()
    secrets = {f"WEIR_{k.upper()}": v for k, v in TEST_SECRETS.items()}
    env = {**os.environ, **stack_env, **secrets, "WEIR_HTTP_PORT": str(port), "PYTHONUNBUFFERED": "1",
           "WEIR_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        ready = wait_service_ready(f"http://127.0.0.1:{port}", proc, timeout=30.0)
        assert ready.json()["checks"] == {"nats": "ok", "database": "ok", "storage": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["service"] == service
        doc = httpx.get(f"http://127.0.0.1:{port}/asyncapi.json").json()
        assert doc["asyncapi"].startswith("3.")
        # its events and durable consumers as `weir events check` reads them (the consumers run outside FastStream)
        offline = messaging_document(importlib.import_module(f"services.{service}.app").SERVICE)
        assert {name: doc["channels"].get(name) for name in offline["channels"]} == offline["channels"]
        assert httpx.get(f"http://127.0.0.1:{port}/openapi.json").status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=CommonSettings().shutdown_grace_seconds + 10)
        assert proc.returncode == 0, out.decode()
        assert f"{service} stopped" in out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
