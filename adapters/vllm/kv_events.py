"""One instance's KV-event subscriber: vLLM 0.32's ZMQ stream in, our own core.cache events out.

`KVEventSubscriber` (asyncio, pyzmq's zmq.asyncio) connects a SUB socket to an engine's
`endpoint` (or binds it, for an engine whose endpoint is not a wildcard and so connects to us) and
a DEALER to its `replay_endpoint`, and for every batch (adapters/vllm/kv_wire.py):

* **order**: the sequence number must be the last one + 1. A jump forward is a gap: the missing
  batches are asked from the replay socket (start = last + 1) and applied in order before the one
  that revealed the gap; batches the replay already delivered are skipped when they arrive live.
  A gap the replay cannot fill (no replay socket, no answer in `replay_timeout_s`, or the buffer no
  longer reaches back) purges the instance: the index must not keep blocks it may have missed
  the removal of. The first batch seen with a sequence above 0 asks for the history from 0.
* **restart**: a sequence number at or below the last one (outside what a replay already
  delivered) means the engine restarted: the instance is purged, then the stream starts over.
* **translation**, as llm-d's kv-cache indexer does (docs/indexer.md): keys are recomputed from
  `BlockStored.token_ids` with our chain (core.cache.keys.chain_keys) continued from the key we
  mapped the event's `parent_block_hash` to; a map engine hash → our key (with a count, since vLLM
  can cache one hash in several blocks) resolves `BlockRemoved`. A BlockStored whose parent was
  never seen cannot be chained and is dropped (counted in `unresolved`).
* **purge**: AllBlocksCleared, a restart, an unfillable gap, or `mark_down()` (the caller's health
  check saw the instance go) clear the map and hand `AllBlocksCleared()` to the callback.

The callback gets `(instance_id, events)`: BlockStored with the whole chain of the event (its
keys are cached now), BlockRemoved only for keys no block of the instance holds any more, and
AllBlocksCleared. `lag()` reports the last sequence, event rate, gaps and time since the last batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from adapters.vllm.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    decode_batch,
    seq_bytes,
    seq_of,
)
from core.cache import events as ours
from core.cache.keys import BlockKey, ExtraKey, chain_keys

EventsCallback = Callable[[str, list[ours.KVEvent]], None]

RATE_WINDOW_S = 10.0
"""Events per second are counted over this trailing window."""


@dataclass(frozen=True, slots=True)
class SubscriberLag:
    """How far behind one instance's subscription is."""

    instance_id: str
    connected: bool
    last_seq: int | None
    batches: int
    events: int
    events_per_s: float
    """Over the last RATE_WINDOW_S seconds."""
    since_last_event_s: float | None
    """Seconds since the last batch arrived (None: none yet)."""
    engine_delay_s: float | None
    """Arrival time minus the engine's `ts` of the last batch (clock skew included)."""
    gaps: int
    gaps_filled: int
    gaps_unfilled: int
    duplicates: int
    restarts: int
    purges: int
    unresolved: int
    """BlockStored events dropped because their parent hash was unknown."""
    bad_messages: int
    mapped_blocks: int
    """Engine hashes currently mapped to our keys."""


