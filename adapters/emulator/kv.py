"""P/D KV handoff: the prefill side holds blocks under a lease; the decode side pulls them over HTTP.

The "side channel" is the prefill instance's own HTTP port: `kv_transfer_params.remote_host` /
`remote_port` name it, and the decode instance pulls with a real loopback request
`POST /kv/pull {"remote_engine_id", "remote_request_id", "remote_block_ids"}`. The prefill side
answers after `profile.kv_transfer_time(tokens)` × slowdown (the transfer is modelled by the
holder, which is where the bytes would come from), then frees the blocks. Failure modes follow
vLLM 0.32's NixlConnector (shared/design/vllm-integration.md A.2):

* nothing listening at remote_host:remote_port → keep trying until the handshake timeout
  (vLLM: 5 s), then fail;
* an engine this decode instance already pulled from is gone → fail at once (NIXL's
  "remote disconnect"; a first contact cannot tell "gone" from "not up yet");
* a live instance with another engine id (treated as an unknown engine), or no blocks under that
  request id (never held, already pulled, or lease expired) → fail at once.

Leases: held blocks are freed `lease_s` after the prefill finished (vLLM's kv_lease_duration,
30 s) and counted in vllm:nixl_num_kv_expired_reqs_total; the expiry task sleeps until the next
lease ends and waits on an event when nothing is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


class PullFailed(Exception):
    """The decode side could not get the KV it was told to pull."""


@dataclass(slots=True)
class HeldKV:
    request_id: str
    blocks: int
    tokens: int
    block_ids: list[int]
    expires_at: float
    kv_id: int = -1
    """The held sequence's allocation in the engine's block pool."""


class KVHolder:
    """The prefill side's table of KV waiting to be pulled, with lease expiry."""

    def __init__(self, lease_s: float, total_blocks: int, on_expire: Callable[[HeldKV], None]) -> None:
        self.lease_s = lease_s
        self.total_blocks = total_blocks
        self.on_expire = on_expire
        self.table: dict[str, HeldKV] = {}
        """Insertion order is expiry order (every lease has the same length)."""
        self._pos = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def hold(self, request_id: str, blocks: int, tokens: int, kv_id: int = -1) -> HeldKV:
        """Keep `blocks` for a pull; block ids are labels, consecutive and wrapping at the cache size."""
        ids = [(self._pos + i) % self.total_blocks + 1 for i in range(blocks)]
        self._pos = (self._pos + blocks) % self.total_blocks
        held = HeldKV(request_id, blocks, tokens, ids, time.monotonic() + self.lease_s, kv_id)
        self.table[request_id] = held
        self._changed.set()
        return held

    def take(self, request_id: str) -> HeldKV | None:
        """Remove and return the held KV of a request (None if unknown or expired)."""
        return self.table.pop(request_id, None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._expire_loop(), name="kv-lease-expiry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _expire_loop(self) -> None:
        while True:
            if not self.table:
                self._changed.clear()
                await self._changed.wait()
                continue
            first = next(iter(self.table.values()))
            delay = first.expires_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            del self.table[first.request_id]
            self.on_expire(first)


class KVPuller:
    """The decode side: one pooled client for pulls from any prefill instance."""

    def __init__(self, handshake_timeout_s: float) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._known: set[str] = set()
        """Engines pulled from before: losing one fails at once, like NIXL_ERR_REMOTE_DISCONNECT."""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def pull(self, params: dict[str, Any], local_tokens: int = 0) -> int:
        """Pull the KV named by `params` beyond the first `local_tokens` (cached here already, so
        NIXL reads only the other blocks); returns the number of prompt tokens transferred."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            raise PullFailed("kv_transfer_params lack remote_host/remote_port")
        url = f"http://{host}:{port}/kv/pull"
        body = orjson.dumps(
            {
                **{k: params.get(k) for k in ("remote_engine_id", "remote_request_id", "remote_block_ids")},
                "local_tokens": local_tokens,
            }
        )
        engine = str(params.get("remote_engine_id"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.handshake_timeout_s
        while True:
            left = deadline - loop.time()
            try:
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=max(0.05, min(1.0, left)))
                async with self._client().post(
                    url, data=body, timeout=timeout, headers={"content-type": "application/json"}
                ) as r:
                    data = await r.json(content_type=None)
                    if r.status == 200 and isinstance(data, dict):
                        self._known.add(engine)
                        return int(data.get("tokens", 0))
                    raise PullFailed(f"prefill side refused the pull: {r.status} {data}")
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ContentTypeError, OSError, ValueError) as e:
                if engine in self._known:
                    raise PullFailed(f"remote engine {engine} at {host}:{port} disconnected") from None
                if loop.time() >= deadline:
                    raise PullFailed(f"handshake with {host}:{port} timed out ({type(e).__name__})") from None
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
