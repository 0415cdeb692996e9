"""The instance simulator's orderings: tail-aware Φ, leases and the δ margin, SRPT, SJF's starvation
guard, predicted lengths, γ adapted online (spec: shared/design/papers/tail-aware.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from core.policies.gamma import boost, predicted_length
from core.sim.instance.engine import InstanceSim, simulate_instance
from core.sim.instance.model import DONE, RUNNING, WAITING, InstanceParams, SimRequest
from core.sim.instance.orderings import Sjf, SjfParams, Srpt, SrptParams, TailAware, TailAwareParams, build_ordering
from tests.core.sim.instance.tiny import GAMMA, PROF, TAU

FIXED = {"tau_s": TAU, "adapt_gamma": False, "u_init": 1.0}


def tail(**kw: object) -> TailAware:
    return TailAware(TailAwareParams.model_validate({**FIXED, **kw}))


def test_phi_changes_only_at_bin_boundaries_and_the_lease_drops_there() -> None:
    # prompt 500: w̃ = max(500 + generated, 500) → bin 256 until generated reaches 12 (w̃ 512).
    o = tail()
    inst = InstanceSim(PROF, o)
    r = inst.submit(0, 0.0, 500, 30)
    inst.step()  # arrival (bin 256 from the prompt) and the whole prefill
    seen: list[tuple[int, int, float, bool]] = []
    while r.state != DONE:
        o.before_step(inst.now)  # what the next step starts with (idempotent)
        seen.append((r.generated, r.bin, r.phi, r.lease))
        inst.step()
    bins = [b for _, b, _, _ in seen]
    assert bins[0] == 256 and bins[-1] == 512
    change = next(i for i, b in enumerate(bins) if b == 512)
    assert seen[change][0] == 12 and not seen[change][3]  # unleased at its preemption point
    assert all(lease for _, _, _, lease in seen[:change])  # leased while the bin holds
    assert all(lease for _, _, _, lease in seen[change + 1 :])  # re-leased once scheduled
    phis = {phi for _, _, phi, _ in seen}
    assert phis == {-boost(TAU * 256, GAMMA), -boost(TAU * 512, GAMMA)}


def _resident(inst: InstanceSim, rid: int, phi: float, lease: bool, blocks: int) -> SimRequest:
    v = SimRequest(rid=rid, arrival=0.0, prompt=10, output=10, state=RUNNING)
    v.phi, v.lease, v.blocks = phi, lease, blocks
    inst.running.append(v)
    return v


def test_delta_margin_and_leases_decide_the_victim() -> None:
    inst = InstanceSim(PROF, tail(delta_s=0.1))
    o = inst.ordering
    v = _resident(inst, 1, phi=1.00, lease=False, blocks=3)
    r = SimRequest(rid=9, arrival=0.0, prompt=10, output=10)
    r.phi = 0.95  # Φ_v − Φ_r = 0.05 < δ: no preemption
    assert o.victim(r, False) is None
    r.phi = 0.85  # 0.15 > δ
    assert o.victim(r, False) is v
    v.lease = True  # a leased request is never a victim of a waiting one
    assert o.victim(r, False) is None
    zero = InstanceSim(PROF, tail(delta_s=0.0))
    v0 = _resident(zero, 1, phi=1.00, lease=False, blocks=3)
    r.phi = 0.95
    assert zero.ordering.victim(r, False) is v0  # the same state preempts without the margin
    # the largest Φ, and among those within δ of it the smallest resident KV
    inst2 = InstanceSim(PROF, tail(delta_s=0.1))
    _resident(inst2, 1, phi=2.00, lease=False, blocks=9)
    small = _resident(inst2, 2, phi=1.95, lease=False, blocks=2)
    _resident(inst2, 3, phi=1.50, lease=False, blocks=1)
    r.phi = 0.0
    assert inst2.ordering.victim(r, False) is small
    # safety valve: a resident request short of KV with only leased peers evicts the largest Φ
    inst3 = InstanceSim(PROF, tail(delta_s=0.1))
    me = _resident(inst3, 1, phi=0.5, lease=True, blocks=2)
    top = _resident(inst3, 2, phi=3.0, lease=True, blocks=2)
    assert inst3.ordering.victim(me, False) is top
    assert inst3.ordering.counters()["valve_evictions"] == 1


def test_delta_margin_prevents_a_preemption_in_a_run() -> None:
    # One seat. v (t=0, prompt 600) runs; r (prompt 10, boost ≈ 0.84 s) arrives at 0.77 s, so
    # Φ_r sits just below Φ_v (by less than δ = 0.1 s). Without MemGuard leases only δ protects v.
    def run(delta: float) -> tuple[SimRequest, SimRequest, float]:
        inst = InstanceSim(PROF, tail(delta_s=delta, memguard=False), InstanceParams(max_num_seqs=1))
        v = inst.submit(0, 0.0, 600, 200)
        r = inst.submit(1, 0.77, 10, 2)
        margin = math.nan
        o = inst.ordering
        assert isinstance(o, TailAware)
        while r.state != DONE:
            if inst.now >= r.arrival and math.isnan(margin):  # r joins at this step
                margin = o.phi_of(v.arrival, o.bin_of(v)) - o.phi_of(r.arrival, o.bin_of(r))
            inst.step()
        inst.run()
        return v, r, margin

    v, r, margin = run(0.1)
    assert 0 < margin < 0.1
    assert v.preemptions == 0 and r.first_token > v.finish  # r waited for v
    v, r, margin = run(0.0)
    assert 0 < margin < 0.1
    assert v.preemptions == 1 and r.first_token < v.finish  # without δ, r evicts v


def test_srpt_preempts_longer_remaining_but_not_past_the_threshold() -> None:
    inst = InstanceSim(PROF, Srpt(SrptParams()))
    o = inst.ordering
    v = SimRequest(rid=1, arrival=0.0, prompt=10, output=100, state=RUNNING, pred=100, generated=50)
    inst.running.append(v)
    r = SimRequest(rid=2, arrival=1.0, prompt=10, output=10, pred=10)
    assert o.victim(r, False) is v  # 50 remaining > 10
    v.generated = 60  # decoded 0.6 of its length: TRAIL no longer preempts it
    assert o.victim(r, False) is None
    assert o.victim(r, True) is v  # forced (empty step): the lowest priority resident
    r.pred = 80
    v.generated = 10  # remaining 90 vs 80 → still preemptible
    assert o.victim(r, False) is v


def test_predicted_lengths_are_seeded_per_request() -> None:
    assert predicted_length(5, 1000, 0.0, 1) == 1000
    a = [predicted_length(i, 1000, 0.5, 1) for i in range(200)]
    assert a == [predicted_length(i, 1000, 0.5, 1) for i in range(200)]
    assert a != [predicted_length(i, 1000, 0.5, 2) for i in range(200)]
    assert 0.3 < float(np.std(np.log(np.array(a) / 1000))) < 0.7
    assert build_ordering("srpt", {"lengths": "predicted"}).name == "srpt(predicted)"
    with pytest.raises(ValidationError):
        build_ordering("srpt", {"no_preempt_fraction": 2})
    with pytest.raises(ValueError, match="unknown ordering"):
        build_ordering("lifo")


def test_tail_aware_starving_request_is_served_before_later_arrivals() -> None:
    # One seat held by a blocker until ~1 s. L (t=0.01, prompt 3000: bin 2048, boost ≈ 0) waits
    # with short requests S_i (t = 0.02 + 0.02·i, prompt 50: bin 256, boost b256 = 0.117 s).
    # Φ order: S_i overtakes L only if a_i − b256 < 0.01 − b2048, i.e. a_i < 0.127 → S_0..S_5;
    # every later short arrived more than b_max after L and never overtakes it.
    b256, b2048 = boost(TAU * 256, GAMMA), boost(TAU * 2048, GAMMA)
    assert b256 == pytest.approx(0.1174, abs=1e-4) and b2048 < 1e-4
    inst = InstanceSim(PROF, tail(), InstanceParams(max_num_seqs=1))
    inst.submit(0, 0.0, 10, 40)
    long = inst.submit(1, 0.01, 3000, 2)
    shorts = [inst.submit(10 + i, 0.02 + 0.02 * i, 50, 2) for i in range(20)]
    while shorts[-1].state != WAITING or inst.now < 0.5:
        inst.step()
    ahead = [r.rid for r in inst.waiting_in_order()]
    assert ahead == [10, 11, 12, 13, 14, 15, 1, *range(16, 30)]
    inst.run()
    order = sorted([long, *shorts], key=lambda r: r.admit_seq)
    assert [r.rid for r in order] == ahead
    # a later, equally long request is not helped: pure size order would put L last
    sjf = InstanceSim(PROF, Sjf(SjfParams(starvation_guard=False)), InstanceParams(max_num_seqs=1))
    sjf.submit(0, 0.0, 10, 40)
    long2 = sjf.submit(1, 0.01, 3000, 50)
    late = [sjf.submit(10 + i, 0.02 + 0.02 * i, 50, 2) for i in range(20)]
    sjf.run()
    assert long2.admit_seq > max(r.admit_seq for r in late)


def test_sjf_starvation_guard_promotes_a_long_waiting_request() -> None:
    # One seat, short requests arriving faster than they are served: without the guard the long
    # request runs last; with LTR's guard (idle 20 steps → promoted) it runs well before that.
    def run(guard: bool) -> tuple[SimRequest, list[SimRequest], float]:
        params = SjfParams(starvation_guard=guard, starv_steps=20, period_steps=10)
        inst = InstanceSim(PROF, Sjf(params), InstanceParams(max_num_seqs=1))
        inst.submit(0, 0.0, 10, 5)
        long = inst.submit(1, 0.001, 20, 60)
        shorts = [inst.submit(10 + i, 0.01 + 0.06 * i, 10, 4) for i in range(40)]
        res = inst.run()
        return long, shorts, res.counters.get("promotions", 0.0)

    long, shorts, promos = run(False)
    assert long.finish > max(r.finish for r in shorts) and promos == 0
    long, shorts, promos = run(True)
    assert promos >= 1
    assert sum(r.finish > long.finish for r in shorts) >= 20


def test_sjf_guard_also_promotes_a_paused_resident_request() -> None:
    o = Sjf(SjfParams(starv_steps=5, period_steps=2))
    inst = InstanceSim(PROF, o)
    r = SimRequest(rid=1, arrival=0.0, prompt=10, output=10, state=RUNNING, pred=10)
    inst.running.append(r)
    inst.step_no = 4
    o.before_step(0.0)
    assert not r.promoted  # idle 4 < 5 steps
    inst.step_no = 5
    o.before_step(0.0)
    assert r.promoted and r.runs == 2 and o.key(r)[0] == 0.0
    o.on_scheduled(r)
    o.on_scheduled(r)
    assert not r.promoted  # demoted after `period_steps` scheduled steps


def test_tail_aware_adapts_gamma_online_in_the_simulator() -> None:
    rng = np.random.default_rng(11)
    n = 400
    arr = np.sort(rng.uniform(0, 20, n))
    params = {"tau_s": TAU, "min_samples": 50, "update_every": 25, "update_min_interval_s": 1.0}
    params["rekey_interval_s"] = 1.0
    res = simulate_instance(
        PROF,
        build_ordering("tail_aware", params),
        arr,
        rng.integers(5, 200, n),
        rng.integers(1, 60, n),
    )
    assert res.counters["gamma_updates"] >= 2
    gammas = {round(g, 9) for _, g, _ in res.trace}
    assert len(gammas) >= 3 and np.isfinite(res.e2e).all()
