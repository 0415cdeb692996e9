"""Free TCP ports on this host, and whether an address is loopback-only (servers bind 127.0.0.1 by default)."""

from __future__ import annotations

import ipaddress
import socket

from core.errors import SibylError


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A port nothing listens on right now (the OS picks it), not one of `avoid`."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise SibylError(f"found no free port on {host} outside {len(avoid)} taken ones")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
