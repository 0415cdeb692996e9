"""Free TCP ports on this host, who holds a taken one, and whether an address is loopback-only (servers bind
127.0.0.1 by default)."""

from __future__ import annotations

import errno
import ipaddress
import os
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


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` on this machine, where /proc says (Linux; our own user's
    processes, or any as root): the socket's inode from /proc/net/tcp{,6}, then the process holding it."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")  # 0A: LISTEN
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return int(pid)
        except OSError:
            continue  # gone, or not ours to read
    return None


def _command_line(pid: int, width: int = 80) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    return text if len(text) <= width else text[: width - 1] + "…"


def cannot_listen(host: str, port: int) -> str | None:
    """None when a server can listen on `host:port` (bound as uvicorn binds it, SO_REUSEADDR); else one
    line saying why, naming the process that holds a taken port when it can be read."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return f"cannot listen on {host}:{port}: {e.strerror or e}"
        else:
            return None
    pid = listening_pid(port)
    holder = f" by pid {pid} ({_command_line(pid)})" if pid is not None else ""
    return f"port {port} on {host} is in use{holder}; pick another with --port (0: any free one)"
