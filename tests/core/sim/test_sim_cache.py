"""The cluster simulator's KV cache: prefix hits shorten prefill where they are, decode pulls only what it lacks, LRU
eviction, decode-only service, determinism."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.cache.keys import chain_keys
from core.dispatch import Dispatcher
from core.perf import PerfProfile
from core.sim.cluster import ClusterSimResult, ClusterSimulation
from core.sim.cluster.cache import CacheParams
from core.traces.prompts import hash_prompt
from tests.helpers import toy_profile

MS = 0.001
"""Prefill seconds per token of the test profile (no fixed cost), so times are token counts."""
XFER = 0.0001
"""KV transfer seconds per token."""


def profile(**kw: Any) -> PerfProfile:
    base: dict[str, Any] = dict(
        prefill_base_s=0.0, prefill_per_token_s=MS, kv_transfer_per_token_s=XFER, max_model_len=8192
    )
    base.update(kw)
    return toy_profile(**base)


def simulate(
    rows: list[tuple[float, list[int], int]],
    *,
    policy: str = "round_robin",
    params: dict[str, Any] | None = None,
    n_prefill: int = 1,
    n_decode: int = 1,
    cache: CacheParams | None = None,
    prof: PerfProfile | None = None,
    hash_ids: bool = True,
    mode: str = "ps",
    lora: list[str | None] | None = None,
) -> ClusterSimResult:
    """rows: (arrival, hash ids, prompt tokens); every request generates 2 tokens; `lora`: each row's adapter."""
    prof = prof or profile()
    d = Dispatcher(prof, policy, params, true_lengths=True)
    sim = ClusterSimulation(
        arrivals=np.array([r[0] for r in rows]),
        prompt_tokens=np.array([r[2] for r in rows]),
        output_tokens=np.full(len(rows), 2),
        profile=prof,
        n_prefill=n_prefill,
        n_decode=n_decode,
        dispatcher=d,
        mode=mode,  # type: ignore[arg-type]
        hash_ids=[r[1] for r in rows] if hash_ids else None,
        cache=cache or CacheParams(hash_block_tokens=16),
        lora=lora,
    )
    return sim.run()


def prefill_s(r: ClusterSimResult) -> np.ndarray:
    out: np.ndarray = r.prefill_end - r.prefill_start
    return out


def test_a_shared_prefix_shortens_prefill_by_the_cached_blocks() -> None:
    # one hash id = one 16-token block; B shares A's first 2 blocks, C shares nothing
    r = simulate([(0.0, [1, 2, 3], 48), (10.0, [1, 2, 4], 48), (20.0, [5, 6, 7], 48)])
    assert r.cached_tokens.tolist() == [0, 32, 0]
    assert prefill_s(r) == pytest.approx([48 * MS, 16 * MS, 48 * MS])
    assert r.hit_rate == pytest.approx(32 / 144)
    assert r.cache_hit_rates["p0"] == pytest.approx(32 / 144)


def test_the_hit_lands_only_on_the_instance_holding_the_prefix() -> None:
    # round robin over prefill instances is not what places prefills (least queued work does):
    # with both idle the first goes to p0, the second (p0 idle again) to p0 as well; force p1
    # by a third request arriving while p0 is busy
    rows = [(0.0, [1, 2, 3], 48), (0.01, [1, 2, 3], 48), (10.0, [1, 2, 3], 48)]
    r = simulate(rows, n_prefill=2)
    assert r.prefill_instance.tolist() == [0, 1, 0]
    # the second ran on p1, which held nothing; the third on p0 again: a hit capped at prompt - 1
    assert r.cached_tokens.tolist() == [0, 0, 32]


def test_partial_blocks_are_not_cached_and_a_hit_is_capped_below_the_prompt() -> None:
    # A: 40 tokens = 2 full blocks + 8; only the 2 full ones are cached
    # B: the same 3 hash ids, 48 tokens: hits 2 blocks (its third block was partial in A)
    # C: exactly A's 2 full blocks (32 tokens): the hit is capped at 31 tokens -> 1 block
    r = simulate([(0.0, [1, 2, 3], 40), (10.0, [1, 2, 3], 48), (20.0, [1, 2], 32)])
    assert r.cached_tokens.tolist() == [0, 32, 16]
    assert prefill_s(r) == pytest.approx([40 * MS, 16 * MS, 16 * MS])


