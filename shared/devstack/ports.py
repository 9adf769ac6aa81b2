"""TCP ports for servers on 127.0.0.1: free now, below the kernel's ephemeral range, not handed out twice while the
server it went to may still be about to bind it."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

from shared.devstack.addresses import HOST
from shared.devstack.errors import DevStackError

# A claim keeps a port from being handed out again for as long as its server may take to bind it; after that only
# `port_is_free` decides. Held for good, a long-lived process's claims (a test worker makes hundreds) kept a restart
# from its own previous ports, which it then moved (tests/integration/test_devstack.py, now and then).
CLAIM_HOLD_S = 60.0
_claimed_ports: dict[int, float] = {}  # port -> when it was handed out (monotonic)
_claim_lock = threading.Lock()


def _held(port: int) -> bool:
    claimed = _claimed_ports.get(port)
    return claimed is not None and time.monotonic() - claimed < CLAIM_HOLD_S


def port_is_free(port: int) -> bool:
    """True if a server could listen on the port now (SO_REUSEADDR, as the servers do, so TIME_WAIT is fine)."""
    for host in (HOST, "0.0.0.0"):  # weed mini also checks the wildcard address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def claim_port(preferred: int | None, *, grpc_offset: int = 0) -> int:
    """A free port (`preferred` if it is free); with grpc_offset, port + grpc_offset must be free too."""
    # Below the ephemeral range, so an outgoing connection never borrows a server's port between restarts.
    low, high = ephemeral_range()
    bottom, top = (10000, low - 1) if low > 12000 + grpc_offset else (high + 1, 65535)
    with _claim_lock:

        def usable(port: int) -> bool:
            ports = {port, port + grpc_offset}
            return bottom <= port <= top - grpc_offset and not any(map(_held, ports)) and all(map(port_is_free, ports))

        candidates = [preferred] if preferred else []
        candidates += [random.randint(bottom, top - grpc_offset) for _ in range(500)]
        for port in candidates:
            if usable(port):
                now = time.monotonic()
                _claimed_ports.update({port: now, port + grpc_offset: now})
                return port
    raise DevStackError("no free TCP port found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a server to be started on: free now, below the kernel's ephemeral range, and not
    handed out again by this process within CLAIM_HOLD_S. A port taken from the ephemeral range (bind to port 0,
    close, pass the number on) can be given to an outgoing connection before the server binds it: `address already in
    use`, or a client that meets some other server."""
    return claim_port(None)


def release_ports(ports: dict[str, int]) -> None:
    with _claim_lock:
        for port in ports.values():
            _claimed_ports.pop(port, None)
