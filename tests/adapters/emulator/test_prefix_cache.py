"""The emulator's prefix cache: hits and shorter prefills, LRU eviction, reset, metrics, usage, P/D,
and its KV events over real ZMQ from a real emulator process (decoded here by field, as vLLM lays them out)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.faults import Faults
from adapters.emulator.process import EmulatorProcess, running
from adapters.ports import free_port
from core.cache import events as ours
from core.cache.keys import chain_keys
from tests.emulator_fixtures import FAST_PROFILE, Events, delta, profile_file, scrape
from tests.helpers import toy_profile


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def profile(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        decode_step_base_s=0.001,
        decode_step_per_seq_s=0.0,
        prefill_base_s=0.001,
        prefill_per_token_s=0.0001,
        block_size=4,
    )
    return toy_profile(**{**base, **kw})


async def serve(engine: Engine, *seqs: Sequence) -> None:
    for s in seqs:
        engine.submit(s)
    await asyncio.gather(*(s.done.wait() for s in seqs))


def seq(name: str, ids: list[int], max_tokens: int = 1, **kw: Any) -> Sequence:
    return Sequence(name, len(ids), max_tokens, prompt_ids=ids, output_base=1_000_000, **kw)


# --- the engine, in process ---------------------------------------------------------------------


def test_a_shared_prefix_is_reused_and_only_the_rest_is_prefilled() -> None:
    async def main() -> None:
        engine = Engine(profile(), Faults())
        engine.start()
        a = seq("a", list(range(20)))
        await serve(engine, a)
        first = engine.steps[-1]
        b = seq("b", list(range(20)) + [100, 101, 102, 103])
        await serve(engine, b)
        assert a.cached_tokens == 0 and a.local_prefill_tokens == 20
        assert b.cached_tokens == 20 and b.local_prefill_tokens == 4  # five whole blocks reused
        assert engine.steps[-1].chunks == [(20, 24)]
        assert engine.steps[-1].end - engine.steps[-1].start < first.end - first.start  # a shorter prefill
        c = seq("c", list(range(20)))  # all of it cached: the last token is computed anyway, so its block is
        await serve(engine, c)
        assert c.cached_tokens == 16 and c.local_prefill_tokens == 4
        d = seq("d", [7] + list(range(1, 20)))  # differs in the first block: nothing to reuse
        await serve(engine, d)
        assert d.cached_tokens == 0
        await engine.stop()

    run(main())


def test_freed_blocks_stay_cached_and_the_least_recently_used_go_first() -> None:
    async def main() -> None:
        events: list[ours.KVEvent] = []
        engine = Engine(profile(), Faults(), kv_capacity_tokens=16, kv_events=True)  # 4 blocks of 4
        engine.kv.on_events = events.extend
        engine.start()
        pa, pb, pc = [1] * 8, [2] * 8, [3] * 8
        await serve(engine, seq("a", pa))
        await serve(engine, seq("b", pb))
        assert engine.free_blocks == engine.total_blocks  # cached blocks still count as free (evictable)
        await serve(engine, seq("c", pc))  # needs 2 blocks: a's are the least recently used
        removed = {k for e in events if isinstance(e, ours.BlockRemoved) for k in e.keys}
        a_keys = chain_keys(pa, 4)
        assert removed == set(a_keys)  # b's blocks stayed
        again_a, again_b = seq("a2", pa), seq("b2", pb)
        await serve(engine, again_b)
        await serve(engine, again_a)
        assert again_b.cached_tokens == 4 and again_a.cached_tokens == 0
        first = events[0]
        assert isinstance(first, ours.BlockStored) and list(first.keys) == a_keys and list(first.token_ids) == pa
        await engine.stop()

    run(main())


def test_reset_drops_the_cache_only_when_no_block_is_in_use() -> None:
    async def main() -> None:
        events: list[ours.KVEvent] = []
        engine = Engine(profile(), Faults(), kv_events=True)
        engine.kv.on_events = events.extend
        engine.start()
        held = seq("p", list(range(12)), prefill_only=True, hold_kv=True)
        await serve(engine, held)
        assert not engine.reset_prefix_cache()  # a prefill's KV waits to be pulled
        engine.release_held(held.blocks, held.kv_id)
        assert engine.held_blocks == 0 and engine.reset_prefix_cache()
        assert isinstance(events[-1], ours.AllBlocksCleared)
        again = seq("q", list(range(12)))
        await serve(engine, again)
        assert again.cached_tokens == 0
        await engine.stop()

    run(main())


def test_without_prefix_caching_every_prompt_is_computed_in_full() -> None:
    async def main() -> None:
        engine = Engine(profile(), Faults(), enable_prefix_caching=False)
        engine.start()
        a, b = seq("a", list(range(20))), seq("b", list(range(20)))
        await serve(engine, a)
        await serve(engine, b)
        assert b.cached_tokens == 0 and b.local_prefill_tokens == 20
        await engine.stop()

    run(main())


# --- a real emulator process ----------------------------------------------------------------------

SLOW_PREFILL = FAST_PROFILE.model_copy(update={"name": "slow-prefill", "prefill_per_token_s": 0.0005})
"""800 prompt tokens take 0.4 s to prefill; 16 of them 8 ms."""


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, Events]]:
    d = tmp_path_factory.mktemp("emu-apc")
    ev = Events()
    args = [
        "--profile",
        profile_file(d, SLOW_PREFILL),
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        ev.config(),
    ]
    try:
        with running(("both", args), log_dir=d) as (p,):
            for _ in range(
                5
            ):  # libzmq sends a bound SUB's subscription to a connecting PUB only once the SUB processes
                ev.sub.poll(100)  # its commands (a poll or recv): see zeromq/pyzmq#1650
            yield p, ev
    finally:
        ev.close()


def timed(url: str, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0, r.json()


def test_a_second_request_sharing_a_prefix_is_served_from_the_cache(
    emu: tuple[EmulatorProcess, Events], tmp_path: Path
) -> None:
    p, ev = emu
    before = scrape(p.url)
    first = list(range(800))
    second = list(range(784)) + [5000 + i for i in range(16)]
    t1, r1 = timed(p.url, first)
    t2, r2 = timed(p.url, second)
    assert r1["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 784  # 49 whole blocks of 16
    assert t1 > SLOW_PREFILL.prefill_time(800) * 0.9 and t2 < t1 / 2

    after = scrape(p.url)
    assert (
        after[
            "vllm:cache_config_info{block_size=16,enable_prefix_caching=True,kv_cache_size_tokens=65536,num_gpu_blocks=4096}"
        ]
        == 1
    )
    assert delta(after, before, "vllm:prefix_cache_queries_total") == 1600
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 784
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=local_cache_hit}") == 784
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 1600 - 784
    assert delta(after, before, "vllm:prompt_tokens_cached_total") == 784
    # as vLLM 0.32: per request, the prompt less its cached tokens
    assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_sum") == 800 + 16
    assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_count") == 2
    assert delta(after, before, "vllm:prompt_tokens_cached_by_source_total{source=device}") == 784

    (s1, e1), (s2, e2) = ev.batches(2)
    assert s2 == s1 + 1
    stored1, stored2 = e1[0], e2[0]
    assert stored1["type"] == "BlockStored" and stored1["parent_block_hash"] is None and stored1["block_size"] == 16
    assert stored1["token_ids"] == first and len(stored1["block_hashes"]) == 50
    # only the new last block is stored, chained on the 49th block of the first prompt
    assert stored2["parent_block_hash"] == stored1["block_hashes"][48] and stored2["token_ids"] == second[784:]
    assert stored2["block_hashes"] != stored1["block_hashes"][49:]
    # a consumer recomputes its own keys from token ids; the emulator's hashes are those keys mod 2**64
    assert stored1["block_hashes"] == [k % 2**64 for k in chain_keys(first, 16)]
    assert ev.replay(s1) == [s1, s2]

    reset = httpx.post(p.url + "/reset_prefix_cache", timeout=10)
    assert reset.status_code == 200 and reset.json() == {"success": True}
    ((_, cleared),) = ev.batches(1)
    assert cleared == [{"type": "AllBlocksCleared"}]
    _, r3 = timed(p.url, second)
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ev.batches(1)  # its blocks, stored again


def test_prefix_caching_can_be_turned_off(tmp_path: Path) -> None:
    with running(("both", ["--profile", profile_file(tmp_path), "--no-enable-prefix-caching"]), log_dir=tmp_path) as (
        p,
    ):
        prompt = list(range(100))
        for _ in range(2):
            assert (
                httpx.post(p.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30).status_code
                == 200
            )
        m = scrape(p.url)
        assert any("enable_prefix_caching=False" in k for k in m if k.startswith("vllm:cache_config_info"))
        assert (
            m["vllm:prefix_cache_hits_total"] == 0
            and m["vllm:prompt_tokens_by_source_total{source=local_compute}"] == 200
        )


def test_a_decode_instance_pulls_only_the_blocks_it_does_not_hold(tmp_path: Path) -> None:
    args = ["--profile", profile_file(tmp_path), "--enable-prompt-tokens-details"]
    with running(("prefill", args), ("decode", args), log_dir=tmp_path) as (p, d):

        def leg1(prompt: list[int]) -> dict[str, Any]:
            params = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            r = httpx.post(
                p.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            return r.json()["kv_transfer_params"]

        def leg2(prompt: list[int], kv: dict[str, Any]) -> dict[str, Any]:
            r = httpx.post(
                d.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "kv_transfer_params": kv},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            return r.json()

        x = list(range(320))
        kv = leg1(x)
        assert kv["remote_prefill_cached_tokens"] == 0
        leg2(x, kv)
        before = scrape(d.url)
        y = x[:304] + [9000 + i for i in range(16)]
        kv = leg1(y)
        assert kv["remote_prefill_cached_tokens"] == 304  # the prefill side reused 19 blocks
        reply = leg2(y, kv)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 304  # D reports P's hits, as vLLM does
        after = scrape(d.url)
        # D held the first 19 blocks (cached when it pulled x): it pulls only the rest
        assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=local_cache_hit}") == 304
        assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") == 16
        assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 0
        assert delta(after, before, "vllm:external_prefix_cache_queries_total") == 16
        assert delta(after, before, "vllm:external_prefix_cache_hits_total") == 16
        assert delta(after, before, "vllm:prefix_cache_hits_total") == 304
        assert scrape(p.url)["vllm:kv_cache_usage_perc"] == 0.0  # P's held blocks were freed by the pull


def test_our_subscriber_follows_a_real_emulator_across_a_restart(tmp_path: Path) -> None:
    from adapters.emulator.process import start_many
    from adapters.vllm.kv_events import KVEventSubscriber

    pub_port = free_port()
    replay_port = free_port(avoid=frozenset({pub_port}))
    cfg = json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        }
    )
    args = ["--profile", profile_file(tmp_path), "--kv-events-config", cfg]
    held: set[int] = set()

    def on_events(instance: str, events: list[ours.KVEvent]) -> None:
        for e in events:
            if isinstance(e, ours.BlockStored):
                held.update(e.keys)
            elif isinstance(e, ours.BlockRemoved):
                held.difference_update(e.keys)
            else:
                held.clear()

    async def until(cond: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def main() -> None:
        # the emulator's endpoint is not a wildcard, so (like vLLM) it connects: this subscriber binds
        sub = KVEventSubscriber(
            "e0", f"tcp://127.0.0.1:{pub_port}", on_events, replay_endpoint=f"tcp://127.0.0.1:{replay_port}", bind=True
        )
        sub.start()
        try:
            for round_, prompt in enumerate((list(range(64)), list(range(100, 164)))):
                (proc,) = await asyncio.to_thread(start_many, [("both", args)], tmp_path)
                try:
                    r = await asyncio.to_thread(
                        httpx.post, proc.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30
                    )
                    assert r.status_code == 200
                    want = set(chain_keys(prompt, 16))
                    await until(lambda want=want: held == want)  # our keys, recomputed from the events' token ids
                    assert sub.lag().restarts == round_
                finally:
                    await asyncio.to_thread(proc.stop)
            assert sub.lag().purges >= 1 and sub.lag().last_seq == 0
        finally:
            await sub.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
