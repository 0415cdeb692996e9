"""The DP group's step simulator: a hand-computed run, conservation, BF-IO against FCFS, open arrivals, seeding."""

from __future__ import annotations

import numpy as np
import pytest

from core.policies.rank.base import AssigningRankPolicy
from core.policies.rank.bf_io import BfIoParams, BfIoRank
from core.policies.rank.fcfs import FcfsRank
from core.policies.rank.jsq import JsqRank
from core.policies.rank.state import DPState, Waiting, fillable
from core.sim.dp.engine import simulate_dp
from core.sim.dp.model import DPGroup


def test_simulation_matches_a_hand_computed_run() -> None:
    group = DPGroup(ranks=2, slots=1, overhead_s=0.01, t_tok_s=0.001)
    prompt, output = np.array([10, 5, 3]), np.array([2, 1, 1])
    r = simulate_dp(FcfsRank(), group, prompt, output, reveal_target=8)
    # step 1 runs loads [10, 5]: dt 0.02; request 1 finishes (loads after: [11, 0]); 2 → rank 1
    # step 2 runs [11, 3]: dt 0.021; requests 0 and 2 finish. Last assignment after step 1.
    dt1, dt2 = 0.01 + 0.010, 0.01 + 0.011
    assert (r.steps, r.window_steps, r.finished) == (2, 1, 3)
    assert r.avg_imbalance == 2 * 11 - 11 and r.avg_imbalance_barrier == 2 * 10 - 15
    assert r.throughput_tok_s == pytest.approx(2 / dt1)
    assert r.start_step.tolist() == [0, 0, 1] and r.finish_step.tolist() == [2, 1, 2]
    assert r.mean_tpot_s == pytest.approx(((dt1 + dt2) / 2 + dt1 + dt2) / 3)
    assert r.makespan_s == pytest.approx(dt1 + dt2)
    assert r.energy_j == pytest.approx((400 + 100) * dt1)  # loads after step 1: [11, 0]


def _workload(seed: int, n: int = 3000) -> tuple[np.ndarray, np.ndarray]:
    """BurstGPT-like prompts (median 217) and geometric decode lengths (mean 12)."""
    rng = np.random.default_rng(seed)
    prompt = np.maximum(1, rng.lognormal(np.log(217), 1.0, n).astype(np.int64))
    return prompt, rng.geometric(1 / 12, n)


@pytest.mark.parametrize(
    "policy", [FcfsRank(), JsqRank(), BfIoRank(), BfIoRank(BfIoParams(horizon=8)), BfIoRank(BfIoParams(admit="pool"))]
)
def test_simulation_conserves_requests_and_tokens(policy: AssigningRankPolicy) -> None:
    prompt, output = _workload(1, 1500)
    r = simulate_dp(policy, DPGroup.paper(4, 8), prompt, output, noise=0.2, seed=3)
    assert r.finished == r.requests == 1500
    assert np.all(r.start_step >= 0) and np.all(r.finish_step - r.start_step == output)
    assert r.tokens_generated == int(output.sum())  # one token per resident request per step
    assert np.all(r.finish_s > r.start_s)
    assert r.mean_tpot_s == pytest.approx(np.mean((r.finish_s - r.start_s) / output))
    assert 0 < r.window_steps <= r.steps and r.max_wait_steps >= 0


def test_bf_io_beats_fcfs_on_imbalance_in_a_small_simulation() -> None:
    group = DPGroup.paper(8, 16)
    for seed in (0, 1):
        prompt, output = _workload(seed)
        fcfs = simulate_dp(FcfsRank(), group, prompt, output)
        ours = simulate_dp(BfIoRank(), group, prompt, output)
        assert ours.avg_imbalance < 0.5 * fcfs.avg_imbalance  # measured 2.4-3.2x lower
        assert ours.throughput_tok_s > fcfs.throughput_tok_s
        assert ours.mean_tpot_s < fcfs.mean_tpot_s


def test_open_arrivals_underloaded_group_never_queues() -> None:
    prompt, output = _workload(2, 400)
    arrivals = np.arange(400) * 1.0  # one request a second: far below capacity
    r = simulate_dp(BfIoRank(), DPGroup.paper(4, 8), prompt, output, arrivals_s=arrivals)
    assert r.finished == 400 and r.max_wait_steps == 0
    assert np.all(r.start_s >= arrivals)


def test_simulator_is_seeded_and_rejects_a_policy_that_overfills() -> None:
    prompt, output = _workload(3, 600)
    group = DPGroup.paper(4, 8)
    lookahead = BfIoRank(BfIoParams(horizon=8))
    a = simulate_dp(lookahead, group, prompt, output, noise=0.3, seed=5)
    b = simulate_dp(lookahead, group, prompt, output, noise=0.3, seed=5)
    assert a.avg_imbalance == b.avg_imbalance and np.array_equal(a.finish_step, b.finish_step)

    class Greedy:
        name = "overfill"
        params = BfIoParams()
        needs_requests = False

        def assign(self, state: DPState, waiting: Waiting) -> list[tuple[int, int]]:
            return [(i, 0) for i in range(fillable(state, waiting))]  # everything on rank 0

    with pytest.raises(ValueError, match="overfills"):
        simulate_dp(Greedy(), group, prompt, output)