def test_lru_eviction_under_pressure() -> None:
    # 4 blocks per instance. A caches k1 k2; B (3 new blocks) takes the 2 never-used blocks and
    # evicts A's tail k2 (freed tail first, so least recently used); C then finds k1 only.
    cache = CacheParams(hash_block_tokens=16, capacity_blocks=4)
    rows = [(0.0, [1, 2], 32), (10.0, [3, 4, 5], 48), (20.0, [1, 2], 33)]
    r = simulate(rows, cache=cache)
    assert r.cached_tokens.tolist() == [0, 0, 16]
    roomy = simulate(rows, cache=CacheParams(hash_block_tokens=16, capacity_blocks=64))
    assert roomy.cached_tokens.tolist() == [0, 0, 32]


def test_the_decode_side_pulls_only_the_blocks_it_lacks() -> None:
    # 1P2D in turn (round robin): A and C decode on d0, B on d1. C shares A's 2 blocks, which
    # d0 cached when A's KV arrived: it pulls 49 - 32 = 17 tokens; B pulls everything.
    rows = [(0.0, [1, 2], 33), (10.0, [1, 2], 33), (20.0, [1, 2, 3], 49)]
    r = simulate(rows, n_decode=2)
    assert r.decode_instance.tolist() == [0, 1, 0]
    assert r.decode_cached_tokens.tolist() == [0, 0, 32]
    assert r.kv_transferred_tokens.tolist() == [33, 33, 17]
    transfer = r.decode_start - r.prefill_end
    assert transfer == pytest.approx([33 * XFER, 33 * XFER, 17 * XFER])


def test_without_hash_ids_or_with_the_cache_off_nothing_is_shared() -> None:
    rows = [(0.0, [1, 2, 3], 48), (10.0, [1, 2, 3], 48)]
    for r in (simulate(rows, hash_ids=False), simulate(rows, cache=CacheParams(enabled=False))):
        assert r.cached_tokens.tolist() == [0, 0]
        assert r.kv_transferred_tokens.tolist() == [48, 48]
        assert prefill_s(r) == pytest.approx([48 * MS, 48 * MS])
        assert r.cache_hit_rates == {}


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [("a1", None, False), (None, "a1", False), ("a1", "a2", False), ("a1", "a1", True), (None, None, True)],
)
def test_a_prefix_cached_under_one_adapter_is_found_only_under_the_same_adapter(
    first: str | None, second: str | None, hit: bool
) -> None:
    # 1P1D, one 16-token block per hash id. B repeats A's 4 hash blocks and adds a fifth (80 tokens). Under
    # A's adapter B finds A's 64 tokens on p0 and on d0 (it computes 16 and pulls 16); under another
    # adapter or the base model (vLLM 0.32 hashes the adapter's name into every block) nothing: it computes
    # and pulls all 80.
    rows = [(0.0, [1, 2, 3, 4], 64), (10.0, [1, 2, 3, 4, 5], 80)]
    r = simulate(rows, lora=[first, second])
    assert r.ok.all()
    assert r.cached_tokens.tolist() == [0, 64 if hit else 0]
    assert r.decode_cached_tokens.tolist() == [0, 64 if hit else 0]
    assert r.kv_transferred_tokens.tolist() == [64, 16 if hit else 80]
    assert r.cache_lookups["p0"] == (144, 64 if hit else 0)


def test_hit_rate_on_a_tiny_mooncake_like_trace_equals_the_hand_computation() -> None:
    # Mooncake's own 512-token hash blocks, 16-token KV blocks, one prefill instance, rows far apart
    rows = [(0.0, [1, 2], 1000), (30.0, [1, 2, 3], 1500), (60.0, [4], 300), (90.0, [1, 5], 700)]
    r = simulate(rows, cache=CacheParams())
    # r1 shares hash blocks 1-2 (1024 tokens) but r0 cached only its full KV blocks: 1000 // 16 = 62
    # r3 shares hash block 1: 512 tokens = 32 KV blocks
    assert r.cached_tokens.tolist() == [0, 62 * 16, 0, 512]
    assert r.hit_rate == pytest.approx((992 + 512) / 3500)
    assert r.cache_lookups["p0"] == (3500, 1504)


