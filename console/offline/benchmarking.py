"""Micro-benchmarks of the dispatcher: routing decision latency on a synthetic loaded cluster."""

from __future__ import annotations

import inspect
import time
from typing import Any

import numpy as np

from core.cache.events import BlockStored
from core.cache.keys import BlockKey
from core.dispatch import Dispatcher
from core.perf import PerfProfile
from core.request_table import PENDING, RUNNING
from core.types import Request, Role


def loaded_dispatcher(
    profile: PerfProfile,
    policy: str,
    params: dict[str, Any] | None,
    *,
    prefill_instances: int,
    decode_instances: int,
    running_per_instance: int,
    pending_per_instance: int,
    seed: int = 0,
) -> Dispatcher:
    """A dispatcher whose table holds the given running and pending requests per decode instance."""
    rng = np.random.default_rng(seed)
    kw: dict[str, Any] = {}
    if "true_lengths" in inspect.signature(Dispatcher.__init__).parameters:
        kw["true_lengths"] = True  # a synthetic state: max_out is the "true" length oracles read
    d = Dispatcher(profile, policy, params, survival_prior_max=8192, **kw)
    for i in range(prefill_instances):
        d.add_instance(f"p{i}", Role.PREFILL)
    decode_idx = [d.add_instance(f"d{i}", Role.DECODE) for i in range(decode_instances)]
    t, v = d.view.table, d.view
    for j in decode_idx:
        for k in range(running_per_instance + pending_per_instance):
            running = k < running_per_instance
            i = t.add(f"seed-{j}-{k}")
            t.inst[i] = j
            t.state[i] = RUNNING if running else PENDING
            t.l_in[i] = rng.integers(1, 512)
            t.max_out[i] = 8192
            t.l_obs[i] = rng.integers(0, 8000) if running else 0
            t.t_obs[i] = -rng.uniform(0, 0.5)
            t.v[i] = rng.uniform(15, 40)
            t.tau[i] = rng.uniform(0.0, 1.0) if not running else 0.0
            (v.running_n if running else v.pending_n)[j] += 1
    for L in rng.integers(1, 8192, 500):  # a warmed-up survival curve
        v.survival.observe(int(L))
    return d


def add_prefix_caches(
    d: Dispatcher,
    prompt_tokens: int,
    blocks_per_instance: int,
    probes: int = 8,
    block_size: int = 16,
    seed: int = 0,
) -> list[tuple[BlockKey, ...]]:
    """Give `d` a precise prefix index (KV events) in which every prefill instance holds
    `blocks_per_instance` blocks: the leading blocks of `probes` prompts of `prompt_tokens` tokens,
    at a random depth per instance and prompt (as many different match depths as prefill
    instances: the lookup's worst case), the rest blocks of other prompts. Returns the prompts'
    block keys, for the requests to carry."""
    rng = np.random.default_rng(seed)
    n = prompt_tokens // block_size

    def keys(count: int) -> list[BlockKey]:
        return [int(k) for k in rng.integers(-(2**62), 2**62, size=count, dtype=np.int64)]

    prompts = [tuple(keys(n)) for _ in range(probes)]
    d.use_prefix_events(block_size)
    for i in np.flatnonzero(d.view.serves_prefill):
        held = [p[: int(depth)] for p, depth in zip(prompts, rng.integers(1, n + 1, size=probes), strict=True)]
        filler = keys(max(blocks_per_instance - sum(map(len, held)), 0))
        events = [BlockStored(tuple(b), None, (), block_size) for b in (*held, filler) if b]
        d.apply_kv_events(d.view.instance_ids[i], events)
    return prompts


def decision_latency(
    d: Dispatcher,
    iterations: int = 3000,
    warmup: int = 200,
    seed: int = 1,
    prefix_prompts: list[tuple[BlockKey, ...]] | None = None,
) -> dict[str, float]:
    """Time `route()` for new requests on a fixed state (each one is forgotten right after). With
    `prefix_prompts` (add_prefix_caches), the requests cycle over those prompts and carry their keys."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 512, iterations + warmup)
    samples = np.empty(iterations)
    bs = d.view.block_size
    for k in range(iterations + warmup):
        if prefix_prompts:
            keys = prefix_prompts[k % len(prefix_prompts)]
            req = Request(f"bench-{k}", 0.0, len(keys) * bs, 8192, prefix_keys=keys)
        else:
            req = Request(f"bench-{k}", 0.0, int(prompts[k]), 8192)
        t0 = time.perf_counter_ns()
        d.route(req, 0.0)
        elapsed = time.perf_counter_ns() - t0
        d.on_fail(req.id, 0.0)
        if k >= warmup:
            samples[k - warmup] = elapsed / 1000.0
    return {
        "iterations": iterations,
        "tracked_requests": len(d.view.table),
        "mean_us": float(samples.mean()),
        "p50_us": float(np.percentile(samples, 50)),
        "p99_us": float(np.percentile(samples, 99)),
        "max_us": float(samples.max()),
    }


def rank_decision_latency(
    name: str,
    params: dict[str, Any],
    *,
    ranks: int = 64,
    slots: int = 72,
    waiting: int = 256,
    free_per_rank: int = 4,
    states: int = 200,
    seed: int = 1,
) -> dict[str, float]:
    """Time one admission round of a DP rank policy (core/policies/rank/: the code the live `rank`
    policies and the DP simulator run) on random full-ish groups: `ranks` ranks of `slots` slots
    with `free_per_rank` free, resident sizes prompt + age, and `waiting` requests in the pool."""
    from core.policies import registry
    from core.policies.rank.base import AssigningRankPolicy
    from core.policies.rank.state import DPState, Waiting
    from core.types import PolicyKind

    rng = np.random.default_rng(seed)
    policy = registry.build(PolicyKind.RANK, name, params)
    if not isinstance(policy, AssigningRankPolicy):
        raise ValueError(f"rank policy {name!r} decides no admission rounds to time")
    resident = ranks * (slots - free_per_rank)
    snaps = []
    for _ in range(states + 20):
        rank_of = np.repeat(np.arange(ranks), slots - free_per_rank)
        prompt = rng.integers(16, 2048, resident)
        age = rng.integers(0, 4096, resident)
        remaining = rng.integers(1, 4096, resident)
        snaps.append(
            (
                DPState.from_requests(ranks, slots, rank_of, prompt + age, remaining),
                Waiting(rng.integers(16, 2048, waiting)),
            )
        )
    samples = []
    for k, (state, pool) in enumerate(snaps):
        t0 = time.perf_counter_ns()
        policy.assign(state, pool)
        if k >= 20:  # warm-up
            samples.append((time.perf_counter_ns() - t0) / 1000.0)
    arr = np.array(samples)
    return {
        "rounds": len(arr),
        "admitted": min(waiting, ranks * free_per_rank),
        "mean_us": float(arr.mean()),
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "max_us": float(arr.max()),
    }
