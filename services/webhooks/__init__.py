"""Webhooks (SPEC 13): Weir's events POSTed to developers' own endpoints, signed (Standard Webhooks), retried,
logged and replayable. domain.py decides, signing.py signs, ssrf.py guards the address; the service comes later."""
