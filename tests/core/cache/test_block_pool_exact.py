"""The block pool's bulk moves against the block-by-block oracle (reference_pool.py): on random calls over shared
prefixes, repeated prompts, duplicate keys, delayed commits and eviction pressure, every answer, block id, queue
order, key, counter and event is the same; with `listed`, every lookup still answers the same."""

from __future__ import annotations

import random
from itertools import count
from typing import Any

import pytest

from core.cache.block_pool import PrefixBlockPool
from tests.core.cache.reference_pool import ReferencePool

BS = 4


class Workload:
    """Chains of keys over a few shared prefixes: fresh suffixes, exact repeats (a repeat of a whole-block prompt
    caches its last block twice) and, unless `private`, chains that repeat a key."""

    def __init__(self, rng: random.Random, private: bool) -> None:
        self.rng, self.private = rng, private
        self.fresh = count(1000)
        self.prefixes = [[next(self.fresh) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        self.seen: list[tuple[list[int], int]] = []

    def chain(self) -> tuple[list[int], int, int]:
        """(keys, prompt tokens, how many leading keys other chains may hold)."""
        rng = self.rng
        if self.seen and not self.private and rng.random() < 0.2:
            keys, tokens = rng.choice(self.seen)
            return keys, tokens, len(keys)
        shared = rng.choice(self.prefixes)[: rng.randint(0, 6)]
        own = [next(self.fresh) for _ in range(rng.randint(0, 5))]
        if not self.private and own and rng.random() < 0.1:
            own.insert(0, own[-1])  # a chain that repeats a key
        keys = shared + own
        tokens = max(1, len(keys) * BS - rng.choice([0, 0, 1, 3]))
        self.seen.append((keys, tokens))
        return keys, tokens, len(shared)


def same_state(pool: PrefixBlockPool, ref: ReferencePool, live: dict[str, list[int]], *, all_listed: bool) -> None:
    assert pool.free_queue() == ref.free_queue()
    assert pool.num_free_blocks == ref.num_free_blocks
    assert pool.stats == ref.stats
    assert pool.drain_events() == ref.drain_events()
    for rid in live:
        assert pool.block_ids(rid) == ref.block_ids(rid)
        assert pool.num_tokens(rid) == ref.num_tokens(rid)
    assert [pool.key_of(b) for b in range(ref.num_blocks)] == [ref.key_of(b) for b in range(ref.num_blocks)]
    if all_listed:
        assert pool.num_cached_blocks == ref.num_cached_blocks


def drive(seed: int, num_blocks: int, caching: bool, events: bool, private: bool) -> None:
    """Random calls on both pools, compared after each (`private`: the pool lists only the shared keys)."""
    rng = random.Random(seed)
    pool = PrefixBlockPool(num_blocks, BS, enable_caching=caching, enable_events=events)
    ref = ReferencePool(num_blocks, BS, enable_caching=caching, enable_events=events)
    work = Workload(rng, private)
    live: dict[str, list[int]] = {}
    rids = count()
    for _ in range(400):
        op = rng.random()
        if op < 0.45 or not live:
            keys, tokens, shared = work.chain()
            rid = f"r{next(rids)}"
            kw: dict[str, Any] = {"commit": rng.random() < 0.7, "preempted": rng.random() < 0.1}
            if events and rng.random() < 0.5:
                kw["token_ids"] = list(range(tokens))
            got = pool.allocate(rid, keys, tokens, listed=shared if private else None, **kw)
            assert got == ref.allocate(rid, keys, tokens, **kw)
            if got is not None:
                live[rid] = keys
        elif op < 0.6:
            rid = rng.choice(list(live))
            n = rng.randint(1, 2 * BS)
            assert pool.append_tokens(rid, n) == ref.append_tokens(rid, n)
        elif op < 0.75:
            rid = rng.choice(list(live))
            keys = live[rid] + [next(work.fresh) for _ in range(3)]  # its decoded blocks' keys too
            live[rid] = keys
            assert pool.commit_full_blocks(rid, keys) == ref.commit_full_blocks(rid, keys)
        elif op < 0.97:
            rid = rng.choice(list(live))
            del live[rid]
            pool.free(rid)
            ref.free(rid)
        else:
            assert pool.reset() == ref.reset()
        probe, tokens, _ = work.chain()
        if not private or rng.random() < 0.5:  # a private probe is one no chain holds yet: it looks up nothing
            assert pool.cached_tokens(probe, tokens) == ref.cached_tokens(probe, tokens)
            assert pool.blocks_needed(probe, tokens) == ref.blocks_needed(probe, tokens)
            assert pool.cached_prefix_blocks(probe) == ref.cached_prefix_blocks(probe)
        same_state(pool, ref, live, all_listed=not private)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("caching", "events"), [(True, True), (True, False), (False, True)])
def test_random_calls_give_the_oracles_answers_block_for_block(seed: int, caching: bool, events: bool) -> None:
    drive(seed, num_blocks=24 + 8 * seed, caching=caching, events=events, private=False)


@pytest.mark.parametrize("seed", range(6))
def test_keys_left_unlisted_change_no_lookup_of_the_others(seed: int) -> None:
    drive(seed, num_blocks=20 + 6 * seed, caching=True, events=seed % 2 == 0, private=True)


def test_a_chain_that_repeats_a_key_holds_its_block_twice_and_frees_it_once() -> None:
    pool, ref = PrefixBlockPool(12, BS), ReferencePool(12, BS)
    for p in (pool, ref):
        p.allocate("a", [7, 7, 8], 3 * BS)  # blocks 1, 2, 3; block 2 is a second copy of key 7
        p.free("a")  # queue: 4..11, then 3, 2, 1 (tail first)
    got = pool.allocate("b", [7, 7, 8], 3 * BS)
    assert got == ref.allocate("b", [7, 7, 8], 3 * BS)
    assert got is not None and (got.cached_blocks, got.new_blocks) == (2, 1)  # key 7's block hit twice, 8 capped
    assert pool.block_ids("b") == ref.block_ids("b") == [1, 1, 4]
    pool.free("b")
    ref.free("b")
    assert pool.free_queue() == ref.free_queue() == [5, 6, 7, 8, 9, 10, 11, 3, 2, 4, 1]
    assert pool.drain_events() == ref.drain_events()
