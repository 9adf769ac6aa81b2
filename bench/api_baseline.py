"""The api with auth replaced by a fixed identity: the baseline of bench/api.py, never a way to run Weir.

python -m bench.api_baseline   (WEIR_BENCH_IDENTITY='{"app_id": ..., "account_id": ..., "key_id": ...}')
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from fastapi import FastAPI

from services.api.app import SERVICE, handlers
from services.api.guard import Receive, Scope, Send
from shared.authcheck import CheckDecision, Identity
from shared.runtime import Runtime, main


class FixedIdentity:
    """Every request is the same accepted secret key; no auth.check, no counters, no headers."""

    def __init__(self, app: object, reply: CheckDecision) -> None:
        self.app = app
        self.reply = reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["auth"] = self.reply
        await self.app(scope, receive, send)  # type: ignore[operator]


def baseline_routes(app: FastAPI, rt: Runtime) -> None:
    handlers(app, rt)
    identity = Identity(key_type="secret", **json.loads(os.environ["WEIR_BENCH_IDENTITY"]))
    app.add_middleware(FixedIdentity, reply=CheckDecision(allowed=True, status=200, identity=identity,
                                                       client_address="127.0.0.1"))


if __name__ == "__main__":
    main(replace(SERVICE, routes=baseline_routes))
