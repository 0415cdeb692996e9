"""References for the cache index's lookups: the plain count of leading held keys, and what a
lookup may answer when some instances hold the chain with holes."""

from __future__ import annotations

from collections.abc import Sequence

from core.cache.index import CacheIndex, InstanceId


def leading_held(idx: CacheIndex, instances: Sequence[InstanceId], query: list[int]) -> dict[InstanceId, int]:
    """Per instance, how many leading keys of ``query`` it holds (if any)."""
    out: dict[InstanceId, int] = {}
    for inst in instances:
        d = 0
        while d < len(query) and idx.holds(inst, query[d]):
            d += 1
        if d:
            out[inst] = d
    return out


def check_with_holes(idx: CacheIndex, instances: Sequence[InstanceId], keys: list[int]) -> None:
    """``idx.match(keys)``: an instance whose held keys of the chain are a prefix of it gets its
    exact depth; one with holes one past a key it holds, at least its first missing key's; one
    without the first key is absent."""
    got = idx.match(keys)
    assert set(got) == {i for i in instances if idx.holds(i, keys[0])}
    for inst, d in got.items():
        held = [p for p in range(len(keys)) if idx.holds(inst, keys[p])]
        first_missing = leading_held(idx, [inst], keys)[inst]
        if held == list(range(len(held))):
            assert d == first_missing, (inst, d)
        else:
            assert idx.holds(inst, keys[d - 1]) and d >= first_missing, (inst, d, first_missing)
