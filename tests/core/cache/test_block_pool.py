"""One instance's block pool on hand-built states: hits, caps, LRU eviction, reset, events, stats."""

from __future__ import annotations

import random

import pytest

from core.cache.block_pool import PrefixBlockPool
from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from core.cache.keys import chain_keys

BS = 4


def toks(*blocks: int, tail: int = 0) -> list[int]:
    """Token ids: a block of 4 equal ids per argument, then ``tail`` more (a partial block)."""
    out = [t for b in blocks for t in [b] * BS]
    return out + [999] * tail


def keys_of(tokens: list[int]) -> list[int]:
    return chain_keys(tokens, BS)


def test_shared_prefix_hit_and_stats() -> None:
    pool = PrefixBlockPool(num_blocks=20, block_size=BS)
    a = toks(1, 2, 3, tail=2)
    first = pool.allocate("a", keys_of(a), len(a))
    assert first is not None and first.cached_tokens == 0 and first.new_blocks == 4
    b = toks(1, 2, 7, tail=1)
    second = pool.allocate("b", keys_of(b), len(b))
    assert second is not None
    assert (second.cached_blocks, second.cached_tokens, second.computed_tokens) == (2, 8, 5)
    assert second.new_blocks == 2  # block (1,2,7) and the partial tail
    assert pool.block_ids("b")[:2] == pool.block_ids("a")[:2]  # the same physical blocks
    assert (pool.stats.requests, pool.stats.queries, pool.stats.hits) == (2, 14 + 13, 8)
    assert pool.stats.hit_rate == pytest.approx(8 / 27)


def test_a_prompt_of_two_and_a_half_blocks_caches_two() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    p = toks(1, 2, tail=2)
    pool.allocate("a", keys_of(p), len(p), token_ids=p)
    assert pool.num_cached_blocks == 2
    (stored,) = pool.drain_events()
    assert stored == BlockStored(tuple(keys_of(p)), None, tuple(p[:8]), BS)
    assert stored.blocks()[1] == (keys_of(p)[1], (2, 2, 2, 2))
    pool.free("a")
    again = pool.allocate("b", keys_of(p), len(p))
    assert again is not None and again.cached_tokens == 8 and again.computed_tokens == 2


def test_the_last_token_is_always_computed() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    p = toks(1, 2)  # exactly two full blocks
    ks = keys_of(p)
    pool.allocate("a", ks, len(p))
    pool.free("a")
    assert pool.cached_prefix_blocks(ks) == 2  # both cached...
    assert pool.cached_tokens(ks, len(p)) == 4  # ...but a hit stops at (8 - 1) // 4 = 1 block
    again = pool.allocate("b", ks, len(p))
    assert again is not None and again.cached_blocks == 1 and again.computed_tokens == 4
    # the recomputed block is cached again under the same key: vLLM does not de-duplicate
    events = pool.drain_events()
    assert events[-1] == BlockStored((ks[1],), ks[0], (), BS)
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 9 - 2
    # a single-token prompt never hits
    assert pool.max_hit_blocks(1) == 0


