"""vLLM 0.32's KV-event wire format, our publisher, and the per-instance subscriber (gaps, restarts, clears).

The wire checks decode by position and field name with plain msgpack, written against vLLM's
message layout (vllm/distributed/kv_events.py in 0.32.0), not with our structs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from adapters.emulator.kv_publisher import KVEventPublisher
from adapters.vllm.kv_events import KVEventSubscriber
from adapters.vllm.kv_wire import KVEventsConfig, decode_batch
from core.cache import events as ours
from core.cache.keys import chain_keys
from core.errors import ConfigError

BS = 4


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def stored(tokens: list[int], parent: int | None = None) -> ours.BlockStored:
    keys = chain_keys(tokens, BS, parent)
    return ours.BlockStored(tuple(keys), parent, tuple(tokens), BS)


def config(tmp: Path, name: str = "e", topic: str = "") -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp}/{name}-pub",
        replay_endpoint=f"ipc://{tmp}/{name}-replay",
        buffer_steps=100,
        topic=topic,
    )


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- the wire format, decoded independently ---------------------------------------------------


def test_a_batch_goes_out_as_three_frames_in_vllms_layout(tmp_path: Path) -> None:
    async def main() -> None:
        pub = KVEventPublisher(config(tmp_path, topic="kv"))
        pub.start()
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        await asyncio.sleep(0.2)  # let the subscription reach the publisher
        first = stored([1, 2, 3, 4, 5, 6, 7, 8])
        pub.publish([first, ours.BlockRemoved((first.keys[1], first.keys[0])), ours.AllBlocksCleared()], ts=123.5)
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == 0
        raw = msgspec.msgpack.decode(payload)  # plain msgpack: no struct types
        assert isinstance(raw, list) and raw[0] == 123.5 and raw[2] == 0  # [ts, events, data_parallel_rank]
        events = raw[1]
        assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared"]
        s = events[0]
        assert s["block_hashes"] == [k % 2**64 for k in first.keys] and s["parent_block_hash"] is None
        assert s["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8] and s["block_size"] == BS
        assert s["lora_id"] is None and s["medium"] == "GPU" and s["lora_name"] is None
        assert s["extra_keys"] == [None, None] and s["group_idx"] == 0 and s["kv_cache_spec_kind"] == "full_attention"
        assert set(s) == {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        }  # defaults omitted, as msgspec omit_defaults does
        assert events[1] == {
            "type": "BlockRemoved",
            "block_hashes": [first.keys[1] % 2**64],
            "medium": "GPU",
            "group_idx": 0,
        }
        assert events[3] == {"type": "AllBlocksCleared"}
        pub.publish([stored([9, 9, 9, 9])])
        assert int.from_bytes((await asyncio.wait_for(sub.recv_multipart(), 5))[1], "big") == 1

        # replay: one 8-byte start, answered (topic, seq, payload) per batch, then (b"", -1, b"")
        dealer = ctx.socket(zmq.DEALER)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(2)]
        assert got[0][0] == b"" and got[0][1] == b"kv" and int.from_bytes(got[0][2], "big") == 1
        assert msgspec.msgpack.decode(got[0][3])[1][0]["token_ids"] == [9, 9, 9, 9]
        assert got[1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        for sock in (sub, dealer):
            sock.close(0)
        ctx.term()
        await pub.stop()

    run(main())


def test_the_older_all_array_event_layout_still_decodes() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [7, 8], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.0 and batch.data_parallel_rank is None
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_kv_events_config_reads_vllms_json() -> None:
    c = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", "topic": "t"}'
    )
    assert c.active and c.publisher == "zmq" and c.buffer_steps == 10_000 and c.hwm == 100_000
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}').publisher == "null"
    assert not KVEventsConfig.parse(None).active
    r2 = c.for_rank(2)
    assert r2.endpoint == "tcp://*:6002" and r2.replay_endpoint == "tcp://*:6003"
    assert KVEventsConfig(True, endpoint="ipc:///tmp/x").for_rank(1).endpoint == "ipc:///tmp/x_dp1"
    for bad in (
        '{"enable_kv_cache_events": true, "bogus": 1}',
        '{"buffer_steps": 0}',
        "[1]",
        "{nope",
        '{"publisher": "kafka"}',
    ):
        with pytest.raises(ConfigError):
            KVEventsConfig.parse(bad)


# --- the subscriber -----------------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.events: list[ours.KVEvent] = []

    def __call__(self, instance: str, events: list[ours.KVEvent]) -> None:
        assert instance == "p0"
        self.events.extend(events)

    def held(self) -> set[int]:
        """The keys the instance holds according to the events so far."""
        keys: set[int] = set()
        for e in self.events:
            if isinstance(e, ours.BlockStored):
                keys.update(e.keys)
            elif isinstance(e, ours.BlockRemoved):
                keys.difference_update(e.keys)
            else:
                keys.clear()
        return keys


async def pair(tmp: Path, sink: Sink, **kw: Any) -> tuple[KVEventPublisher, KVEventSubscriber]:
    cfg = config(tmp)
    pub = KVEventPublisher(cfg)
    pub.start()
    sub = KVEventSubscriber("p0", cfg.endpoint, sink, replay_endpoint=cfg.replay_endpoint, **kw)
    sub.start()
    await asyncio.sleep(0.2)
    return pub, sub


def with_pair(tmp: Path, body: Callable[[KVEventPublisher, KVEventSubscriber, Sink], Awaitable[None]]) -> None:
    async def main() -> None:
        sink = Sink()
        pub, sub = await pair(tmp, sink)
        try:
            await body(pub, sub, sink)
        finally:
            await sub.stop()
            await pub.stop()

    run(main())


def test_subscriber_translates_to_our_keys_and_resolves_removals(tmp_path: Path) -> None:
    async def body(pub: KVEventPublisher, sub: KVEventSubscriber, sink: Sink) -> None:
        a = stored([1, 2, 3, 4, 5, 6, 7, 8])
        b = stored([9, 10, 11, 12], parent=a.keys[-1])  # continues a's chain
        pub.publish([a])
        pub.publish([b, ours.BlockRemoved((a.keys[1],))])
        await until(lambda: sub.last_seq == 1)
        assert sink.held() == {a.keys[0], b.keys[0]}
        assert (
            isinstance(sink.events[1], ours.BlockStored)
            and sink.events[1].keys == b.keys
            and sink.events[1].parent_key == a.keys[1]
        )
        lag = sub.lag()
        assert (
            lag.batches == 2
            and lag.events == 3
            and lag.gaps == 0
            and lag.since_last_event_s is not None
            and lag.events_per_s > 0
        )
        orphan = stored([5, 5, 5, 5], parent=12345)  # its parent was never stored: cannot be chained
        pub.publish([orphan])
        await until(lambda: sub.last_seq == 2)
        assert sub.lag().unresolved == 1 and orphan.keys[0] not in sink.held()

    with_pair(tmp_path, body)


def test_a_gap_is_filled_from_the_replay_socket(tmp_path: Path) -> None:
    async def body(pub: KVEventPublisher, sub: KVEventSubscriber, sink: Sink) -> None:
        a, b, c = stored([1] * 4), stored([2] * 4), stored([3] * 4)
        pub.publish([a])
        await until(lambda: sub.last_seq == 0)
        real = pub._pub

        class Lost:  # the PUB drops this batch (as at the high-water mark); the replay buffer keeps it
            def send_multipart(self, *args: Any, **kw: Any) -> None:
                pass

        pub._pub = Lost()  # type: ignore[assignment]
        pub.publish([b, ours.BlockRemoved(a.keys)])
        pub._pub = real
        pub.publish([c])
        await until(lambda: sub.last_seq == 2)
        lag = sub.lag()
        assert lag.gaps == 1 and lag.gaps_filled == 1 and lag.gaps_unfilled == 0 and lag.purges == 0
        assert sink.held() == {b.keys[0], c.keys[0]}

    with_pair(tmp_path, body)


def test_a_gap_the_replay_cannot_fill_purges_the_instance(tmp_path: Path) -> None:
    async def body(pub: KVEventPublisher, sub: KVEventSubscriber, sink: Sink) -> None:
        pub.publish([stored([1] * 4)])
        await until(lambda: sub.last_seq == 0)
        pub.seq = 5  # batches 1-4 never existed anywhere: the replay cannot give them
        pub.publish([stored([2] * 4)])
        await until(lambda: sub.last_seq == 5)
        lag = sub.lag()
        assert lag.gaps == 1 and lag.gaps_unfilled == 1 and lag.purges == 1
        assert sink.held() == {chain_keys([2] * 4, BS)[0]}  # the old block was purged, the new batch kept

    with_pair(tmp_path, body)


def test_a_restart_purges_the_instance_and_all_blocks_cleared_too(tmp_path: Path) -> None:
    async def main() -> None:
        sink = Sink()
        pub, sub = await pair(tmp_path, sink)
        try:
            for i in range(3):
                pub.publish([stored([i] * 4)])
            await until(lambda: sub.last_seq == 2)
            assert len(sink.held()) == 3
            await pub.stop()  # the engine restarts: a new publisher counts from 0 again
            pub = KVEventPublisher(config(tmp_path))
            pub.start()
            await asyncio.sleep(0.3)
            fresh = stored([7] * 4)
            pub.publish([fresh])
            await until(lambda: sub.lag().restarts == 1 and sub.last_seq == 0)
            assert sink.held() == {fresh.keys[0]} and sub.lag().purges == 1
            pub.publish([ours.AllBlocksCleared()])
            await until(lambda: sub.last_seq == 1)
            assert sink.held() == set() and len(sub.map) == 0
            sub.mark_down()  # the caller's health check saw it go
            assert isinstance(sink.events[-1], ours.AllBlocksCleared) and sub.last_seq is None
        finally:
            await sub.stop()
            await pub.stop()

    run(main())


def test_a_late_subscriber_reads_the_history_from_the_replay_buffer(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = config(tmp_path)
        pub = KVEventPublisher(cfg)
        pub.start()
        early = [stored([i] * 4) for i in range(3)]
        for e in early:
            pub.publish([e])  # nobody listens yet
        sink = Sink()
        sub = KVEventSubscriber("p0", cfg.endpoint, sink, replay_endpoint=cfg.replay_endpoint)
        sub.start()
        await asyncio.sleep(0.2)
        last = stored([9] * 4)
        pub.publish([last])
        await until(lambda: sub.last_seq == 3)
        assert sink.held() == {e.keys[0] for e in [*early, last]} and sub.lag().gaps == 0
        await sub.stop()
        await pub.stop()

    run(main())
