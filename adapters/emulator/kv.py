"""P/D KV handoff: the prefill side holds blocks under a lease; the decode side pulls them over HTTP.

The pull is a real loopback request to the prefill instance's HTTP port (`remote_host:remote_port`
in `kv_transfer_params`): `POST /kv/pull {remote_engine_id, remote_request_id, remote_block_ids}`.
The prefill instance answers after profile.kv_transfer_time(tokens) and frees the blocks.
Mirrors vLLM's NIXL failure modes: nothing listening → retry until the handshake timeout, then
fail; unknown engine, unknown or expired request → fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import aiohttp


class PullFailed(Exception):
    """The decode side could not get the KV it was told to pull."""


@dataclass
class HeldKV:
    request_id: str
    blocks: int
    tokens: int
    block_ids: list[int]
    expires_at: float


class KVHolder:
    """The prefill side's table of KV waiting to be pulled."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.table: dict[str, HeldKV] = {}
        self._ids = itertools.count(1)
        self.expired = 0

    def hold(self, request_id: str, blocks: int, tokens: int, now: float) -> HeldKV:
        ids = [next(self._ids) for _ in range(blocks)]
        held = HeldKV(request_id, blocks, tokens, ids, now + self.lease_s)
        self.table[request_id] = held
        return held

    def take(self, request_id: str) -> HeldKV | None:
        return self.table.pop(request_id, None)

    def expire(self, now: float) -> list[HeldKV]:
        gone = [h for h in self.table.values() if h.expires_at <= now]
        for h in gone:
            del self.table[h.request_id]
        self.expired += len(gone)
        return gone


class KVPuller:
    """The decode side: one pooled client for pulls from any prefill instance."""

    def __init__(self, handshake_timeout_s: float) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._handshaked: set[str] = set()
        """Engines pulled from before: losing one fails at once, like NIXL_ERR_REMOTE_DISCONNECT."""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=1.0))
        return self._session

    async def pull(self, params: dict[str, Any]) -> int:
        """Pull the KV named by `params`; returns the number of prompt tokens transferred."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            raise PullFailed("kv_transfer_params lack remote_host/remote_port")
        url = f"http://{host}:{port}/kv/pull"
        body = {k: params.get(k) for k in ("remote_engine_id", "remote_request_id", "remote_block_ids")}
        engine = str(params.get("remote_engine_id"))
        deadline = asyncio.get_running_loop().time() + self.handshake_timeout_s
        while True:
            try:
                async with self._client().post(url, json=body) as r:
                    data = await r.json(content_type=None)
                    if r.status == 200:
                        self._handshaked.add(engine)
                        return int(data.get("tokens", 0))
                    raise PullFailed(f"prefill side refused the pull: {r.status} {data.get('error', '')}")
            except (TimeoutError, aiohttp.ClientConnectionError, OSError) as e:
                if engine in self._handshaked:
                    raise PullFailed(f"remote engine {engine} at {host}:{port} disconnected") from None
                if asyncio.get_running_loop().time() >= deadline:
                    raise PullFailed(f"handshake with {host}:{port} timed out ({type(e).__name__})") from None
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
