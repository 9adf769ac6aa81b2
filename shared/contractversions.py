"""The contract versions a service speaks, as `GET /version` shows them (SPEC 11).

Derived from the declarations (shared/contracts.py and the catalog's models), never listed by hand.
"""

from __future__ import annotations

from typing import Any

from shared import contracts
from shared.events.catalog import CATALOG


def contract_versions(service: str) -> dict[str, Any]:
    """{"events": {type: version}} for every event type the service publishes or reads."""
    spoken = set(contracts.published_by(service)) | contracts.received_by(service)
    return {"events": {t: CATALOG[t].version for t in contracts.EVENT_TYPES if t in spoken}}
