"""The simulator's LoRA model (core/sim/cluster/lora.py) on hand-computed timelines: residency and LRU eviction, the
load stalling each leg's instance, the per-step cost of each distinct adapter, max_loras adapters per batch, and
adapter-aware routing reading the simulated residency."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.sim.cluster import ClusterSimResult, ClusterSimulation
from core.sim.cluster.lora import steps_time_plus, steps_within_plus
from tests.helpers import toy_profile

# prefill_time(l) = 1 s; a decode step 0.1 s, PS: 10 tokens/s over the batch; a load 2 s, 0.25 s a step per adapter
PROFILE = toy_profile(lora_load_s=2.0, lora_per_adapter_step_s=0.25)


def simulate(
    arrivals: list[float],
    adapters: list[str | None],
    outputs: list[int],
    *,
    max_loras: int = 4,
    mode: str = "ps",
    policy: str = "round_robin",
    params: dict[str, Any] | None = None,
    prefill: int = 1,
    decode: int = 1,
) -> tuple[ClusterSimulation, ClusterSimResult]:
    n = len(arrivals)
    d = Dispatcher(PROFILE, policy, params or {}, true_lengths=True)
    sim = ClusterSimulation(
        arrivals=np.array(arrivals),
        prompt_tokens=np.full(n, 10),
        output_tokens=np.array(outputs),
        profile=PROFILE,
        n_prefill=prefill,
        n_decode=decode,
        dispatcher=d,
        mode=mode,  # type: ignore[arg-type]
        lora=adapters,
        max_loras=max_loras,
    )
    return sim, sim.run()


def test_a_miss_loads_on_both_legs_stalling_each_and_a_hit_pays_only_the_step_cost() -> None:
    """Request 0 under `a`: its prefill waits for the load (2 s), runs 1 s plus 0.25 s for its adapter and ends at
    3.25; the decode instance loads `a` (stalled to 5.25) and decodes at 1/(0.1 + 0.25) tokens/s: first token
    at 5.6. Request 1 under `a` at t=10 finds it held on both: prefill ends 11.25, first token 11.6."""
    sim, r = simulate([0.0, 10.0], ["a", "a"], [1, 1])
    assert r.prefill_end.tolist() == pytest.approx([3.25, 11.25])
    assert r.first_token.tolist() == pytest.approx([5.6, 11.6])
    assert (r.lora_loads, r.lora_hits, r.lora_evictions) == (2, 2, 0)
    assert sim.lora is not None and sim.dispatcher.view.lora is sim.lora.residency
    held = sim.lora.residency.instances
    assert held["p0"].loaded(100.0) == ["a"] and held["d0"].loaded(100.0) == ["a"]


def test_one_slot_evicts_the_least_recently_used_adapter() -> None:
    """max_loras 1 and a, b, a in turn: every admission on either leg loads, and each load after the first
    evicts the adapter held (2 per instance)."""
    _, r = simulate([0.0, 10.0, 20.0], ["a", "b", "a"], [1, 1, 1], max_loras=1)
    assert (r.lora_loads, r.lora_hits, r.lora_evictions) == (6, 0, 4)
    _, r = simulate([0.0, 10.0, 20.0], ["a", "b", "a"], [1, 1, 1], max_loras=2)
    assert (r.lora_loads, r.lora_hits, r.lora_evictions) == (4, 2, 0)


def test_a_decode_batch_runs_at_most_max_loras_adapters() -> None:
    """max_loras 1, a and b at t=0 with 10 output tokens each. Prefill: a ends at 3.25; b (a released at its
    prefill end, evicted for b) at 3.25 + 2 + 1.25 = 6.5. Decode: a loads (to 5.25) and decodes 10 tokens at
    0.35 s each, ending 8.75; b arrives at 6.5 but its adapter does not fit the batch: it joins when a ends,
    loads b (to 10.75), first token at 11.1, done at 14.25. With two slots b joins at 6.5: its load stalls the
    instance (a too) to 8.5, then each of the two decodes at 1/(2/10 + 2 × 0.25): first token at 9.2."""
    _, r = simulate([0.0, 0.0], ["a", "b"], [10, 10], max_loras=1)
    assert r.prefill_end.tolist() == pytest.approx([3.25, 6.5])
    assert r.finish[0] == pytest.approx(8.75)
    assert r.first_token[1] == pytest.approx(11.1)
    assert r.finish[1] == pytest.approx(14.25)
    _, r2 = simulate([0.0, 0.0], ["a", "b"], [10, 10], max_loras=2)
    assert r2.first_token[1] == pytest.approx(9.2)


def test_a_prefill_step_admits_at_most_max_loras_adapters_and_its_loads_overlap() -> None:
    """Iteration mode, a step of prompts costs 0.1 + 1 s. A base-model prompt runs 0 to 1.1 while a and b arrive
    (t=0.5). max_loras 1: the next step takes a alone (1.1 + 2 + 1.1 + 0.25 = 4.45), b waits at the head for the
    one after (4.45 + 2 + 1.35 = 7.8). max_loras 2: both in one step, their two loads started together stalling
    it once: 1.1 + 2 + 1.1 + 2 × 0.25 = 4.7."""
    _, r = simulate([0.0, 0.5, 0.5], [None, "a", "b"], [1, 1, 1], max_loras=1, mode="iteration")
    assert r.prefill_end.tolist() == pytest.approx([1.1, 4.45, 7.8])
    _, r = simulate([0.0, 0.5, 0.5], [None, "a", "b"], [1, 1, 1], max_loras=2, mode="iteration")
    assert r.prefill_end.tolist() == pytest.approx([1.1, 4.7, 4.7])


def test_base_model_requests_skip_the_adapters_and_no_adapters_means_no_model() -> None:
    sim, r = simulate([0.0, 0.0], [None, "a"], [1, 1], max_loras=1)
    assert r.prefill_end[0] == pytest.approx(1.0)  # served first, no load, no adapter cost
    assert r.lora_loads == 2
    sim, r = simulate([0.0], [None], [1])
    assert sim.lora is None and r.lora_loads == 0
    assert r.prefill_end.tolist() == pytest.approx([1.0])


def test_decode_steps_with_an_adapter_cost_in_closed_form() -> None:
    prof = toy_profile(decode_step_per_kv_token_s=0.001)
    for n in range(0, 30):
        t = steps_time_plus(prof, n, 3, 100.0, 0.05)
        brute = sum(prof.step_time(3, 100.0 + 3 * k) + 0.05 for k in range(n))
        assert t == pytest.approx(brute)
        assert steps_within_plus(prof, t + 1e-9, 3, 100.0, 0.05) == n
        if n:
            assert steps_within_plus(prof, t - 1e-6, 3, 100.0, 0.05) == n - 1


def test_adapter_aware_routing_loads_less_than_least_load_in_the_simulator() -> None:
    """2P2D, one slot each, a and b alternating every 5 s (one request in flight at a time): adapter-blind
    least_load takes the instances in turn and keeps loading; lora_affinity sends each adapter where it is held,
    so after one load of each per role (4) every request hits."""
    arrivals = [5.0 * k for k in range(12)]
    adapters: list[str | None] = ["a" if k % 2 == 0 else "b" for k in range(12)]
    kw: dict[str, Any] = {"max_loras": 1, "prefill": 2, "decode": 2}
    _, blind = simulate(arrivals, adapters, [1] * 12, policy="least_load", **kw)
    _, aware = simulate(arrivals, adapters, [1] * 12, policy="lora_affinity", params={"routing": "least_load"}, **kw)
    assert bool(aware.ok.all()) and bool(blind.ok.all())
    assert aware.lora_loads == 4
    assert blind.lora_loads > 2 * aware.lora_loads
    # a hit's TTFT: 1 s of prefill + 0.25 s for its adapter + one decode step of 0.1 + 0.25 s
    assert (aware.first_token - aware.arrival)[2:].tolist() == pytest.approx([1.6] * 10)
    assert float(np.mean(blind.first_token - blind.arrival)) > float(np.mean(aware.first_token - aware.arrival)) + 1.0