def test_keys_equal_the_emulators_on_a_replay_with_the_same_seed() -> None:
    from core.cache.trace_keys import TraceKeys

    tk = TraceKeys(16, seed=(7, 0))
    for row, (ids, n) in enumerate([([1, 2], 1000), ([1, 2, 3], 1500), ([9], 200), ([], 40)]):
        want = chain_keys(hash_prompt(ids, n, seed=(7, 0), row=row).tolist(), 16)
        got = tk.keys(ids, n, row)
        shared = min(len(ids) * 512, n) // 16  # past the hash blocks a row's blocks are its own
        assert len(got) == len(want) and got[:shared] == tuple(want[:shared])


def test_decode_only_requests_are_computed_on_the_decode_instance() -> None:
    params = {"decode_only_min_share": 0.5, "decode": "least_load"}
    rows = [(0.0, [1, 2, 3, 4], 64), (10.0, [1, 2, 3, 4, 5], 80)]
    r = simulate(rows, policy="prefix_pd", params=params)
    # B: d0 holds A's 4 blocks (64 of 80 tokens >= 50%): no prefill leg, d0 computes 16 tokens
    assert r.prefill_instance.tolist() == [0, -1]
    assert r.decode_instance.tolist() == [0, 0]
    assert r.cached_tokens.tolist() == [0, 64]
    assert r.kv_transferred_tokens.tolist() == [64, 0]
    assert r.decode_start[1] - r.arrival[1] == pytest.approx(16 * MS)
    assert r.ok.all()


@pytest.mark.parametrize("mode", ["ps", "iteration"])
@pytest.mark.parametrize("policy", ["prefix_aware", "prefix_pd", "session_affinity", "oracle"])
def test_runs_are_deterministic(policy: str, mode: str) -> None:
    rng = np.random.default_rng(3)
    rows = []
    convs: dict[int, list[int]] = {}
    t = 0.0
    for i in range(120):
        c = int(rng.integers(0, 8))
        convs[c] = convs.get(c, []) + [1000 * c + i, 1000 * c + i + 500]
        t += float(rng.exponential(0.05))
        rows.append((t, list(convs[c]), len(convs[c]) * 16 - 3))
    kw: dict[str, Any] = dict(
        policy=policy, n_prefill=2, n_decode=2, mode=mode, cache=CacheParams(hash_block_tokens=16, capacity_blocks=96)
    )
    a, b = simulate(rows, **kw), simulate(rows, **kw)
    for field in ("prefill_instance", "decode_instance", "cached_tokens", "kv_transferred_tokens"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert np.array_equal(a.first_token, b.first_token, equal_nan=True)
    assert a.ok.all() and a.hit_rate > 0.25  # session_affinity in iteration mode: 0.29


def test_hot_swaps_to_and_from_prefix_policies_in_a_run() -> None:
    from core.sim.cluster import ScheduledSwap

    prof = profile()
    rows = [(float(i), [1, 2, 3, 10 + i], 64) for i in range(12)]
    d = Dispatcher(prof, "least_load", true_lengths=True)
    swaps = [
        ScheduledSwap(3.5, "prefix_pd", {"decode_only_min_share": 0.7, "decode": "least_load"}),
        ScheduledSwap(7.5, "least_load"),
        ScheduledSwap(9.5, "oracle"),
    ]
    sim = ClusterSimulation(
        arrivals=np.array([r[0] for r in rows]),
        prompt_tokens=np.array([r[2] for r in rows]),
        output_tokens=np.full(len(rows), 2),
        profile=prof,
        n_prefill=2,
        n_decode=2,
        dispatcher=d,
        hash_ids=[r[1] for r in rows],
        cache=CacheParams(hash_block_tokens=16),
        swaps=swaps,
    )
    r = sim.run()
    assert r.ok.all()
    decode_only = (r.prefill_instance < 0).tolist()
    # only prefix_pd (requests 4..7) serves on decode alone; 48 of 64 tokens are shared (75%)
    assert not any(decode_only[:4]) and not any(decode_only[8:])
    assert any(decode_only[4:8])
    assert [e.new for e in r.policy_events][-3:] == ["prefix_pd", "least_load", "oracle"]
