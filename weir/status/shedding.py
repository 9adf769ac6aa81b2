"""What the api and auth instances and the edge have shed (SPEC 15), read from their `/metrics`: refusals by
priority since the instance started, and the api's concurrency limit and requests in flight now; the edge's
refusals (HAProxy's exporter), its requests in flight to the api and waiting for a slot."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from weir.status.model import Shedding, Unavailable, reason_of
from weir.status.services import EDGE, service_kind

SHEDDING_SERVICES = ("api", "auth", EDGE)


def edge_shedding_of(exposition: str) -> Shedding:
    """The edge's refusals from HAProxy's /metrics (weir/edge.py)."""
    from weir.edge import edge_load

    load = edge_load(exposition)
    return Shedding(shed={"all": load.refused}, limit=load.slots, in_flight=load.in_flight, waiting=load.waiting)


def shedding_of(exposition: str) -> Shedding:
    """An instance's shedding from its /metrics text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    shed: dict[str, int] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "weir_shed_total":
                priority = sample.labels.get("priority", "")
                shed[priority] = shed.get(priority, 0) + int(sample.value)
            elif sample.name in ("weir_shed_limit", "weir_shed_in_flight", "weir_shed_waiting",
                                 "weir_auth_overloaded_total"):
                gauges[sample.name] = sample.value
    return Shedding(shed=shed, limit=gauges.get("weir_shed_limit"), in_flight=gauges.get("weir_shed_in_flight"),
                    waiting=gauges.get("weir_shed_waiting"),
                    auth_overloaded=int(gauges["weir_auth_overloaded_total"])
                    if "weir_auth_overloaded_total" in gauges else None)


async def read_shedding(services: Mapping[str, str], timeout: float
                        ) -> dict[str, Shedding | Unavailable] | Unavailable:
    import httpx

    instances = {name: url for name, url in services.items() if service_kind(name) in SHEDDING_SERVICES}
    if not instances:
        return Unavailable("no api or auth address (their /metrics tell what they shed): pass --service api=URL")

    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(name: str, url: str) -> Shedding | Unavailable:
            try:
                r = await http.get(f"{url}/metrics")
                r.raise_for_status()
                return edge_shedding_of(r.text) if service_kind(name) == EDGE else shedding_of(r.text)
            except Exception as exc:
                return Unavailable(f"{url}/metrics: {reason_of(exc)}")

        read = await asyncio.gather(*(one(name, url) for name, url in instances.items()))
    return dict(zip(instances, read, strict=True))