def test_lru_eviction_order_tail_of_a_prefix_first() -> None:
    pool = PrefixBlockPool(num_blocks=7, block_size=BS)  # 6 usable blocks
    a = toks(1, 2, 3, tail=1)  # 3 cached blocks + 1 partial
    ka = keys_of(a)
    pool.allocate("a", ka, len(a))
    ba = pool.block_ids("a")
    pool.drain_events()
    pool.free("a")
    # the uncached partial block goes to the head, the cached ones to the tail, tail block first
    q = pool.free_queue()
    assert q[0] == ba[3]
    assert q[-3:] == [ba[2], ba[1], ba[0]]
    # a request of 4 fresh blocks takes the partial block, the 2 never-used blocks, then evicts
    # the cached tail block of "a" (key ka[2]) -- not its head
    c = toks(8, 9, 10, 11)
    alloc = pool.allocate("c", keys_of(c), len(c))
    assert alloc is not None and alloc.evicted_blocks == 1
    events = pool.drain_events()
    assert events[0] == BlockRemoved((ka[2],))
    assert pool.cached_prefix_blocks(ka) == 2
    # more pressure: the next eviction is ka[1], then ka[0]
    pool.free("c")
    pool.drain_events()
    d = toks(20, 21, 22, 23, 24, tail=1)
    assert pool.allocate("d", keys_of(d), len(d)) is not None
    removed = [e.keys[0] for e in pool.drain_events() if isinstance(e, BlockRemoved)]
    assert removed[:2] == [ka[1], ka[0]]
    assert pool.cached_prefix_blocks(ka) == 0


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    a = toks(1, 2, tail=1)
    pool.allocate("a", keys_of(a), len(a))
    ba = pool.block_ids("a")
    pool.free("a")
    assert set(ba) <= set(pool.free_queue())
    free_before = pool.num_free_blocks
    b = toks(1, 2, tail=3)
    alloc = pool.allocate("b", keys_of(b), len(b))
    assert alloc is not None and alloc.cached_blocks == 2
    assert ba[0] not in pool.free_queue() and ba[1] not in pool.free_queue()
    assert pool.num_free_blocks == free_before - 3  # two touched + one new
    # freeing again puts them back at the tail, most recently used last
    pool.free("b")
    assert pool.free_queue()[-2:] == [ba[1], ba[0]]


def test_hits_on_free_blocks_count_against_free_space() -> None:
    pool = PrefixBlockPool(num_blocks=4, block_size=BS)  # 3 usable
    a = toks(1, 2, tail=1)
    pool.allocate("a", keys_of(a), len(a))
    pool.free("a")
    big = toks(1, 2, 3, tail=1)  # hits 2 free cached blocks, needs 2 new: 4 > 3 free
    assert pool.blocks_needed(keys_of(big), len(big)) == 4
    queue, stats = pool.free_queue(), (pool.stats.requests, pool.stats.queries)
    pool.drain_events()
    assert pool.allocate("big", keys_of(big), len(big)) is None
    assert pool.free_queue() == queue and (pool.stats.requests, pool.stats.queries) == stats
    assert pool.drain_events() == [] and pool.requests == []
    fits = toks(1, 2, tail=2)
    assert pool.allocate("fits", keys_of(fits), len(fits)) is not None


def test_decode_growth_and_commit_of_new_full_blocks() -> None:
    pool = PrefixBlockPool(num_blocks=4, block_size=BS)  # 3 usable
    p = toks(1, tail=3)  # 7 tokens
    ks = keys_of(p)
    pool.allocate("r", ks, len(p), token_ids=p)
    assert len(pool.block_ids("r")) == 2
    assert pool.append_tokens("r", 1, token_ids=[50])  # 8 tokens: block 2 is full, no new block
    assert len(pool.block_ids("r")) == 2
    assert pool.append_tokens("r", 1, token_ids=[51])  # 9: a third block
    assert len(pool.block_ids("r")) == 3 and pool.usage == 1.0
    assert not pool.append_tokens("r", 4)  # 13 tokens would need a fourth
    assert pool.num_tokens("r") == 9
    pool.drain_events()
    full = [*p, 50]
    chain = keys_of(full)
    assert pool.commit_full_blocks("r", chain) == 1
    assert pool.drain_events() == [BlockStored((chain[1],), chain[0], tuple(full[4:8]), BS)]
    assert pool.commit_full_blocks("r", chain) == 0


def test_delayed_commit_for_a_transfer_in_flight() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    p = toks(1, 2, 3, tail=1)
    pool.allocate("r", keys_of(p), len(p), commit=False)
    assert pool.drain_events() == [] and pool.num_cached_blocks == 0
    assert pool.commit_full_blocks("r", keys_of(p)) == 3
    (stored,) = pool.drain_events()
    assert isinstance(stored, BlockStored) and stored.keys == tuple(keys_of(p))


def test_reset_refused_while_in_use_then_succeeds() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    p = toks(1, 2, tail=1)
    pool.allocate("a", keys_of(p), len(p))
    pool.drain_events()
    assert not pool.reset()
    assert pool.drain_events() == [] and pool.num_cached_blocks == 2
    pool.free("a")
    assert pool.reset()
    assert pool.drain_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0 and pool.stats.resets == 1
    again = pool.allocate("b", keys_of(p), len(p))
    assert again is not None and again.cached_tokens == 0


