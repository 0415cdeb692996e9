"""The cache index of many instances: longest-prefix match, precise events, approximate routes."""

from __future__ import annotations

import random

import pytest

from core.cache.block_pool import PrefixBlockPool
from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from core.cache.index import CacheIndex
from core.cache.keys import chain_keys
from tests.core.cache.holdings import check_with_holes, leading_held

BS = 4
CHAIN = chain_keys(list(range(40)), BS)  # 10 keys


def stored(keys: list[int]) -> BlockStored:
    return BlockStored(tuple(keys), None, (), BS)


@pytest.mark.parametrize("exact", [False, True])
def test_match_across_instances(exact: bool) -> None:
    idx = CacheIndex()
    idx.apply("p0", stored(CHAIN[:3]))
    idx.apply("p1", stored(CHAIN[:1]))
    idx.apply("p2", stored(CHAIN))
    idx.apply("p3", stored(chain_keys(list(range(100, 140)), BS)))  # unrelated prompt
    assert idx.match(CHAIN, exact=exact) == {"p0": 3, "p1": 1, "p2": 10}
    assert idx.match(CHAIN[:2], exact=exact) == {"p0": 2, "p1": 1, "p2": 2}
    assert idx.match(chain_keys(list(range(500, 520)), BS), exact=exact) == {}
    assert idx.match([], exact=exact) == {}
    assert idx.best(CHAIN) == ("p2", 10)
    assert idx.best([12345]) == (None, 0)


def test_precise_removal_shortens_the_match() -> None:
    idx = CacheIndex()
    idx.apply("p", stored(CHAIN[:6]))
    idx.apply("p", BlockRemoved((CHAIN[5], CHAIN[4])))
    assert idx.match(CHAIN) == {"p": 4}
    assert idx.num_blocks("p") == 4 and not idx.holds("p", CHAIN[5])
    idx.apply("p", BlockRemoved((999,)))  # unknown: ignored
    assert idx.num_blocks("p") == 4


def test_a_block_stored_twice_needs_two_removals() -> None:
    """vLLM does not de-duplicate identical blocks: one BlockStored and one BlockRemoved each."""
    idx = CacheIndex()
    idx.apply("p", stored(CHAIN[:2]))
    idx.apply("p", BlockStored((CHAIN[1],), CHAIN[0], (), BS))
    idx.apply("p", BlockRemoved((CHAIN[1],)))
    assert idx.match(CHAIN) == {"p": 2}
    idx.apply("p", BlockRemoved((CHAIN[1],)))
    assert idx.match(CHAIN) == {"p": 1}


def test_all_blocks_cleared_and_clear_and_remove_instance() -> None:
    idx = CacheIndex()
    idx.apply_all("a", [stored(CHAIN[:5]), AllBlocksCleared()])
    idx.apply("b", stored(CHAIN[:5]))
    assert idx.match(CHAIN) == {"b": 5} and idx.num_blocks("a") == 0
    idx.clear("b")
    assert idx.match(CHAIN) == {} and len(idx) == 0
    idx.apply("a", stored(CHAIN[:2]))
    idx.apply("b", stored(CHAIN[:3]))
    idx.remove_instance("a")
    assert idx.instances == ["b"]
    # a new instance takes the freed slot and inherits nothing
    idx.apply("c", stored(CHAIN[5:6]))
    assert idx.match(CHAIN) == {"b": 3}
    idx.remove_instance("nobody")
    idx.clear("nobody")


def test_approximate_ttl_expiry() -> None:
    idx = CacheIndex(ttl_s=10.0)
    idx.record_routed("d0", CHAIN[:4], now=0.0)
    idx.record_routed("d1", CHAIN[:2], now=5.0)
    assert idx.match(CHAIN, now=9.0) == {"d0": 4, "d1": 2}
    assert idx.match(CHAIN, now=10.0) == {"d1": 2}  # d0's entries expired at 10
    idx.record_routed("d1", CHAIN[:1], now=12.0)  # refreshes the head only
    assert idx.match(CHAIN, now=15.5) == {"d1": 1}
    assert idx.expire(100.0) == 1 and len(idx) == 0


