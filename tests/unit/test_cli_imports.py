"""The `weir` command loads no client library it does not use: `weir rollout` runs beside the instances serving,
and its start is CPU they lose (bench/RESULTS.md, issue 28: 0.6 CPU s with the NATS client imported, 0.36 without).
Each command imports its clients where it uses them."""

from __future__ import annotations

import json
import subprocess
import sys

CLIENTS = ("nats", "faststream", "aiohttp", "asyncpg", "aioboto3", "botocore", "httpx")


def test_the_weir_command_imports_no_client_library_until_a_command_needs_one() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import json, sys, weir.cli; "
                               f"print(json.dumps([m for m in {CLIENTS!r} if m in sys.modules]))"],
        capture_output=True, text=True, check=True)
    assert json.loads(loaded.stdout) == [], f"`import weir.cli` loads {loaded.stdout.strip()}"
