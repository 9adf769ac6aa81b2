"""The limits store's mode, read from each auth instance's `/metrics` with prometheus_client's parser (either
exposition: Weir's own or prometheus_client's)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from weir.status.model import Unavailable, reason_of
from weir.status.services import service_kind

# the limits store's mode on auth's /metrics: the gauge the issue names, and the 1/0 gauge auth set before it
MODE_METRIC = "weir_counter_store_mode"
SHARED_METRIC = "weir_counter_store_shared"
MODES = ("shared", "local")


def counter_store_mode(exposition: str) -> str:
    """The limits store's mode from auth's /metrics text (either exposition: Weir's own or prometheus_client's).

    `weir_counter_store_mode`: the sample at 1 whose label value is a mode (a labelled gauge or a prometheus_client
    Enum), or a bare value (1 shared, 0 local); `weir_counter_store_shared`: 1 shared, 0 local. Raises ValueError
    when neither series is there."""
    from prometheus_client.parser import text_string_to_metric_families

    by_name = {family.name: family for family in text_string_to_metric_families(exposition)}
    family = by_name.get(MODE_METRIC)
    if family is not None:
        for sample in family.samples:
            labelled = [v for v in sample.labels.values() if v in MODES]
            if labelled and sample.value == 1:
                return labelled[0]
        bare = [s for s in family.samples if not any(v in MODES for v in s.labels.values())]
        if bare:
            return "shared" if bare[0].value == 1 else "local"
    family = by_name.get(SHARED_METRIC)
    if family is not None and family.samples:
        return "shared" if family.samples[0].value == 1 else "local"
    raise ValueError(f"no {MODE_METRIC} (or {SHARED_METRIC}) series on /metrics")


def limits_mode(modes: Iterable[str]) -> str | None:
    """One mode for the stack: shared or local when every auth instance agrees, `mixed` when not."""
    seen = set(modes)
    if not seen:
        return None
    return seen.pop() if len(seen) == 1 else "mixed"


async def read_limits(services: Mapping[str, str], timeout: float) -> dict[str, str | Unavailable] | Unavailable:
    import httpx

    auths = {name: url for name, url in services.items() if service_kind(name) == "auth"}
    if not auths:
        return Unavailable("no auth service address (its /metrics tells the mode): pass --service auth=URL")

    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(url: str) -> str | Unavailable:
            try:
                r = await http.get(f"{url}/metrics")
                r.raise_for_status()
                return counter_store_mode(r.text)
            except Exception as exc:
                return Unavailable(f"{url}/metrics: {reason_of(exc)}")

        modes = await asyncio.gather(*(one(url) for url in auths.values()))
    return dict(zip(auths, modes, strict=True))