def test_approximate_capacity_evicts_least_recently_routed_tail_first() -> None:
    idx = CacheIndex(ttl_s=None, capacity_blocks=5)
    a = chain_keys(list(range(0, 12)), BS)  # 3 blocks
    b = chain_keys(list(range(100, 112)), BS)  # 3 blocks
    idx.record_routed("d", a, now=0.0)
    idx.record_routed("d", b, now=1.0)
    assert idx.num_blocks("d") == 5
    assert idx.match(a) == {"d": 2}  # a's tail went first
    assert idx.match(b) == {"d": 3}
    idx.record_routed("d", a[:2], now=2.0)  # touch a's head: b's tail is now the oldest
    idx.record_routed("d", chain_keys(list(range(200, 204)), BS), now=3.0)
    assert idx.match(a) == {"d": 2} and idx.match(b) == {"d": 2}
    idx.set_capacity("d", 1)
    assert idx.num_blocks("d") == 1


def test_an_instance_is_either_precise_or_approximate() -> None:
    idx = CacheIndex()
    idx.apply("p", stored(CHAIN[:1]))
    idx.record_routed("r", CHAIN[:1], now=0.0)
    with pytest.raises(ValueError, match="precise"):
        idx.record_routed("p", CHAIN, now=0.0)
    with pytest.raises(ValueError, match="approximate"):
        idx.apply("r", stored(CHAIN))
    with pytest.raises(ValueError):
        CacheIndex(ttl_s=0)


def test_a_hole_reads_as_held_unless_exact() -> None:
    """A parent missing under a held child (a subscriber that joined late) is trusted by default."""
    idx = CacheIndex()
    idx.apply("late", stored(CHAIN[1:]))
    idx.apply("full", stored(CHAIN[:1]))
    assert idx.match(CHAIN, exact=True) == {"full": 1}
    idx.apply("late", stored(CHAIN[:1]))
    idx.apply("late", BlockRemoved((CHAIN[4],)))
    assert idx.match(CHAIN, exact=True) == {"full": 1, "late": 4}
    assert idx.match(CHAIN) == {"full": 1, "late": 10}  # the missing CHAIN[4] reads as held
    # the same on a chain long enough to be read level by level (the hole is among the keys read)
    long = chain_keys(list(range(4 * 2000)), BS)
    idx = CacheIndex()
    idx.apply("late", stored(long[:1500]))
    idx.apply("late", BlockRemoved((long[700],)))
    idx.apply("full", stored(long[:701]))
    assert idx.match(long, exact=True) == {"full": 701, "late": 700}
    assert idx.match(long) == {"full": 701, "late": 1500}


def test_the_bisecting_lookup_equals_the_walk_on_prefix_closed_holdings() -> None:
    """Short chains and long ones (grids of every 2nd to every 4,096th key, then bisections), with
    up to 70 instances at as many depths."""
    rng = random.Random(3)
    for _ in range(300):
        idx = CacheIndex()
        n = rng.choice([rng.randint(1, 130), rng.randint(120, 1100), rng.randint(1000, 3000)])
        keys = list(range(1000, 1000 + n))
        for inst in range(rng.randint(1, 70)):
            depth = rng.choice([0, n, rng.randint(0, n)])
            if depth:
                idx.apply(inst, stored(keys[:depth]))
            if rng.random() < 0.3:
                idx.apply(inst, stored(list(range(5000 + 10 * inst, 5005 + 10 * inst))))
        query = keys[: rng.randint(1, n)] + [99999] * rng.randint(0, 3)
        assert idx.match(query) == idx.match(query, exact=True)


