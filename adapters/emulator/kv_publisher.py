"""Publish an emulated instance's KV-cache events over ZMQ exactly as vLLM 0.32's ZmqEventPublisher does.

The engine drains its block pool's events (core.cache.events) after every step and hands them
here; each non-empty drain becomes one `KVEventBatch` (adapters/vllm/kv_wire.py has the layout):

* PUB socket at `endpoint` (bound for a wildcard, ipc:// or inproc:// address, else connected, as
  vLLM decides), high-water mark `hwm`; every batch is sent as (topic, 8-byte big-endian sequence
  number counting from 0, msgpack batch);
* the last `buffer_steps` batches are kept; a ROUTER socket at `replay_endpoint` (bound) answers
  a request carrying a start sequence number with every kept batch from there on, each as
  (topic, seq, payload), then the end marker (b"", -1, b"").

Our block keys (signed 64-bit) go out as vLLM's default int block hashes: unsigned 64-bit
(`key mod 2**64`); a subscriber recomputes its own keys from `token_ids` anyway. vLLM sends one
BlockRemoved per evicted block, and so does this publisher. Everything runs on the event loop:
sends on a PUB socket never block, and the replay socket is served by a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque
from collections.abc import Iterable

import zmq
import zmq.asyncio

from adapters.vllm.kv_wire import (
    END_SEQ,
    FULL_ATTENTION,
    UINT64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    WireEvent,
    binds,
    encode_batch,
    seq_bytes,
)
from core.cache import events as ours


def to_wire(events: Iterable[ours.KVEvent]) -> list[WireEvent]:
    """Our events as vLLM 0.32 fills them for a plain attention model (one BlockRemoved per block)."""
    out: list[WireEvent] = []
    for e in events:
        if isinstance(e, ours.BlockStored):
            out.append(
                BlockStored(
                    block_hashes=[k & UINT64 for k in e.keys],
                    parent_block_hash=None if e.parent_key is None else e.parent_key & UINT64,
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                    lora_name=e.lora_name,
                    extra_keys=[None] * len(e.keys),
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            )
        elif isinstance(e, ours.BlockRemoved):
            out.extend(BlockRemoved(block_hashes=[k & UINT64], medium=e.medium, group_idx=0) for k in e.keys)
        else:
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """One instance's (or data-parallel rank's) publisher; `start` needs the running loop."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self.seq = 0
        """Sequence number of the next batch."""
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.replays = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        ctx = self._ctx = zmq.asyncio.Context()
        sync: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        pub = self._pub = sync.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if binds(self.endpoint):
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            router = self._router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")
        print(
            f"emulate: KV events on {self.endpoint}"
            + (f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")
            + (f", topic {self.config.topic!r}" if self.config.topic else ""),
            file=sys.stderr,
            flush=True,
        )

    def publish(self, events: list[ours.KVEvent], ts: float | None = None) -> None:
        """Send one batch (nothing for an empty list)."""
        if not events or self._pub is None:
            return
        payload = encode_batch(KVEventBatch(time.time() if ts is None else ts, to_wire(events), self.rank))
        seq = self.seq
        self.seq += 1
        with contextlib.suppress(zmq.Again):  # PUB drops at the high-water mark rather than block
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores a malformed request
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await router.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
            await router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._router = None
        self._ctx = None
