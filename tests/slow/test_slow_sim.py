"""Slow checks (make test-slow): policy rankings at SIBYL's simulation scale."""

from __future__ import annotations

import pytest

from console.offline.simulate import SimPlan, run_one
from core.perf import get_profile
from core.slo import SLOClass
from core.traces import synthetic_trace


@pytest.mark.slow
def test_count_aware_policies_beat_round_robin_at_64_decode_instances() -> None:
    """The ranking benchmarks/README.md reports: ILS and SIBYL(unit=requests) < RR in P99 TPOT."""
    prof = get_profile("h20-qwen3-32b")
    rate = 0.95 * 64 * prof.total_tps(53) / 5657
    trace = synthetic_trace("reasoning-chat", requests=6000, rate=rate, seed=1, burstiness=0.5)
    policies: list[tuple[str, dict[str, object]]] = [
        ("sibyl", {"unit": "requests"}),
        ("least_load", {}),
        ("round_robin", {}),
    ]
    plan = SimPlan(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        workload="reasoning-chat",
        profile=prof,
        n_prefill=16,
        n_decode=64,
        mode="ps",
        policies=policies,
        slo=SLOClass(),
        shadow=False,
    )
    p99 = {name: run_one(plan, name, params)[0]["tpot_p99"] for name, params in policies}
    assert p99["sibyl"] < p99["round_robin"] and p99["least_load"] < p99["round_robin"]
    assert p99["sibyl"] <= p99["least_load"] * 1.02
