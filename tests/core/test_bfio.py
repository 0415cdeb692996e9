"""BF-IO and the DP decode group: metrics, decisions on hand-built states, the exact oracle, the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.errors import PolicyError
from core.sim.dp.assign import BfIo, BfIoParams, FcfsAssign, Jsq, JsqParams, build
from core.sim.dp.engine import simulate_dp
from core.sim.dp.model import (
    PAPER_T_TOK_S,
    DPGroup,
    DPState,
    PowerModel,
    Waiting,
    assignment_cost,
    check_assignment,
    fillable,
    idle_fraction,
    imbalance,
    project_loads,
)
from core.sim.dp.oracle import IoOracle, OracleParams, solve_round

# --- the model ----------------------------------------------------------------------------------


def test_imbalance_idle_and_energy_on_a_hand_computed_case() -> None:
    loads = np.array([10, 4, 7])
    assert imbalance(loads) == 3 * 10 - 21 == 9
    assert idle_fraction(loads) == pytest.approx((0 + 0.6 + 0.3) / 3)
    assert idle_fraction(loads) == pytest.approx(imbalance(loads) / (3 * 10))
    assert imbalance(np.array([5, 5])) == 0 and idle_fraction(np.zeros(3)) == 0.0
    watts = PowerModel().rank_power_w(np.array([0, 5, 10]))
    assert watts == pytest.approx([100.0, 100.0 + 300.0 * 0.5**0.7, 400.0])
    assert PowerModel().step_energy_j(np.array([0, 5, 10]), 0.5) == pytest.approx(watts.sum() * 0.5)


def test_step_time_is_overhead_plus_per_token_times_the_straggler() -> None:
    group = DPGroup(ranks=2, slots=4, overhead_s=0.005, t_tok_s=1e-6)
    assert group.step_time(np.array([100, 300])) == pytest.approx(0.005 + 300e-6)
    paper = DPGroup.paper(16, 72)
    assert paper.overhead_s == pytest.approx((0.6e-3 * 72 + 35e-3) / 16)  # 4.89 ms
    assert paper.t_tok_s == PAPER_T_TOK_S == pytest.approx(1.5 * 2 * 576 * 61e-6 / 2**20)
    with pytest.raises(ValueError):
        DPGroup(ranks=0, slots=4, overhead_s=0.0, t_tok_s=0.0)


def test_projection_drops_predicted_completions_and_grows_survivors() -> None:
    # rank 0: sizes 10 (1 step left) and 20 (3 left); rank 1: size 5 (5 left)
    state = DPState.from_requests(2, 4, [0, 0, 1], [10, 20, 5], remaining=[1, 3, 5])
    assert project_loads(state, 3).tolist() == [[30, 21, 22, 0], [5, 6, 7, 8]]
    blind = DPState.from_requests(2, 4, [0, 0, 1], [10, 20, 5])
    assert project_loads(blind, 3).tolist() == [[30, 32, 34, 36], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="lookahead"):
        project_loads(DPState.from_loads([30, 5], [2, 1], 4), 3)


def test_snapshots_reject_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="slots"):
        DPState.from_loads([1, 2], [5, 0], slots=4)
    with pytest.raises(ValueError, match="add up"):
        DPState(np.array([10, 0]), np.array([1, 0]), np.array([4, 4]), np.array([0]), np.array([9]))
    with pytest.raises(ValueError, match=">= 1"):
        DPState.from_requests(1, 4, [0], [10], remaining=[0])


# --- decisions on hand-built states -------------------------------------------------------------


def test_fcfs_fills_ranks_in_index_order_from_the_head_of_the_pool() -> None:
    state = DPState.from_loads([0, 0, 0], running=[2, 4, 3], slots=4)  # free 2, 0, 1
    assert FcfsAssign().assign(state, Waiting(np.array([5, 6, 7, 8]))) == [(0, 0), (1, 0), (2, 2)]
    assert FcfsAssign().assign(state, Waiting(np.array([5]))) == [(0, 0)]


def test_jsq_sends_each_request_in_order_to_the_least_loaded_open_rank() -> None:
    state = DPState.from_loads([100, 50, 80], running=[3, 2, 3], slots=4)  # free 1, 2, 1
    waiting = Waiting(np.array([10, 30, 5, 7]))
    # by tokens: 10→r1 (60), 30→r1 (90, full), 5→r2 (85, full), 7→r0
    assert Jsq().assign(state, waiting) == [(0, 1), (1, 1), (2, 2), (3, 0)]
    # by requests (running 3, 2, 3): r1 (→3), then all tie at 3: r0 (full), r1 (full), r2
    by_count = Jsq(JsqParams(by="requests"))
    assert by_count.assign(state, waiting) == [(0, 1), (1, 0), (2, 1), (3, 2)]


def test_bf_io_h0_puts_the_largest_new_request_on_the_least_loaded_rank() -> None:
    state = DPState.from_loads([1000, 0, 500], running=[1, 1, 1], slots=2)
    waiting = Waiting(np.array([900, 100, 400]))
    pairs = BfIo().assign(state, waiting)
    assert sorted(pairs) == [(0, 1), (1, 0), (2, 2)]  # loads 1100, 900, 900
    assert FcfsAssign().assign(state, waiting) == [(0, 0), (1, 1), (2, 2)]  # loads 1900, 100, 900
    assert assignment_cost(state, waiting, pairs) == 3 * 1100 - 2900
    assert assignment_cost(state, waiting, FcfsAssign().assign(state, waiting)) == 3 * 1900 - 2900


def test_bf_io_h0_exchange_pass_fixes_the_cardinality_trap_of_plain_lpt() -> None:
    # Rank 2 has one slot. Plain LPT: 380→r0, 359→r1, 208→r2, 206→r1 (565), 64→r0 (max 565).
    # Swapping 359 and 208 gives 444 / 414 / 463: the optimum.
    state = DPState.from_loads([0, 0, 104], running=[0, 0, 1], slots=2)
    waiting = Waiting(np.array([64, 206, 380, 208, 359]))
    plain = BfIo(BfIoParams(refine=False)).assign(state, waiting)
    refined = BfIo().assign(state, waiting)
    assert assignment_cost(state, waiting, plain) == 3 * 565 - 1321
    assert assignment_cost(state, waiting, refined) == 3 * 463 - 1321
    assert solve_round(state, waiting, admitted=range(5)).cost == 3 * 463 - 1321


def test_bf_io_lookahead_anticipates_a_completion() -> None:
    # Rank 0 holds 1000 tokens that finish next step; rank 1 holds 600 that stay.
    state = DPState.from_requests(2, 4, [0, 1], [1000, 600], remaining=[1, 50])
    waiting = Waiting(np.array([500]))
    assert BfIo().assign(state, waiting) == [(0, 1)]  # H = 0: least loaded now
    assert BfIo(BfIoParams(horizon=5)).assign(state, waiting) == [(0, 0)]
    with pytest.raises(ValueError, match="lookahead"):
        BfIo(BfIoParams(horizon=5)).assign(DPState.from_loads([1000, 600], [1, 1], 4), waiting)


def test_bf_io_pool_mode_chooses_which_requests_and_caps_the_wait() -> None:
    state = DPState.from_loads([1000, 600], running=[4, 3], slots=4)  # one free slot, on rank 1
    waiting = Waiting(np.array([50, 400, 390, 900]), waited=np.array([10, 0, 0, 0]))
    assert BfIo().assign(state, waiting) == [(0, 1)]  # FCFS admission: the oldest
    assert BfIo(BfIoParams(admit="pool")).assign(state, waiting) == [(1, 1)]  # fills 400 of room
    capped = BfIo(BfIoParams(admit="pool", max_wait_steps=5))
    assert capped.assign(state, waiting) == [(0, 1)]  # the overdue request goes first
    assert solve_round(state, waiting).pairs == [(1, 1)]


def test_params_are_validated_and_policies_built_by_name() -> None:
    with pytest.raises(ValidationError):
        BfIoParams(horizon=-1)
    with pytest.raises(ValidationError):
        BfIoParams(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        JsqParams(by="vibes")  # type: ignore[arg-type]
    assert build("bf_io", horizon=80).params == BfIoParams(horizon=80)
    assert build("bf_io", horizon=3).needs_requests and not build("bf_io").needs_requests
    with pytest.raises(PolicyError, match="fcfs, jsq, bf_io"):
        build("nope")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    sizes=st.lists(st.integers(0, 3000), min_size=0, max_size=20),
    policy=st.sampled_from(
        [
            ("fcfs", {}),
            ("jsq", {}),
            ("jsq", {"by": "requests"}),
            ("bf_io", {}),
            ("bf_io", {"admit": "pool"}),
            ("bf_io", {"horizon": 4}),
            ("bf_io", {"horizon": 4, "admit": "pool", "max_wait_steps": 1}),
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_every_policy_admits_exactly_the_fillable_requests_into_free_slots(
    running: list[int], sizes: list[int], policy: tuple[str, dict[str, object]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rank_of = np.repeat(np.arange(len(running)), running)
    state = DPState.from_requests(
        len(running),
        4,
        rank_of,
        rng.integers(1, 2000, len(rank_of)),
        rng.integers(1, 8, len(rank_of)),
    )
    waiting = Waiting(np.array(sizes, dtype=np.int64), rng.integers(0, 3, len(sizes)))
    pairs = build(policy[0], **policy[1]).assign(state, waiting)
    check_assignment(state, waiting, pairs)  # raises unless distinct, in free slots, n_k of them


# --- the exact oracle ---------------------------------------------------------------------------


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
    assert assignment_cost(state, waiting, BfIo().assign(state, waiting)) == result.cost
    assert IoOracle(OracleParams()).assign(state, waiting) == result.pairs


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
        ours = assignment_cost(state, waiting, BfIo(BfIoParams(horizon=horizon)).assign(state, waiting), horizon)
        fcfs = assignment_cost(state, waiting, FcfsAssign().assign(state, waiting), horizon)
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
        ours = assignment_cost(state, waiting, BfIo(BfIoParams(admit="pool")).assign(state, waiting))
        assert ours >= best.cost - 1e-6 * max(1.0, abs(best.cost))
        hits += ours <= best.cost + 1e-6 * max(1.0, abs(best.cost))
    assert hits >= 32  # measured 34/40 (13/40 without the exchange pass)


# --- the simulator ------------------------------------------------------------------------------


def test_simulation_matches_a_hand_computed_run() -> None:
    group = DPGroup(ranks=2, slots=1, overhead_s=0.01, t_tok_s=0.001)
    prompt, output = np.array([10, 5, 3]), np.array([2, 1, 1])
    r = simulate_dp(FcfsAssign(), group, prompt, output, reveal_target=8)
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
    "policy", [FcfsAssign(), Jsq(), BfIo(), BfIo(BfIoParams(horizon=8)), BfIo(BfIoParams(admit="pool"))]
)
def test_simulation_conserves_requests_and_tokens(policy: FcfsAssign | Jsq | BfIo) -> None:
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
        fcfs = simulate_dp(FcfsAssign(), group, prompt, output)
        ours = simulate_dp(BfIo(), group, prompt, output)
        assert ours.avg_imbalance < 0.5 * fcfs.avg_imbalance  # measured 2.4-3.2x lower
        assert ours.throughput_tok_s > fcfs.throughput_tok_s
        assert ours.mean_tpot_s < fcfs.mean_tpot_s


def test_open_arrivals_underloaded_group_never_queues() -> None:
    prompt, output = _workload(2, 400)
    arrivals = np.arange(400) * 1.0  # one request a second: far below capacity
    r = simulate_dp(BfIo(), DPGroup.paper(4, 8), prompt, output, arrivals_s=arrivals)
    assert r.finished == 400 and r.max_wait_steps == 0
    assert np.all(r.start_s >= arrivals)


def test_simulator_is_seeded_and_rejects_a_policy_that_overfills() -> None:
    prompt, output = _workload(3, 600)
    group = DPGroup.paper(4, 8)
    lookahead = BfIo(BfIoParams(horizon=8))
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
