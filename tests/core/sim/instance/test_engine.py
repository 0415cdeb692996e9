"""The single-instance simulator against hand computations: step times, chunked prefill, preemption by
recompute, admission (spec: shared/design/papers/tail-aware.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.sim.instance.engine import InstanceSim, simulate_instance
from core.sim.instance.model import DONE, REJECTED, WAITING, InstanceParams
from core.sim.instance.orderings import FcfsOrdering, build_ordering
from tests.core.sim.instance.tiny import PROF, PROF2


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
