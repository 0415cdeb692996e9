"""The exact IO oracle for one round (HiGHS), and BF-IO's greedy measured against it on small instances."""

from __future__ import annotations

import numpy as np
import pytest

from core.policies.rank.bf_io import BfIoParams, BfIoRank
from core.policies.rank.fcfs import FcfsRank
from core.policies.rank.state import DPState, Waiting, assignment_cost, fillable
from core.sim.dp.oracle import IoOracle, IoOracleParams, solve_round


def _tight_instance(rng: np.random.Generator, horizon: int) -> tuple[DPState, Waiting]:
    """A small group whose loads differ by less than a request: placement decides the max."""
    g, b = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    running = rng.integers(0, b, g)
    rank_of = np.repeat(np.arange(g), running)
    remaining = rng.integers(1, 2 * horizon + 2, len(rank_of)) if horizon else None
    state = DPState.from_requests(g, b, rank_of, rng.integers(50, 300, len(rank_of)), remaining)
    n = int(rng.integers(1, min(8, int(state.free.sum())) + 1))
    return state, Waiting(rng.integers(1, 400, n + int(rng.integers(0, 4))))


def test_oracle_solves_a_hand_partition() -> None:
    state = DPState.from_loads([0, 0], running=[0, 0], slots=2)
    waiting = Waiting(np.array([5, 4, 3, 3]))
    result = solve_round(state, waiting)
    assert result.optimal and result.cost == 2 * 8 - 15  # {5, 3} / {4, 3}
    assert assignment_cost(state, waiting, BfIoRank().assign(state, waiting)) == result.cost
    assert IoOracle(IoOracleParams()).assign(state, waiting) == result.pairs


@pytest.mark.parametrize(("horizon", "need"), [(0, 34), (4, 30)])
def test_bf_io_fcfs_admission_reaches_the_milp_optimum_on_most_small_instances(horizon: int, need: int) -> None:
    """40 seeded instances (G ≤ 4, ≤ 8 new requests) where FCFS placement is rarely optimal.

    The greedy is a heuristic for an NP-hard round (balanced multiway partitioning): measured
    here 35/40 optima at H = 0 and 32/40 at H = 4 (27 and 23 without the exchange pass); it
    must never beat the proven optimum.
    """
    rng = np.random.default_rng(7)
    hits = fcfs_hits = 0
    for _ in range(40):
        state, waiting = _tight_instance(rng, horizon)
        admitted = list(range(fillable(state, waiting)))
        best = solve_round(state, waiting, horizon, admitted=admitted)
        assert best.optimal
        ours = assignment_cost(state, waiting, BfIoRank(BfIoParams(horizon=horizon)).assign(state, waiting), horizon)
        fcfs = assignment_cost(state, waiting, FcfsRank().assign(state, waiting), horizon)
        tol = 1e-6 * max(1.0, abs(best.cost))
        assert ours >= best.cost - tol and fcfs >= best.cost - tol
        hits += ours <= best.cost + tol
        fcfs_hits += fcfs <= best.cost + tol
    assert fcfs_hits <= 5  # the instances are not trivial
    assert hits >= need


def test_bf_io_pool_mode_against_the_full_io_including_admission() -> None:
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(40):
        state, waiting = _tight_instance(rng, 0)
        best = solve_round(state, waiting)
        ours = assignment_cost(state, waiting, BfIoRank(BfIoParams(admit="pool")).assign(state, waiting))
        assert ours >= best.cost - 1e-6 * max(1.0, abs(best.cost))
        hits += ours <= best.cost + 1e-6 * max(1.0, abs(best.cost))
    assert hits >= 32  # measured 34/40 (13/40 without the exchange pass)
