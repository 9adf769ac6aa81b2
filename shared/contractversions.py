"""The contract versions a service speaks, as `GET /version` shows them (SPEC 11).

Derived from the declarations (shared/contracts.py and the catalog's models), never listed by hand.
"""

from __future__ import annotations

from typing import Any

from shared import contracts
from shared.events.catalog import CATALOG

API_SERVICE = "api"  # the service whose public HTTP contract is the OpenAPI document


def contract_versions(service: str) -> dict[str, Any]:
    """{"events": {type: version}} for every event type the service publishes or reads, {"requests": {subject:
    version}} for every request/reply (or fire-and-forget) contract it serves or calls, and for the api
    {"openapi": version} of its public HTTP contract."""
    spoken = set(contracts.published_by(service)) | contracts.received_by(service)
    versions: dict[str, Any] = {"events": {t: CATALOG[t].version for t in contracts.EVENT_TYPES if t in spoken}}
    versions["requests"] = {r.subject: r.version for r in contracts.REQUESTS
                            if r.responder == service or service in r.callers}
    if service == API_SERVICE:
        versions["openapi"] = contracts.OPENAPI_VERSION
    return versions
