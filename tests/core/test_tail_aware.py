"""Tail-aware scheduling (seed 002): the instance simulator, the orderings and the gateway policy.

Spec: shared/design/papers/tail-aware.md. Hand computations use the tiny profile below.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

import core.policies.tail_aware  # noqa: F401  (registers the queue policy)
from core.perf import PerfProfile
from core.policies import build
from core.policies.tail_aware import TailAwareQueue, TailAwareQueueParams
from core.sim.instance.engine import InstanceSim, simulate_instance
from core.sim.instance.gamma import LN5, GammaAda, GammaAdaParams, boost, predicted_length, quantize
from core.sim.instance.model import (
    DONE,
    REJECTED,
    RUNNING,
    WAITING,
    InstanceParams,
    SimRequest,
)
from core.sim.instance.orderings import (
    FcfsOrdering,
    Sjf,
    SjfParams,
    Srpt,
    SrptParams,
    TailAware,
    TailAwareParams,
    build_ordering,
)
from core.types import Request

# prefill chunk of c tokens at offset o: 1 ms/token (+ 1 µs·((o+c)² − o²) in PROF2);
# decode step: 20 ms + 5 ms per sequence; a step without decodes pays 10 ms fixed.
PROF = PerfProfile(
    name="tiny",
    prefill_base_s=0.010,
    prefill_per_token_s=0.001,
    decode_step_base_s=0.020,
    decode_step_per_seq_s=0.005,
    kv_capacity_tokens=16_000,
    block_size=16,
    max_num_seqs=8,
    max_model_len=8192,
)
PROF2 = PROF.model_copy(update={"prefill_per_token2_s": 1e-6, "decode_step_per_kv_token_s": 1e-5})

# τ = 1 ms/token, k = 256 → τk = 0.256 s; u_k = 1 → γ = 1/0.256 s⁻¹.
TAU, K = 0.001, 256
GAMMA = 1.0 / (TAU * K)
FIXED = {"tau_s": TAU, "adapt_gamma": False, "u_init": 1.0}


def tail(**kw: object) -> TailAware:
    return TailAware(TailAwareParams.model_validate({**FIXED, **kw}))


# --- the instance simulator against hand computations ----------------------------------------


def test_two_requests_step_times_and_ttfts_by_hand() -> None:
    # budget 64, chunk 32. A (t=0, prompt 40, 3 out), B (t=0.05, prompt 10, 2 out).
    # step 1 @0.000: A chunk 32, no decode  → 0.010 + 0.032            = 0.042 → t=0.042
    # step 2 @0.042: A chunk 8 (B not there) → 0.010 + 0.008            = 0.018 → t=0.060, A tok 1
    # step 3 @0.060: A decode + B chunk 10  → 0.020 + 0.005 + 0.010     = 0.035 → t=0.095, A 2, B 1
    # step 4 @0.095: A, B decode            → 0.020 + 2·0.005           = 0.030 → t=0.125, both done
    inst = InstanceSim(PROF, FcfsOrdering(), InstanceParams(token_budget=64, chunk_size=32))
    a = inst.submit(0, 0.0, 40, 3)
    b = inst.submit(1, 0.05, 10, 2)
    recs = []
    while (rec := inst.step()) is not None:
        recs.append(rec)
    assert [round(r.dt, 9) for r in recs] == [0.042, 0.018, 0.035, 0.030]
    assert [r.batch for r in recs] == [[(0, 32)], [(0, 8)], [(0, 1), (1, 10)], [(0, 1), (1, 1)]]
    assert a.first_token - a.arrival == pytest.approx(0.060)
    assert b.first_token - b.arrival == pytest.approx(0.045)
    assert a.finish == pytest.approx(0.125) and b.finish - b.arrival == pytest.approx(0.075)
    assert inst.free_blocks == inst.total_blocks and a.state == b.state == DONE


def test_prefill_chunks_sum_to_the_attention_square_and_a_lone_prompt_costs_prefill_time() -> None:
    whole = simulate_instance(PROF2, FcfsOrdering(), np.zeros(1), np.array([20]), np.array([1]))
    assert whole.e2e[0] == pytest.approx(float(PROF2.prefill_time(20)))
    # chunks of 8, 8, 4 at offsets 0, 8, 16: 3 fixed costs + 1 ms·20 + 1 µs·(8² + (16²−8²) + (20²−16²))
    inst = InstanceSim(PROF2, FcfsOrdering(), InstanceParams(chunk_size=8))
    r = inst.submit(0, 0.0, 20, 1)
    inst.run()
    assert r.finish == pytest.approx(3 * 0.010 + 0.020 + 1e-6 * 400)
    # a decode step reads the resident KV: 20 ms + 5 ms + 10 µs·20 tokens
    two = simulate_instance(PROF2, FcfsOrdering(), np.zeros(1), np.array([20]), np.array([2]))
    assert two.e2e[0] - whole.e2e[0] == pytest.approx(0.020 + 0.005 + 1e-5 * 20)


def test_chunked_prefill_respects_the_token_budget_and_chunk_size() -> None:
    rng = np.random.default_rng(3)
    n = 60
    inst = InstanceSim(PROF, FcfsOrdering(), InstanceParams(token_budget=48, chunk_size=32))
    for i in range(n):
        inst.submit(i, float(i) * 0.01, int(rng.integers(1, 300)), int(rng.integers(1, 30)))
    steps = 0
    while inst.waiting or inst.running or inst.next_arrival() < math.inf:
        rec = inst.step()
        if rec is None:
            inst.now = inst.next_arrival()
            continue
        steps += 1
        assert sum(q for _, q in rec.batch) <= 48
        assert all(q <= 32 for _, q in rec.batch)
    assert all(r.state == DONE for r in inst.requests)
    # the budget binds: one decode + two prompts of 100 → 1 + 32 + 15 tokens in one step
    inst = InstanceSim(PROF, FcfsOrdering(), InstanceParams(token_budget=48, chunk_size=32))
    inst.submit(0, 0.0, 5, 10)
    inst.step()  # request 0 prefilled, now decoding
    inst.submit(1, inst.now, 100, 2)
    inst.submit(2, inst.now, 100, 2)
    rec = inst.step()
    assert rec is not None and rec.batch == [(0, 1), (1, 32), (2, 15)]


def test_preemption_by_recompute_frees_blocks_and_requeues() -> None:
    # 4 blocks of 16. A and B (prompt 30) each take 2 blocks in step 1 and decode. In step 4 A
    # needs a 3rd block (33 tokens): FCFS (vLLM) preempts the latest admitted, B.
    inst = InstanceSim(PROF, FcfsOrdering(), InstanceParams(kv_capacity_tokens=64, token_budget=64))
    a = inst.submit(0, 0.0, 30, 20)
    b = inst.submit(1, 0.0, 30, 20)
    recs = [inst.step() for _ in range(4)]
    assert [rec.preempted for rec in recs if rec] == [[], [], [], [1]]
    assert b.state == WAITING and b.blocks == 0 and b.computed == 0 and b.preemptions == 1
    assert b.generated == 3  # its output so far is kept; it will be recomputed
    assert a.blocks == 3 and inst.free_blocks == 1 and inst.running == [a]
    assert [r.rid for r in inst.waiting_in_order()] == [1]
    res = inst.run()
    assert a.state == b.state == DONE and a.finish < b.finish
    assert res.preemptions.tolist() == [0, 1]
    assert b.recomputed == 32  # the 32 tokens computed before the preemption, once more
    assert res.evictions_for_running == 1 and res.evictions_for_waiting == 0


def test_fcfs_admits_nothing_in_a_step_that_preempted() -> None:
    # vLLM v1: waiting requests are only scheduled when no running request was preempted.
    # 4 blocks, chunk 16, first-chunk admission (reserve_full_isl off). Step 1: A (prompt 32)
    # and B (prompt 16) take a block each; C arrives. Step 2: A's second chunk and B's first
    # decode take the last two blocks; C cannot fit. Step 3: A needs a 3rd block, B (latest
    # admitted) is preempted and frees 2; A takes 1 and C (one block) would fit, but is not
    # admitted in that step.
    ip = InstanceParams(kv_capacity_tokens=64, chunk_size=16, reserve_full_isl=False)
    inst = InstanceSim(PROF, FcfsOrdering(), ip)
    inst.submit(0, 0.0, 32, 30)
    inst.submit(1, 0.0, 16, 40)
    inst.submit(2, 0.001, 16, 5)
    recs = [inst.step() for _ in range(4)]
    assert [rec.batch for rec in recs if rec][:3] == [
        [(0, 16), (1, 16)],
        [(0, 16), (1, 1)],
        [(0, 1)],
    ]
    assert recs[2] is not None and recs[2].preempted == [1] and inst.free_blocks <= 1
    assert recs[3] is not None and recs[3].batch == [(0, 1), (1, 16)]  # B back first (head)


def test_admission_reserves_kv_for_the_whole_input_as_vllm_0_32() -> None:
    # 4 blocks. A (prompt 30) holds 2 after step 1. B (prompt 40) arrives: its first 16-token
    # chunk would fit in the 2 free blocks, its whole input (3 blocks) would not.
    def second_step(reserve: bool) -> list[tuple[int, int]]:
        ip = InstanceParams(kv_capacity_tokens=64, chunk_size=16, reserve_full_isl=reserve)
        inst = InstanceSim(PROF, FcfsOrdering(), ip)
        inst.submit(0, 0.0, 30, 30)
        inst.step()  # A: chunks of 16 → only 16 tokens, 1 block
        inst.step()  # A: 14 more, 2 blocks, first token
        inst.submit(1, inst.now, 40, 10)
        rec = inst.step()
        assert rec is not None
        return rec.batch

    assert second_step(True) == [(0, 1)]
    assert second_step(False) == [(0, 1), (1, 16)]


def test_requests_larger_than_the_cache_are_rejected_and_runs_are_deterministic() -> None:
    inst = InstanceSim(PROF, FcfsOrdering(), InstanceParams(kv_capacity_tokens=64))
    assert inst.submit(0, 0.0, 60, 10).state == REJECTED
    rng = np.random.default_rng(7)
    arr = np.sort(rng.uniform(0, 3, 80))
    p, o = rng.integers(1, 400, 80), rng.integers(1, 200, 80)
    ip = InstanceParams(kv_capacity_tokens=2048, max_num_seqs=6)
    for name in ("fcfs", "sjf", "srpt", "tail_aware"):
        r1 = simulate_instance(PROF, build_ordering(name), arr, p, o, ip)
        r2 = simulate_instance(PROF, build_ordering(name), arr, p, o, ip)
        assert np.array_equal(r1.e2e, r2.e2e) and np.isfinite(r1.e2e).all(), name


# --- γ-Boost building blocks ------------------------------------------------------------------


def test_boost_function_values_and_shape() -> None:
    # f(u) = ln(1/(1−e^{−u})): spec §2.2 table
    for u, f in (
        (0.01, 4.61),
        (0.1, 2.35),
        (0.5, 0.933),
        (1.0, 0.459),
        (2.0, 0.145),
        (5.0, 0.0068),
    ):
        assert boost(u, 1.0) == pytest.approx(f, rel=7e-3)  # table rounded to 3 digits
    assert boost(0.0, 1.0) == math.inf
    assert boost(1.0, 2.0) == pytest.approx(boost(2.0, 1.0) / 2)  # scale-free: f(γx)/γ
    xs = [0.01, 0.1, 1.0, 10.0]
    assert all(boost(x, 1.0) > boost(y, 1.0) for x, y in zip(xs, xs[1:], strict=False))


def test_memguard_binning_is_the_floor_quantiser() -> None:
    cases = {1: 256, 255: 256, 511: 256, 512: 512, 1023: 512, 1024: 1024, 2047: 1024, 10_000: 8192}
    assert {w: quantize(w, 256) for w in cases} == cases
    # "a 10k-token request has at most 6 revision points" with k = 256 (spec §2.6)
    assert len({quantize(w, 256) for w in range(1, 10_001)}) == 6
    assert quantize(100, 64) == 64 and quantize(130, 64) == 128


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


# --- victims: δ hysteresis, leases, SRPT threshold -------------------------------------------


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


# --- starvation guards ------------------------------------------------------------------------


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


# --- γ-Ada -----------------------------------------------------------------------------------


def _ada(**kw: object) -> GammaAda:
    base = {"min_samples": 50, "update_every": 50, "update_min_interval_s": 0.0, "window_s": 1e9}
    return GammaAda(GammaAdaParams.model_validate({**base, **kw}))


def test_gamma_ada_moves_the_right_way_and_matches_eq9() -> None:
    g0 = 1.0 / (TAU * K)
    narrow, wide = _ada(), _ada()
    for i in range(200):
        narrow.observe(float(i), 10.0 + 0.001 * i)  # t99 − t95 ≈ 0.008 s → floored at ε
        wide.observe(float(i), float(i))  # t99 − t95 = 7.96 s
    assert narrow.update(200.0, TAU) and wide.update(200.0, TAU)
    assert narrow.gamma(TAU) > g0 > wide.gamma(TAU)  # light tail → FCFS-ward, wide → LAS-ward
    assert narrow.gamma(TAU) == pytest.approx(0.8 * g0 + 0.2 * LN5 / 0.01)
    x95, x99 = np.percentile(np.arange(200.0), [95, 99])
    assert wide.gamma(TAU) == pytest.approx(0.8 * g0 + 0.2 * LN5 / (x99 - x95))
    # clipped to u_k = γτk ∈ [u_min, u_max]
    clip = _ada(u_max=2.0)
    for i in range(200):
        clip.observe(float(i), 10.0)
    clip.update(200.0, TAU)
    assert clip.gamma(TAU) == pytest.approx(2.0 / (TAU * K))


def test_gamma_ada_waits_for_samples_count_and_interval() -> None:
    ada = _ada(update_min_interval_s=5.0, window_s=10.0)
    for i in range(49):
        ada.observe(0.1 * i, 1.0 + i)
    assert not ada.update(4.9, TAU)  # 49 < update_every
    ada.observe(4.95, 3.0)
    assert ada.update(5.0, TAU) and ada.updates == 1
    for i in range(50):
        ada.observe(5.0 + 0.01 * i, 2.0)
    assert not ada.update(5.5, TAU)  # < 5 s since the last update
    assert not ada.update(30.0, TAU)  # the 10-s window holds no sample any more
    with pytest.raises(ValidationError):
        GammaAdaParams(u_min=1.0, u_init=0.5)


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


# --- the gateway queue policy -------------------------------------------------------------------


def _q(**kw: object) -> TailAwareQueue:
    q = build("queue", "tail_aware", {"tau_s": TAU, **kw})
    assert isinstance(q, TailAwareQueue)
    return q


def req(rid: str, arrival: float, prompt: int = 100, slo: str = "default") -> Request:
    return Request(rid, arrival, prompt, 50, slo_class=slo)


def test_gateway_queue_protocol() -> None:
    q = _q()
    for r in (req("a", 0.0, 3000, "x"), req("b", 0.05, 100, "y"), req("c", 0.30, 100, "x")):
        q.push(r, r.arrival)
    assert len(q) == 3 and q.depth_by_class() == {"x": 2, "y": 1}
    # b (boost 0.117 s) overtakes a (boost ≈ 0); c arrived 0.3 s after a: more than b_max later
    assert q.max_boost_s == pytest.approx(boost(TAU * 256, GAMMA))
    assert [r.id for r in q.items()] == ["b", "a", "c"]
    assert q.remove("a") is not None and q.remove("a") is None
    assert len(q) == 2 and q.depth_by_class() == {"x": 1, "y": 1}
    assert q.pop(1.0).id == "b" and q.pop(1.0).id == "c" and q.pop(1.0) is None  # type: ignore[union-attr]
    assert len(q) == 0 and q.depth_by_class() == {} and q.items() == []
    q.push(req("d", 2.0), 2.0)
    q.push(req("d", 2.0), 2.5)  # pushed again: held once
    assert len(q) == 1 and q.pop(3.0).id == "d" and q.pop(3.0) is None  # type: ignore[union-attr]
    with pytest.raises(Exception, match="bad params"):
        build("queue", "tail_aware", {"delta_s": 1})  # an instance-only knob


def test_gateway_queue_starving_request_is_never_overtaken_after_b_max() -> None:
    q = _q()
    q.push(req("long", 0.0, 8000), 0.0)
    for i in range(30):
        q.push(req(f"s{i}", 0.01 * (i + 1), 50), 0.0)
    order = [r.id for r in q.items()]
    b_max = q.max_boost_s
    overtook = {f"s{i}" for i in range(30) if 0.01 * (i + 1) - b_max < q.phi(req("long", 0.0, 8000))}
    assert order.index("long") == len(overtook) and set(order[: len(overtook)]) == overtook
    assert 0 < len(overtook) < 30


def test_gateway_gamma_adapts_from_completions_and_rekeys() -> None:
    q = _q(adapt_gamma=True, u_init=0.01, min_samples=20, update_every=20, update_min_interval_s=0.0)
    q.push(req("early-long", 0.0, 4000), 0.0)
    q.push(req("late-short", 2.0, 50), 0.0)
    assert [r.id for r in q.items()] == ["late-short", "early-long"]  # LAS-like: big boosts
    g0 = q.gamma
    for i in range(20):  # identical latencies: a very light tail → γ up (FCFS-ward)
        q.observe_completion(req(f"done{i}", float(i)), 5.0, 50)
    assert q.gamma > g0
    assert [r.id for r in q.items()] == ["early-long", "late-short"]  # re-keyed with the new γ
    q2 = _q(adapt_gamma=True, min_samples=20, update_every=20, update_min_interval_s=0, window_s=1e4)
    g1 = q2.gamma
    for i in range(20):  # a wide tail → γ down (LAS-ward)
        q2.observe_completion(req(f"done{i}", float(i)), 1.0 + 30.0 * i, 50)
    assert q2.gamma < g1


def test_gateway_measures_tau_from_completions_while_holding() -> None:
    q = build("queue", "tail_aware", {"tau_prior_s": 0.01})
    assert isinstance(q, TailAwareQueue) and q.tau == 0.01
    q.observe_completion(req("x", 0.0), 1.0, 100)  # nothing held: not a saturation sample
    assert q.measured_tau() is None
    q.push(req("held", 0.0), 0.0)
    for i in range(11):  # 150 tokens (100 prompt + 50 out) finishing every 0.1 s → 1,500 tok/s
        q.observe_completion(req(f"d{i}", 0.0, 100), 1.0 + 0.1 * i, 50)
    assert q.measured_tau() == pytest.approx(0.1 / 150)
    assert TailAwareQueueParams().bin_tokens == 256
