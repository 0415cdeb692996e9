"""Free TCP ports on this host, and whether an address is loopback-only (servers bind 127.0.0.1 by default)."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

from core.errors import SibylError

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS = range(20000, 32768)
"""Where ports for our servers are drawn: below Linux's default ephemeral range (32768-60999), where the
kernel hands out ports to every connect() and bind(0) on the machine. A port found free there is taken
by nobody else between the moment it is chosen and the moment its server binds it (vLLM binds its KV
events sockets seconds after start-up; one drawn by bind(0) was once taken by then)."""


def _ephemeral() -> range:
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A port nothing listens on right now, not one of `avoid`: drawn at random outside the kernel's
    ephemeral range (FIXED_PORTS), else the one the OS picks."""
    ephemeral = _ephemeral()
    for _ in range(200):
        port = random.choice(FIXED_PORTS)
        if port not in avoid and port not in ephemeral and _bindable(host, port):
            return port
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