def _depth(rng: random.Random, n: int) -> int:
    """A depth in 0..n, often at or next to a multiple of a power of two (a grid key or a stretch's end)."""
    r = rng.random()
    if r < 0.1:
        return rng.choice([0, 1, n - 1, n]) % (n + 1)
    if r < 0.6:
        step = 1 << rng.randint(0, 11)
        return min(max(rng.randint(0, n // step) * step + rng.choice([-1, 0, 1]), 0), n)
    return rng.randint(0, n)


def test_match_equals_counting_leading_held_keys_on_random_prefix_closed_states() -> None:
    """Random prefix-closed states (precise and approximate instances, duplicate stores, branches
    off the chain, removed instances whose slots are reused) with up to 80 distinct depths, on
    chains of 1 to 2,100 keys, queried by prefixes of several lengths."""
    rng = random.Random(27)
    lengths = [1, 2, 3, 15, 16, 17, 63, 64, 65, 2047, 2048, 2049, 2100]
    lengths += [rng.randint(1, 2100) for _ in range(47)]
    for n in lengths:
        idx = CacheIndex(ttl_s=None)
        keys = list(range(10**6, 10**6 + n))
        many = rng.random() < 0.7
        instances = list(range(rng.randint(48, 80) if many else rng.randint(1, 12)))
        for inst in instances:
            depth = _depth(rng, n)
            if inst % 5 == 4:  # approximate: what was routed there
                idx.record_routed(inst, keys[:depth], now=0.0)
            elif depth:
                idx.apply(inst, stored(keys[:depth]))
                if rng.random() < 0.2:  # stored twice (vLLM does not de-duplicate), removed once
                    idx.apply(inst, stored(keys[:depth]))
                    idx.apply(inst, BlockRemoved(tuple(keys[:depth])))
            if depth and rng.random() < 0.3:  # a branch off the chain after the held prefix
                branch = [7 * 10**6 + 1000 * inst + i for i in range(rng.randint(1, 40))]
                if inst % 5 == 4:
                    idx.record_routed(inst, branch, now=0.0)
                else:
                    idx.apply(inst, stored(branch))
        for inst in rng.sample(instances, min(len(instances), 3)):  # forget some; others take their slots
            idx.remove_instance(inst)
            instances.remove(inst)
            new = 1000 + inst
            idx.apply(new, stored(keys[: _depth(rng, n)] or [123]))
            instances.append(new)
        for m in {n, rng.randint(1, n), rng.randint(1, n)}:
            query = keys[:m] + [99999] * rng.randint(0, 2)
            want = leading_held(idx, instances, query)
            assert idx.match(query) == want, (n, m)
            assert idx.match(query, exact=True) == want, (n, m)
        if many and n >= 1024:
            assert len(set(idx.match(keys).values())) >= 30  # many distinct depths: the worst case


def test_holes_never_spoil_the_instances_without_holes() -> None:
    """With holes (keys removed from the middle, chains stored from their middle), an instance
    whose held keys of the query are a prefix of it gets its exact depth; one with holes gets one
    past a key it holds, at least its first missing key's depth; one without the first key is absent."""
    rng = random.Random(5)
    for _ in range(120):
        n = rng.choice([rng.randint(1, 40), rng.randint(40, 2100)])
        keys = list(range(10**6, 10**6 + n))
        idx = CacheIndex(ttl_s=None)
        instances = list(range(rng.randint(1, 70)))
        for inst in instances:
            depth = _depth(rng, n)
            start = rng.randint(0, depth) if rng.random() < 0.2 else 0  # joined late: from the middle
            if depth > start:
                idx.apply(inst, stored(keys[start:depth]))
            if depth > start + 2 and rng.random() < 0.3:
                holes = rng.sample(range(start, depth), rng.randint(1, min(5, depth - start)))
                idx.apply(inst, BlockRemoved(tuple(keys[h] for h in holes)))
        check_with_holes(idx, instances, keys)


def test_precise_index_follows_a_pool_exactly() -> None:
    """Events of a pool under churn, applied to the index, give the pool's own cached prefixes."""
    rng = random.Random(11)
    pools = {f"p{i}": PrefixBlockPool(num_blocks=30, block_size=BS) for i in range(3)}
    idx = CacheIndex()
    prefixes = [[rng.randrange(30) for _ in range(BS * rng.randint(1, 4))] for _ in range(5)]
    live: dict[str, list[str]] = {name: [] for name in pools}
    prompts = []
    for step in range(600):
        name = rng.choice(list(pools))
        pool, reqs = pools[name], live[name]
        if reqs and (rng.random() < 0.5 or len(reqs) > 4):
            pool.free(reqs.pop(rng.randrange(len(reqs))))
        elif rng.random() < 0.03 and not reqs:
            pool.reset()
        else:
            p = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randrange(0, 10))]
            prompts.append(chain_keys(p, BS))
            if pool.allocate(f"r{step}", chain_keys(p, BS), len(p)) is not None:
                reqs.append(f"r{step}")
        idx.apply_all(name, pool.drain_events())
        if step % 20 == 0:
            for keys in prompts[-10:]:
                want = {n: b for n, pl in pools.items() if (b := pl.cached_prefix_blocks(keys))}
                assert idx.match(keys, exact=True) == want
                assert idx.match(keys) == want