class EngineKeyMap:
    """Engine block hash → our key, with how many blocks hold it; translates wire events to ours."""

    def __init__(self) -> None:
        self.keys: dict[ExternalBlockHash, BlockKey] = {}
        self.count: dict[ExternalBlockHash, int] = {}
        self.unresolved = 0

    def __len__(self) -> int:
        return len(self.keys)

    def clear(self) -> None:
        self.keys.clear()
        self.count.clear()

    def stored(self, e: BlockStored) -> ours.BlockStored | None:
        n = len(e.block_hashes)
        bs = e.block_size
        if n == 0 or bs <= 0 or len(e.token_ids) < n * bs:
            self.unresolved += 1
            return None
        parent: BlockKey | None = None
        if e.parent_block_hash is not None:
            parent = self.keys.get(e.parent_block_hash)
            if parent is None:
                self.unresolved += 1
                return None
        extras = e.extra_keys or []
        if any(x is not None for x in extras) or e.lora_name is not None:
            ours_keys: list[BlockKey] = []
            prev = parent
            for i in range(n):
                extra = _extra(e.lora_name, extras[i] if i < len(extras) else None)
                prev = chain_keys(e.token_ids[i * bs : (i + 1) * bs], bs, prev, extra)[0]
                ours_keys.append(prev)
        else:
            ours_keys = chain_keys(e.token_ids[: n * bs], bs, parent)
        for h, k in zip(e.block_hashes, ours_keys, strict=True):
            self.keys[h] = k
            self.count[h] = self.count.get(h, 0) + 1
        return ours.BlockStored(
            tuple(ours_keys), parent, tuple(e.token_ids[: n * bs]), bs, e.lora_id, e.medium, e.lora_name
        )

    def removed(self, e: BlockRemoved) -> ours.BlockRemoved | None:
        gone: list[BlockKey] = []
        for h in e.block_hashes:
            c = self.count.get(h)
            if c is None:
                continue
            if c > 1:
                self.count[h] = c - 1
                continue
            del self.count[h]
            gone.append(self.keys.pop(h))
        return ours.BlockRemoved(tuple(gone), e.medium) if gone else None

    def translate(self, batch: KVEventBatch) -> list[ours.KVEvent]:
        out: list[ours.KVEvent] = []
        for e in batch.events:
            if isinstance(e, BlockStored):
                s = self.stored(e)
                if s is not None:
                    out.append(s)
            elif isinstance(e, BlockRemoved):
                r = self.removed(e)
                if r is not None:
                    out.append(r)
            elif isinstance(e, AllBlocksCleared):
                self.clear()
                out.append(ours.AllBlocksCleared())
        return out


def _extra(lora_name: str | None, block_extra: tuple[Any, ...] | None) -> ExtraKey:
    parts: list[int | str] = [] if lora_name is None else [lora_name]
    for p in block_extra or ():
        parts.append(p if isinstance(p, int | str) else repr(p))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else tuple(parts)


