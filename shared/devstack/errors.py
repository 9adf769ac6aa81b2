"""What goes wrong when the embedded servers start: the one error the stack raises."""

from __future__ import annotations


class DevStackError(RuntimeError):
    """A server did not start, did not become ready, or the data directory is in use."""


class StartAbandoned(DevStackError):
    """A server's start was given up because another server failed to start."""
