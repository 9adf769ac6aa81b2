"""The AsyncAPI document of a service, generated from its consumers and the events it publishes."""

from __future__ import annotations

from typing import Any

from shared.bus import ConsumerSpec
from shared.events import CATALOG
from shared.streams import subject_matches


def _message(event_type: str) -> dict[str, Any]:
    model = CATALOG[event_type]
    return {
        "name": event_type,
        "title": event_type,
        "contentType": "application/json",
        "summary": (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else event_type,
        "headers": {"type": "object", "properties": {"Nats-Msg-Id": {"type": "string", "description": "event id"}}},
        "payload": {
            "type": "object",
            "description": "CloudEvents envelope; `data` is the event's payload",
            "properties": {
                "id": {"type": "string"},
                "type": {"const": event_type},
                "specversion": {"type": "string"},
                "source": {"type": "string"},
                "time": {"type": "string", "format": "date-time"},
                "subject": {"type": "string"},
                "dataschemaversion": {"const": model.version},
                "data": model.model_json_schema(),
            },
            "required": ["id", "type", "specversion", "source", "time", "subject", "dataschemaversion", "data"],
        },
    }


def _subjects(consumer: ConsumerSpec) -> list[str]:
    return [t for t in CATALOG if any(subject_matches(s, t) for s in consumer.subjects)]


def asyncapi_document(service: str, consumers: list[ConsumerSpec], publishes: tuple[str, ...]) -> dict[str, Any]:
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}

    def channel(event_type: str) -> str:
        key = event_type.replace(".", "_")
        messages[key] = _message(event_type)
        channels.setdefault(
            key,
            {"address": event_type, "messages": {key: {"$ref": f"#/components/messages/{key}"}}},
        )
        return key

    for event_type in publishes:
        key = channel(event_type)
        operations[f"publish_{key}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{key}"},
            "summary": f"{service} publishes {event_type} through its outbox",
        }
    for consumer in consumers:
        for event_type in _subjects(consumer):
            key = channel(event_type)
            operations[f"{consumer.name}_{key}"] = {
                "action": "receive",
                "channel": {"$ref": f"#/channels/{key}"},
                "summary": consumer.description or f"durable consumer {consumer.name}",
                "bindings": {"nats": {"queue": consumer.name}},
            }
    return {
        "asyncapi": "3.0.0",
        "info": {"title": f"weir {service}", "version": "1"},
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    }
