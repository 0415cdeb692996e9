"""The exact BF-IO integer program for one admission round, solved with HiGHS (small instances only).

(IO), shared/design/papers/bf-io.md §3.2: binaries x_ig (waiting i → rank g with a free slot),
continuous envelopes M_h ≥ L̂_g(k+h) for every rank and h = 0..H, minimise
Σ_h d_h (G·M_h − Σ_g L̂_g(k+h)) subject to Σ_g x_ig ≤ 1, Σ_i x_ig ≤ free_g and Σ x = n_k.
A new request adds s_i + h at step h. HiGHS comes from `highspy`, else from `scipy.optimize.milp`.
At G = 64 with 256 waiting it already takes 0.2-1 s per round: use it to score heuristics offline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.policies.rank.base import DPParams
from core.policies.rank.state import (
    DPState,
    Pairs,
    Waiting,
    assignment_cost,
    fillable,
    horizon_weights,
    project_loads,
)

MAX_BINARIES = 20_000
"""Refuse instances with more assignment variables than this (the MILP is for small checks)."""


@dataclass(frozen=True)
class OracleResult:
    """An optimal (or best found) assignment for one round and its IO cost."""

    pairs: Pairs
    cost: float
    """IO objective of `pairs`, recomputed with model.assignment_cost."""
    optimal: bool
    """Whether the solver proved optimality (False: time limit hit, best incumbent returned)."""
    solver: str
    runtime_s: float


@dataclass(frozen=True)
class _Milp:
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    rows: list[tuple[list[int], list[float], float, float]]
    """(column indices, coefficients, lower, upper) per constraint row."""


def _build(
    state: DPState, waiting: Waiting, cand: list[int], exact: bool, horizon: int, decay: float
) -> tuple[_Milp, list[tuple[int, int]]]:
    g_count = state.ranks
    base = project_loads(state, horizon)
    w = horizon_weights(horizon, decay)
    h = np.arange(horizon + 1, dtype=np.float64)
    open_ranks = [g for g in range(g_count) if state.free[g] > 0]
    cols = [(i, g) for i in cand for g in open_ranks]
    nx, nm = len(cols), horizon + 1
    sizes = waiting.sizes.astype(np.float64)
    cost = np.concatenate([[-(sizes[i] * w.sum() + w @ h) for i, _ in cols], g_count * w])
    lower = np.concatenate([np.zeros(nx), base.max(axis=0)])
    upper = np.concatenate([np.ones(nx), np.full(nm, np.inf)])
    integer = np.concatenate([np.ones(nx, dtype=bool), np.zeros(nm, dtype=bool)])
    rows: list[tuple[list[int], list[float], float, float]] = []
    by_rank: dict[int, list[int]] = {g: [] for g in open_ranks}
    by_req: dict[int, list[int]] = {i: [] for i in cand}
    for c, (i, g) in enumerate(cols):
        by_rank[g].append(c)
        by_req[i].append(c)
    for g in open_ranks:  # M_h − Σ_i (s_i + h) x_ig ≥ L̂_g(h); full ranks are in M_h's lower bound
        for hh in range(nm):
            idx = [nx + hh, *by_rank[g]]
            val = [1.0, *[-(sizes[cols[c][0]] + hh) for c in by_rank[g]]]
            rows.append((idx, val, float(base[g, hh]), np.inf))
    for i in cand:
        rows.append((by_req[i], [1.0] * len(by_req[i]), 1.0 if exact else 0.0, 1.0))
    for g in open_ranks:
        rows.append((by_rank[g], [1.0] * len(by_rank[g]), 0.0, float(state.free[g])))
    n = fillable(state, waiting)
    rows.append((list(range(nx)), [1.0] * nx, float(n), float(n)))
    return _Milp(cost, lower, upper, integer, rows), cols


def _solve_highspy(m: _Milp, time_limit_s: float) -> tuple[np.ndarray, bool]:
    import highspy  # deferred: only the oracle needs a MILP solver

    h = highspy.Highs()  # type: ignore[no-untyped-call]
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-7)
    lp = highspy.HighsLp()
    lp.num_col_ = len(m.cost)
    lp.num_row_ = len(m.rows)
    lp.col_cost_ = m.cost
    lp.col_lower_ = m.lower
    lp.col_upper_ = np.where(np.isinf(m.upper), highspy.kHighsInf, m.upper)
    lp.row_lower_ = np.array([r[2] for r in m.rows])
    lp.row_upper_ = np.array([highspy.kHighsInf if np.isinf(r[3]) else r[3] for r in m.rows])
    starts = np.cumsum([0] + [len(r[0]) for r in m.rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = np.array([c for r in m.rows for c in r[0]], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([v for r in m.rows for v in r[1]], dtype=np.float64)
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous for flag in m.integer
    ]
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        raise RuntimeError(f"HiGHS failed on the IO round: {h.modelStatusToString(status)}")
    x = np.asarray(h.getSolution().col_value, dtype=np.float64)
    if len(x) != len(m.cost):
        raise RuntimeError("HiGHS hit the time limit without a feasible assignment")
    return x, status == highspy.HighsModelStatus.kOptimal


def _solve_scipy(m: _Milp, time_limit_s: float) -> tuple[np.ndarray, bool]:
    from scipy.optimize import Bounds, LinearConstraint, milp  # deferred fallback

    a = np.zeros((len(m.rows), len(m.cost)))
    for r, (idx, val, _, _) in enumerate(m.rows):
        a[r, idx] = val
    res = milp(
        m.cost,
        integrality=m.integer.astype(int),
        bounds=Bounds(m.lower, m.upper),
        constraints=LinearConstraint(a, [r[2] for r in m.rows], [r[3] for r in m.rows]),
        options={"time_limit": float(time_limit_s), "mip_rel_gap": 0.0},
    )
    if res.x is None:
        raise RuntimeError(f"scipy.optimize.milp failed on the IO round: {res.message}")
    return np.asarray(res.x, dtype=np.float64), bool(res.status == 0)


def solve_round(
    state: DPState,
    waiting: Waiting,
    horizon: int = 0,
    decay: float = 0.86,
    admitted: Sequence[int] | None = None,
    time_limit_s: float = 60.0,
) -> OracleResult:
    """Solve (IO) for one round. `admitted` fixes which waiting requests enter (then only their
    ranks are chosen, as bf_io with admit="fcfs" does); by default the IO chooses them as well."""
    n = fillable(state, waiting)
    cand = list(range(len(waiting))) if admitted is None else sorted(set(admitted))
    if admitted is not None and len(cand) != n:
        raise ValueError(f"admitted has {len(cand)} requests, the round must admit {n}")
    if n == 0:
        return OracleResult([], assignment_cost(state, waiting, [], horizon, decay), True, "trivial", 0.0)
    if len(cand) * int((state.free > 0).sum()) > MAX_BINARIES:
        raise ValueError("instance too large for the exact oracle (it is meant for small checks)")
    model, cols = _build(state, waiting, cand, admitted is not None, horizon, decay)
    t0 = time.perf_counter()
    try:
        x, optimal = _solve_highspy(model, time_limit_s)
        solver = "highspy"
    except ImportError:
        x, optimal = _solve_scipy(model, time_limit_s)
        solver = "scipy"
    runtime = time.perf_counter() - t0
    pairs = sorted((i, g) for c, (i, g) in enumerate(cols) if x[c] > 0.5)
    return OracleResult(pairs, assignment_cost(state, waiting, pairs, horizon, decay), optimal, solver, runtime)


class IoOracleParams(DPParams):
    """The exact oracle's params: horizon, decay and whether admission is FCFS."""

    horizon: int = 0
    decay: float = 0.86
    fcfs_admission: bool = False
    time_limit_s: float = 60.0


class IoOracle:
    """The exact (IO) round as a policy, to measure a heuristic's optimality gap on small groups."""

    name = "io_oracle"

    def __init__(self, params: IoOracleParams | None = None) -> None:
        self.params: IoOracleParams = params or IoOracleParams()

    @property
    def needs_requests(self) -> bool:
        return self.params.horizon > 0

    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        p = self.params
        admitted = list(range(fillable(state, waiting))) if p.fcfs_admission else None
        return solve_round(state, waiting, p.horizon, p.decay, admitted, p.time_limit_s).pairs