def test_events_in_order() -> None:
    pool = PrefixBlockPool(num_blocks=4, block_size=BS)  # 3 usable
    a = toks(1, 2, 3, tail=1)[:12]  # 3 full blocks, no tail
    ka = keys_of(a)
    pool.allocate("a", ka, len(a))
    pool.free("a")
    b = toks(5, 6, tail=1)
    kb = keys_of(b)
    pool.allocate("b", kb, len(b))
    pool.free("b")
    assert pool.reset()
    assert pool.drain_events() == [
        BlockStored(tuple(ka), None, (), BS),
        BlockRemoved((ka[2],)),
        BlockRemoved((ka[1],)),
        BlockRemoved((ka[0],)),
        BlockStored(tuple(kb), None, (), BS),
        AllBlocksCleared(),
    ]
    assert pool.drain_events() == []


def test_a_key_held_by_two_blocks_stays_cached_until_both_are_evicted() -> None:
    pool = PrefixBlockPool(num_blocks=8, block_size=BS)
    p = toks(1, 2)
    ks = keys_of(p)
    pool.allocate("a", ks, len(p))
    pool.allocate("b", ks, len(p))  # hits block 0 only, caches a second copy of block 1
    pool.free("a")
    pool.free("b")
    pool.drain_events()
    fresh = toks(30, 31, 32, 33, 34)  # uses the 4 never-used blocks, then 1 cached block
    pool.allocate("c", keys_of(fresh), len(fresh))
    removed = [e for e in pool.drain_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((ks[1],))]
    assert pool.cached_prefix_blocks(ks) == 2  # the other copy still holds it


def test_usage_and_the_null_block() -> None:
    pool = PrefixBlockPool(num_blocks=5, block_size=BS)
    assert pool.capacity == 4 and pool.usage == 0.0
    pool.allocate("a", [], 5)  # 2 blocks
    assert pool.usage == 0.5
    assert 0 not in pool.block_ids("a") and 0 not in pool.free_queue()


def test_caching_disabled_never_hits_nor_emits() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS, enable_caching=False)
    p = toks(1, 2, tail=1)
    pool.allocate("a", keys_of(p), len(p))
    pool.free("a")
    again = pool.allocate("b", keys_of(p), len(p))
    assert again is not None and again.cached_tokens == 0
    assert pool.drain_events() == [] and pool.stats.queries == 0


def test_preempted_lookups_are_counted_apart() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    p = toks(1, 2, tail=1)
    pool.allocate("a", keys_of(p), len(p))
    pool.free("a")
    pool.allocate("a", keys_of(p), len(p), preempted=True)
    st = pool.stats
    assert (st.requests, st.queries, st.hits) == (1, 9, 0)
    assert (st.preempted_requests, st.preempted_queries, st.preempted_hits) == (1, 9, 8)


def test_bad_calls() -> None:
    pool = PrefixBlockPool(num_blocks=10, block_size=BS)
    pool.allocate("a", [], 3)
    with pytest.raises(ValueError, match="already"):
        pool.allocate("a", [], 3)
    with pytest.raises(ValueError, match="positive"):
        pool.allocate("z", [], 0)
    with pytest.raises(ValueError, match="null block"):
        PrefixBlockPool(num_blocks=1, block_size=BS)
    pool.free("never-seen")  # ignored, as vLLM does


def test_random_workload_keeps_the_books() -> None:
    """Invariants under churn: every block is free xor referenced, and a cached key's blocks carry it."""
    rng = random.Random(7)
    pool = PrefixBlockPool(num_blocks=40, block_size=BS)
    prefixes = [[rng.randrange(50) for _ in range(BS * 3)] for _ in range(4)]
    live: list[str] = []
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 6):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            p = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            rid = f"r{step}"
            if pool.allocate(rid, keys_of(p), len(p)) is not None:
                live.append(rid)
        held = [b for r in live for b in pool.block_ids(r)]
        free = pool.free_queue()
        assert set(held).isdisjoint(free)
        assert len(set(held)) + len(free) == pool.capacity
        for r in live:
            for b in pool.block_ids(r):
                k = pool.key_of(b)
                assert k is None or k in pool
