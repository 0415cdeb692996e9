"""The simulator's cache model is exact: runs with the pools' bulk moves (and keys only one request holds left out
of the lookup maps) give the same result, number for number, as with the block-by-block oracle pool listing every
key; and which keys are left out, on hand-made chains."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.sim.cluster import ClusterSimResult, ClusterSimulation
from core.sim.cluster import cache as sim_cache
from core.sim.cluster.cache import CacheParams, listed_lengths
from tests.core.cache.reference_pool import ReferencePool
from tests.helpers import toy_profile

BS = 16


def conversations(n: int = 160, seed: int = 3) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """Arrivals, prompt tokens and chains of 16-token keys: a system prompt every request shares, conversations
    whose turns extend the previous turn's prompt, one-off prompts, and exact repeats of a whole-block prompt."""
    rng = np.random.default_rng(seed)
    system = tuple(range(1, 5))
    turns: dict[int, tuple[int, ...]] = {}
    chains: list[tuple[int, ...]] = []
    prompts: list[int] = []
    fresh = iter(range(10_000, 10**9))
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            c = int(rng.integers(8))
            chain = turns.get(c, system) + tuple(next(fresh) for _ in range(int(rng.integers(2, 12))))
            turns[c] = chain
            tokens = BS * len(chain) + int(rng.integers(0, BS))
        elif kind < 0.8 or not chains:
            chain = system + tuple(next(fresh) for _ in range(int(rng.integers(1, 30))))
            tokens = BS * len(chain) + int(rng.integers(1, BS))
        else:
            chain = chains[int(rng.integers(len(chains)))]
            tokens = BS * len(chain)  # a whole-block repeat: its last block is computed, and cached, again
        chains.append(chain)
        prompts.append(tokens)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    return arrivals, np.array(prompts), chains


def run(policy: str, mode: str, keys: list[tuple[int, ...]], arrivals: np.ndarray, prompts: np.ndarray,
        capacity: int) -> ClusterSimResult:
    prof = toy_profile(prefill_base_s=0.0, prefill_per_token_s=0.0002, kv_transfer_per_token_s=0.00001,
                       max_model_len=8192)
    sim = ClusterSimulation(
        arrivals=arrivals, prompt_tokens=prompts, output_tokens=np.full(len(prompts), 40), profile=prof,
        n_prefill=2, n_decode=3, dispatcher=Dispatcher(prof, policy, true_lengths=True), mode=mode,  # type: ignore[arg-type]
        prefix_keys=keys, cache=CacheParams(block_size=BS, capacity_blocks=capacity),
    )
    return sim.run()


def same(a: ClusterSimResult, b: ClusterSimResult) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize(("policy", "mode"), [("prefix_aware", "iteration"), ("least_load", "ps"),
                                              ("prefix_pd", "iteration"), ("round_robin", "iteration")])
@pytest.mark.parametrize("capacity", [60, 400])
def test_a_run_equals_the_block_by_block_oracles_run(
    policy: str, mode: str, capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrivals, prompts, keys = conversations()
    fast = run(policy, mode, keys, arrivals, prompts, capacity)
    assert fast.cached_tokens.sum() > 0 and fast.decode_cached_tokens.sum() > 0  # hits on both sides
    with monkeypatch.context() as m:  # the oracle lists every key (it ignores `listed`)
        m.setattr(sim_cache, "PrefixBlockPool", ReferencePool)
        slow = run(policy, mode, list(keys), arrivals, prompts, capacity)
    same(fast, slow)


def test_only_keys_no_other_chain_holds_are_left_out() -> None:
    chains: list[Any] = [(1, 2, 3, 4), (1, 2, 5), (1, 2, 3, 6, 7), (8, 9), (9, 10), (11, 11, 12), ()]
    # 4: only chain 0; 5: only 1; 6, 7: only 2; chain 3's 9 is chain 4's too; 11 twice in chain 5
    assert listed_lengths(chains) == [3, 2, 3, 2, 1, 2, 0]
    assert listed_lengths(chains) is listed_lengths(chains)  # the same chains: remembered
