"""The cache index's run hints: lookups that learn each chain's runs stay exact while the caches change."""

from __future__ import annotations

import random
from collections.abc import Sequence

from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from core.cache.index import CacheIndex, InstanceId
from tests.core.cache.holdings import check_with_holes, leading_held

BS = 4


def stored(keys: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(keys), parent, (), BS)


class GridCounter:
    """Counts the lookups that fell back to the grid (wraps the index's grid lookup)."""

    def __init__(self, idx: CacheIndex) -> None:
        self.calls = 0
        grid = idx._match_grid

        def counted(keys: Sequence[int], n: int, first: int, last: int) -> dict[InstanceId, int]:
            self.calls += 1
            return grid(keys, n, first, last)

        idx._match_grid = counted  # type: ignore[method-assign]


def test_a_repeated_lookup_walks_the_runs_it_learned_and_repairs_a_changed_one() -> None:
    keys = list(range(1000, 3000))
    idx = CacheIndex(ttl_s=None)
    depths = {i: 30 * i + 7 for i in range(1, 60)}
    for inst, d in depths.items():
        idx.apply(inst, stored(keys[:d]))
    grid = GridCounter(idx)
    assert idx.match(keys) == depths
    assert grid.calls == 1  # learned its 59 runs
    assert idx.match(keys) == depths and idx.match(keys[:1000]) == {i: min(d, 1000) for i, d in depths.items()}
    assert grid.calls == 1
    idx.apply(5, stored(keys[157:170], keys[156]))  # 5 now holds 170: a run splits (2 stale hints)
    idx.apply(59, stored(keys[1777:1900], keys[1776]))  # the deepest now holds 1900: a run nobody hinted
    depths |= {5: 170, 59: 1900}
    assert idx.match(keys) == depths
    assert grid.calls == 1  # each repaired by a bisection
    idx.apply(9, BlockRemoved(tuple(reversed(keys[250:277]))))  # 9 now holds 250: two runs merge
    depths[9] = 250
    assert idx.match(keys) == depths and grid.calls == 1
    for inst in (20, 30, 40, 50, 58):  # more stale runs than a lookup repairs: the grid reads the rest
        idx.apply(inst, BlockRemoved((keys[depths[inst] - 1],)))
        depths[inst] -= 1
    assert idx.match(keys) == depths and grid.calls == 2
    assert idx.match(keys) == depths and grid.calls == 2
    idx.forget_run_hints()
    assert idx.match(keys) == depths and grid.calls == 3


def test_lookups_between_random_changes_equal_counting_leading_held_keys() -> None:
    """Prefix-closed caches (precise and approximate instances, branches off the chain) that grow,
    shrink, clear and leave between lookups of the same chain: every lookup, with hints fresh,
    stale or dropped, equals the plain count; hints stay only on held keys."""
    rng = random.Random(7)
    for trial in range(40):
        n = rng.choice([5, 64, 300, 2048, rng.randint(1, 2100)])
        keys = list(range(10**6, 10**6 + n))
        idx = CacheIndex(ttl_s=None)
        held: dict[int, int] = {}
        approx = set(range(6, 70, 7))
        for inst in range(rng.randint(2, 70)):
            held[inst] = rng.randint(0, n)
            if inst in approx:
                idx.record_routed(inst, keys[: held[inst]], now=0.0)
            elif held[inst]:
                idx.apply(inst, stored(keys[: held[inst]]))
        for step in range(150):
            inst = rng.choice(list(held))
            d, r = held[inst], rng.random()
            if inst in approx:  # approximate: routed a longer or shorter prefix again (it only grows)
                held[inst] = max(d, rng.randint(0, n))
                idx.record_routed(inst, keys[: held[inst]], now=float(step))
            elif r < 0.35 and d < n:  # a prefill stored the next blocks
                k = rng.randint(1, min(n - d, 1 + rng.choice([0, 3, 60])))
                idx.apply(inst, stored(keys[d : d + k], keys[d - 1] if d else None))
                held[inst] = d + k
            elif r < 0.7 and d:  # evicted from the tail
                k = rng.randint(1, min(d, 1 + rng.choice([0, 3, 60])))
                idx.apply(inst, BlockRemoved(tuple(reversed(keys[d - k : d]))))
                held[inst] = d - k
            elif r < 0.74:
                idx.apply(inst, AllBlocksCleared())
                held[inst] = 0
            elif r < 0.77:
                idx.remove_instance(inst)
                del held[inst]
                new = 1000 + trial * 1000 + step  # precise, in the slot left
                held[new] = rng.randint(1, n)
                idx.apply(new, stored(keys[: held[new]]))
            elif r < 0.8:
                branch = [7 * 10**6 + 100 * step + j for j in range(5)]
                idx.apply(inst, stored(branch, keys[d - 1] if d else None))
            elif r < 0.82:
                idx.forget_run_hints()
            for m in {n, rng.randint(1, n)}:
                assert idx.match(keys[:m]) == {i: min(h, m) for i, h in held.items() if h}, (trial, step, m)
        assert leading_held(idx, list(held), keys) == {i: h for i, h in held.items() if h}  # the model held
        assert set(idx._runs) <= set(idx._holders)
        for inst in list(held):
            idx.remove_instance(inst)
        assert not idx._runs and not len(idx)


def test_with_holes_between_changes_the_instances_without_holes_stay_exact() -> None:
    """Holes appear and go (blocks removed from the middle, chains stored from their middle) between
    lookups: an instance whose held keys of the chain are a prefix of it gets its exact depth; one
    with holes one past a key it holds, at least its first missing key's; one without the first key
    is absent."""
    rng = random.Random(9)
    for _ in range(20):
        n = rng.choice([rng.randint(2, 40), rng.randint(40, 2100)])
        keys = list(range(10**6, 10**6 + n))
        idx = CacheIndex(ttl_s=None)
        instances = list(range(rng.randint(1, 70)))
        for inst in instances:
            idx.apply(inst, stored(keys[: rng.randint(1, n)]))
        for _ in range(40):
            inst = rng.choice(instances)
            a = rng.randint(0, n - 1)
            b = rng.randint(a + 1, min(n, a + 1 + rng.choice([1, 5, 200])))
            if rng.random() < 0.5:
                idx.apply(inst, stored(keys[a:b], keys[a - 1] if a else None))
            else:
                idx.apply(inst, BlockRemoved(tuple(keys[a:b])))
            check_with_holes(idx, instances, keys)
