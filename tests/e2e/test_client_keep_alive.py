"""The gateway keeps a client's idle keep-alive connection open past the 5 s that clients pool one for (httpx and
the OpenAI client 5 s, aiohttp 15 s): a client reusing it never writes a request into the server's close."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from console.serve import CLIENT_KEEP_ALIVE_S
from tests.procs import FAST_PROFILE, kill_children, start_console

IDLE_S = 6.0
"""Longer than uvicorn's default keep-alive (5 s), which closed the connection before."""


def read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the gateway closed the connection mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = lengths[0]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the gateway closed the connection mid-body"
        body += chunk
    return head


@pytest.mark.slow  # waits 6 s on an idle connection (make test-slow)
def test_an_idle_client_connection_outlives_uvicorns_default_keep_alive(tmp_path: Path) -> None:
    assert IDLE_S < CLIENT_KEEP_ALIVE_S
    con = start_console(tmp_path, "--profile", FAST_PROFILE, "--prefill", "1", "--decode", "1")
    try:
        url = urlsplit(con.url)
        request = f"GET /v1/models HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "first request"
            time.sleep(IDLE_S)  # the idle time is what is under test
            sock.setblocking(False)
            try:
                closed = sock.recv(1) == b""
            except BlockingIOError:
                closed = False  # nothing to read and not closed: still open
            sock.setblocking(True)
            assert not closed, f"the gateway closed a connection idle for {IDLE_S} s"
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "the request on the reused connection"
    finally:
        con.stop()
        kill_children(con.home)
