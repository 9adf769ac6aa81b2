"""Which services to ask (`--service NAME=URL`, else `weir up`'s stack.json), their readiness (`GET /readyz`) and
the release each runs (`GET /version`, read tolerantly: a newer release's extra fields are ignored)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.release import VersionInfo
from weir.status.model import InstanceRelease, Readiness, Unavailable, reason_of

EDGE = "edge"  # `weir up --edge`'s HAProxy (weir/edge.py), named by its admin port


def service_kind(name: str) -> str:
    """What a named process is: `media-2` is a media worker, `auth` is auth."""
    return name.split("-", 1)[0]


def parse_service_options(options: Iterable[str]) -> dict[str, str]:
    """`NAME=URL` pairs (`--service auth=http://127.0.0.1:8081`); raises ValueError on anything else."""
    found: dict[str, str] = {}
    for option in options:
        name, sep, url = option.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"not NAME=URL with an http(s) URL: {option!r}")
        found[name] = url
    return found


def services_in_stack(info: Mapping[str, Any]) -> dict[str, str]:
    """The service processes `weir up` wrote to .weir/stack.json (`services: {name: url}`)."""
    services = info.get("services") or {}
    return {str(k): str(v).rstrip("/") for k, v in services.items()} if isinstance(services, dict) else {}


def read_stack_file(path: Path) -> dict[str, Any]:
    """stack.json's content ({} when absent or unreadable: no `weir up` beside this shell)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def readiness(url: str, status: int, body: str) -> Readiness:
    """A `/readyz` answer: 200 is ready; otherwise the checks that failed (the 503 problem body lists them)."""
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        parsed = {}
    checks = parsed.get("checks") if isinstance(parsed, dict) else None
    checks = {str(k): str(v) for k, v in checks.items()} if isinstance(checks, dict) else {}
    if status == 200:
        return Readiness(url, True, status, checks)
    failing = [f"{k} {v}" for k, v in checks.items() if v != "ok"]
    detail = "; ".join(failing) or (parsed.get("detail") if isinstance(parsed, dict) else None) or body[:200]
    return Readiness(url, False, status, checks, f"HTTP {status}" + (f": {detail}" if detail else ""))


def unreachable(url: str, exc: BaseException) -> Readiness:
    return Readiness(url, False, None, {}, f"unreachable: {reason_of(exc)}")


def release(status: int, body: str) -> InstanceRelease | Unavailable:
    """A `/version` answer: 200 is the instance's release; 404 an instance older than the route; anything else (a
    refusal, a body that is not a VersionInfo) is unavailable, with why."""
    if status == 404:
        return InstanceRelease(version=None)
    if status != 200:
        return Unavailable(f"/version: HTTP {status}")
    try:
        info = VersionInfo.model_validate_json(body)
    except ValidationError as exc:
        return Unavailable(f"/version: not a version ({exc.error_count()} problem(s): "
                           f"{exc.errors()[0]['loc']} {exc.errors()[0]['msg']})")
    return InstanceRelease(version=info.version, commit=info.commit, service=info.service, dirty=info.dirty)


async def read_services(services: Mapping[str, str], timeout: float) -> dict[str, Readiness]:
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as http:

        async def version_of(url: str) -> InstanceRelease | Unavailable:
            try:
                r = await http.get(f"{url}/version")
            except Exception as exc:
                return Unavailable(f"/version: {reason_of(exc)}")
            return release(r.status_code, r.text)

        async def no_release() -> None:
            return None

        async def one(name: str, url: str) -> Readiness:
            # the edge is HAProxy, not a release of Weir's: its admin port answers readiness and metrics only
            release_of = no_release() if service_kind(name) == EDGE else version_of(url)
            try:
                r, runs = await asyncio.gather(http.get(f"{url}/readyz"), release_of)
            except Exception as exc:  # refused, timed out, not HTTP: the service does not answer
                return unreachable(url, exc)
            return dataclasses.replace(readiness(url, r.status_code, r.text), release=runs)

        answers = await asyncio.gather(*(one(name, url) for name, url in services.items()))
    return dict(zip(services, answers, strict=True))


def service_addresses(options: Sequence[str], stack_json: Path) -> dict[str, str] | Unavailable:
    """`--service` options when given (they name every service to ask), else the services `weir up` wrote to
    stack.json; Unavailable when neither names one. Raises ValueError on a malformed option."""
    given = parse_service_options(options)
    if given:
        return given
    found = services_in_stack(read_stack_file(stack_json))
    if found:
        return found
    return Unavailable(f"no service addresses: no `services` in {stack_json} (is `weir up` running here?) and no "
                       "--service NAME=URL (or WEIR_STATUS_SERVICES)")