class KVEventSubscriber:
    """Subscribe to one instance's KV events; `run()` until cancelled (or use start/stop)."""

    def __init__(
        self,
        instance_id: str,
        endpoint: str,
        on_events: EventsCallback,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        replay_timeout_s: float = 1.0,
        replay_on_join: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.replay_on_join = replay_on_join
        self.on_events = on_events
        self.map = EngineKeyMap()
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_seq: int | None = None
        self._dupes_above = -1
        self._dupes_upto = -1
        """Live batches in (_dupes_above, _dupes_upto] were already applied from a replay."""
        self.batches = self.events = 0
        self.gaps = self.gaps_filled = self.gaps_unfilled = 0
        self.duplicates = self.restarts = self.purges = self.bad_messages = 0
        self.last_arrival: float | None = None
        self.last_ts: float | None = None
        self._recent: deque[tuple[float, int]] = deque()
        self.connected = False

    # --- lifecycle ------------------------------------------------------------------------------
    def open(self) -> None:
        """Create and connect (or bind) the sockets; `run` calls it if needed."""
        if self._sub is not None:
            return
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.bind:
            sub.bind(self.endpoint)
            self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sub.connect(self.endpoint)
        self.connected = True

    def start(self) -> None:
        self.open()
        self._task = asyncio.create_task(self.run(), name=f"kv-events-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        self.connected = False
        if self._own_ctx:
            self._ctx.term()

    async def run(self) -> None:
        self.open()
        sub = self._sub
        assert sub is not None
        while True:
            frames = await sub.recv_multipart()
            self.handle(frames)
            if self._pending_replay is not None:
                start, trigger = self._pending_replay
                self._pending_replay = None
                await self._fill(start, trigger)

    # --- the stream -----------------------------------------------------------------------------
    _pending_replay: tuple[int, tuple[int, KVEventBatch] | None] | None = None

    def handle(self, frames: list[bytes]) -> None:
        """One live message (topic, seq, payload). A gap is left in `_pending_replay` for `run` to fill."""
        if len(frames) != 3:
            self.bad_messages += 1
            return
        _, seq_frame, payload = frames
        seq = seq_of(seq_frame)
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.bad_messages += 1
            return
        last = self.last_seq
        if last is None:
            if seq > 0 and self.replay_on_join and self.replay_endpoint:
                self._pending_replay = (0, (seq, batch))  # history first, then this batch
                return
            self._apply(seq, batch)
        elif seq == last + 1:
            self._apply(seq, batch)
        elif seq > last + 1:
            self.gaps += 1
            self._pending_replay = (last + 1, (seq, batch))
        elif self._dupes_above < seq <= self._dupes_upto:
            self.duplicates += 1
        else:
            self.restarts += 1
            self.purge()
            self.last_seq = None
            self.handle(frames)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        now = time.monotonic()
        self.last_seq = seq
        if seq > self._dupes_upto:
            self._dupes_above = self._dupes_upto = -1
        self.batches += 1
        n = len(batch.events)
        self.events += n
        self.last_arrival = now
        self.last_ts = batch.ts
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        out = self.map.translate(batch)
        if out:
            self.on_events(self.instance_id, out)

    async def _fill(self, start: int, trigger: tuple[int, KVEventBatch] | None) -> None:
        """Replay from `start`, apply what extends the stream, then the batch that triggered it."""
        got = await self._replay(start)
        joining = self.last_seq is None
        expected = start
        if joining and got:
            expected = max(start, got[0][0])  # a late joiner takes what the buffer still has
        complete = True
        for seq, batch in got:
            if seq < expected:
                continue
            if seq > expected:
                complete = False
                break
            self._apply(seq, batch)
            expected = seq + 1
        high = expected - 1
        if trigger is not None and expected < trigger[0] and not (joining and not got):
            complete = False
        if not complete:
            self.gaps_unfilled += 1
            self.purge()
            expected = trigger[0] if trigger is not None else expected
        elif not joining:
            self.gaps_filled += 1
        if trigger is not None and trigger[0] >= expected:
            self._apply(*trigger)
        if high >= 0 and trigger is not None and high > trigger[0]:
            self._dupes_above, self._dupes_upto = trigger[0], high
            self.last_seq = high

    async def _replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        """Batches from `start` on, as the replay socket answers (empty on timeout or without one)."""
        if not self.replay_endpoint:
            return []
        if self._dealer is None:
            d = self._dealer = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(self.replay_endpoint)
        dealer = self._dealer
        await dealer.send_multipart((b"", seq_bytes(start)))
        out: list[tuple[int, KVEventBatch]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0 or not await dealer.poll(left * 1000):
                # no (complete) answer: drop the socket so a late answer cannot leak into the next replay
                dealer.close(linger=0)
                self._dealer = None
                return out
            frames = await dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                frames = frames[1:]  # vLLM 0.32 puts the topic first; older versions did not
            if len(frames) != 2:
                self.bad_messages += 1
                continue
            seq = seq_of(frames[0])
            if seq < 0 or not frames[1]:
                return out
            try:
                out.append((seq, decode_batch(frames[1])))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.bad_messages += 1

    # --- purge and report -----------------------------------------------------------------------
    def purge(self) -> None:
        """Forget every block of this instance and tell the callback."""
        self.purges += 1
        self.map.clear()
        self.on_events(self.instance_id, [ours.AllBlocksCleared()])

    def mark_down(self) -> None:
        """The instance is gone (health check): purge; its next batch starts the stream over."""
        self.purge()
        self.last_seq = None
        self._dupes_above = self._dupes_upto = -1

    def lag(self) -> SubscriberLag:
        now = time.monotonic()
        recent = sum(n for t, n in self._recent if t >= now - RATE_WINDOW_S)
        return SubscriberLag(
            self.instance_id,
            self.connected,
            self.last_seq,
            self.batches,
            self.events,
            recent / RATE_WINDOW_S,
            None if self.last_arrival is None else now - self.last_arrival,
            None if self.last_ts is None else time.time() - self.last_ts - (now - (self.last_arrival or now)),
            self.gaps,
            self.gaps_filled,
            self.gaps_unfilled,
            self.duplicates,
            self.restarts,
            self.purges,
            self.map.unresolved,
            self.bad_messages,
            len(self.map),
        )
