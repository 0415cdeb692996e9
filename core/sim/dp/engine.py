"""A seeded step simulator of one DP decode group under a rank-assignment policy (the authors' loop).

Each step (shared/design/papers/bf-io.md §5): Δt = C + t_tok·max_g L_g on the loads the step
starts with; every resident request emits one token (+1 KV token); requests with gen ≥ o leave;
the pool is topped up — backlogged: revealed from the not-yet-seen queue until it holds
`reveal_target` (4G) requests, the authors' closed loop; open: requests whose arrival time has
passed join it — and the policy fills free slots. A request's start is its assignment time, so
TPOT excludes queueing. Step metrics are averaged over steps 1..(last step with an assignment),
so the drain tail is excluded, as in the authors' code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.policies.rank.base import DPAssignPolicy
from core.policies.rank.state import DPState, Waiting, check_assignment
from core.sim.dp.model import DPGroup, PowerModel, idle_fraction, imbalance

OVERDUE = 2**31
"""Predicted remaining steps of a request that outlived its prediction: past any horizon."""

Progress = Callable[[int, int, int], None]
"""Called with (finished, total requests, steps) every few wall-clock seconds."""


@dataclass(frozen=True, eq=False)
class DPSimResult:
    """Outcome of one simulated run; step metrics are over the statistics window."""

    policy: str
    requests: int
    finished: int
    steps: int
    window_steps: int
    """Steps the step metrics average over: 1..last step with an assignment (all if none after 0)."""
    avg_imbalance: float
    """Mean Imb = G·max L − Σ L (tokens), measured after each step's completions and before
    admission — where the authors' simulator measures it (Table 1)."""
    avg_imbalance_barrier: float
    """Mean Imb of the loads each step ran with (after admission): what the barrier waits on."""
    idle_fraction: float
    """Mean over steps of mean_g (1 − L_g / max L), at the authors' measurement point."""
    idle_fraction_barrier: float
    throughput_tok_s: float
    """Σ_k |active_k| / Σ_k Δt_k over the window."""
    mean_tpot_s: float
    """mean_i (finish_i − start_i) / o_i over every request."""
    energy_j: float
    """Σ_k Σ_g P_g(k)·Δt_k over the window, P from PowerModel on the authors' measurement point."""
    window_tokens: int
    """Tokens generated in the window (Σ_k |active_k|): energy_j / window_tokens is J per token."""
    avg_power_w: float
    """Mean per-rank power over the window."""
    makespan_s: float
    tokens_generated: int
    mean_wait_steps: float
    """Mean steps a request waited in the pool (0 when assigned the step it was revealed)."""
    max_wait_steps: int
    decisions: int
    decision_s: float
    """Total wall-clock time spent in the policy."""
    start_step: np.ndarray
    finish_step: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    loads: np.ndarray | None = None
    """(steps, G) loads each step ran with, when asked for."""


def predicted_outputs(output: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """o_est = max(1, round(o·U[1 − noise, 1 + noise])): the authors' noise model (noise 0 = oracle)."""
    if not 0.0 <= noise < 1.0:
        raise ValueError("noise must be in [0, 1)")
    u = rng.uniform(1.0 - noise, 1.0 + noise, size=len(output))
    est: np.ndarray = np.maximum(1, np.round(output * u)).astype(np.int64)
    return est


def simulate_dp(
    policy: DPAssignPolicy,
    group: DPGroup,
    prompt: np.ndarray,
    output: np.ndarray,
    *,
    arrivals_s: np.ndarray | None = None,
    reveal_target: int | None = None,
    predicted_output: np.ndarray | None = None,
    noise: float = 0.0,
    seed: int = 0,
    power: PowerModel | None = None,
    keep_loads: bool = False,
    progress: Progress | None = None,
    progress_every_s: float = 5.0,
) -> DPSimResult:
    """Run every request through one DP group under `policy` and return the metrics.

    Backlogged (closed loop, the overloaded regime) unless `arrivals_s` gives open arrival times.
    A lookahead policy sees predicted remaining steps o_est − gen (OVERDUE, i.e. "stays", once a
    request outlives its prediction, as the authors' projection does); o_est comes from
    `predicted_output`, else from `predicted_outputs(output, noise, rng(seed))`.
    """
    s = np.asarray(prompt, dtype=np.int64)
    o = np.asarray(output, dtype=np.int64)
    n_req = len(s)
    if len(o) != n_req or n_req == 0 or s.min() < 0 or o.min() < 1:
        raise ValueError("prompt/output need equal length ≥ 1, prompts ≥ 0 and outputs ≥ 1")
    arrivals = None if arrivals_s is None else np.asarray(arrivals_s, dtype=np.float64)
    if arrivals is not None and (len(arrivals) != n_req or np.any(np.diff(arrivals) < 0)):
        raise ValueError("arrivals_s needs one non-decreasing time per request")
    power = power or PowerModel()
    g_count, slots = group.ranks, group.slots
    target = reveal_target if reveal_target is not None else 4 * g_count
    o_est = None
    if policy.needs_requests:
        o_est = (
            np.asarray(predicted_output, dtype=np.int64)
            if predicted_output is not None
            else predicted_outputs(o, noise, np.random.default_rng(seed))
        )
    gen = np.zeros(n_req, dtype=np.int64)
    start_step = np.full(n_req, -1, dtype=np.int64)
    finish_step = np.full(n_req, -1, dtype=np.int64)
    start_s = np.full(n_req, np.nan)
    finish_s = np.full(n_req, np.nan)
    joined = np.zeros(n_req, dtype=np.int64)
    act_req = np.zeros(0, dtype=np.int64)
    act_rank = np.zeros(0, dtype=np.int64)
    capacity = np.full(g_count, slots, dtype=np.int64)
    pool: list[int] = []
    next_req = 0
    clock, step, last_assign = 0.0, 0, -1
    decisions, decision_s = 0, 0.0
    rows: dict[str, list[float]] = {
        k: [] for k in ("dt", "active", "imb", "imb_b", "idle", "idle_b", "energy", "power")
    }
    kept: list[np.ndarray] = []
    finished = 0
    wall_mark = time.monotonic()

    def reveal() -> None:
        nonlocal next_req
        if arrivals is None:
            take = min(max(target - len(pool), 0), n_req - next_req)
        else:
            take = int(np.searchsorted(arrivals, clock, side="right")) - next_req
        for r in range(next_req, next_req + take):
            pool.append(r)
            joined[r] = step
        next_req += take

    def decide() -> None:
        nonlocal act_req, act_rank, pool, last_assign, decisions, decision_s
        running = np.bincount(act_rank, minlength=g_count).astype(np.int64)
        if not pool or running.sum() >= g_count * slots:
            return
        size = s[act_req] + gen[act_req]
        loads = np.bincount(act_rank, weights=size, minlength=g_count).astype(np.int64)
        if policy.needs_requests:
            assert o_est is not None
            rem = o_est[act_req] - gen[act_req]
            rem[rem <= 0] = OVERDUE  # outlived its prediction: assume it stays (authors' code)
            state = DPState(loads, running, capacity, act_rank, size, rem)
        else:
            state = DPState(loads, running, capacity)
        ids = np.asarray(pool, dtype=np.int64)
        waiting = Waiting(s[ids] + gen[ids], step - joined[ids])
        t0 = time.perf_counter()
        pairs = policy.assign(state, waiting)
        decision_s += time.perf_counter() - t0
        decisions += 1
        check_assignment(state, waiting, pairs)
        if not pairs:
            return
        chosen = np.array([i for i, _ in pairs], dtype=np.int64)
        new_req = ids[chosen]
        act_req = np.concatenate([act_req, new_req])
        act_rank = np.concatenate([act_rank, np.array([g for _, g in pairs], dtype=np.int64)])
        start_step[new_req] = step
        start_s[new_req] = clock
        taken = set(chosen.tolist())
        pool = [r for k, r in enumerate(pool) if k not in taken]
        last_assign = step

    reveal()
    decide()
    while finished < n_req:
        if len(act_req) == 0:
            if arrivals is not None and not pool and next_req < n_req:
                clock = max(clock, float(arrivals[next_req]))  # idle until the next arrival
            reveal()
            decide()
            if len(act_req) == 0:
                if arrivals is not None and next_req < n_req:
                    continue
                raise RuntimeError("the policy admits nothing into an empty group")
        size = s[act_req] + gen[act_req]
        loads_b = np.bincount(act_rank, weights=size, minlength=g_count)
        dt = group.step_time(loads_b)
        active_now = len(act_req)
        clock += dt
        step += 1
        gen[act_req] += 1
        done = gen[act_req] >= o[act_req]
        if done.any():
            fin = act_req[done]
            finish_step[fin] = step
            finish_s[fin] = clock
            finished += len(fin)
            act_req, act_rank = act_req[~done], act_rank[~done]
        loads_a = np.bincount(act_rank, weights=s[act_req] + gen[act_req], minlength=g_count)
        rows["dt"].append(dt)
        rows["active"].append(active_now)
        rows["imb"].append(imbalance(loads_a))
        rows["imb_b"].append(imbalance(loads_b))
        rows["idle"].append(idle_fraction(loads_a))
        rows["idle_b"].append(idle_fraction(loads_b))
        rank_w = power.rank_power_w(loads_a)
        rows["energy"].append(float(rank_w.sum()) * dt)
        rows["power"].append(float(rank_w.mean()))
        if keep_loads:
            kept.append(loads_b.astype(np.int64))
        reveal()
        decide()
        if progress is not None and step % 64 == 0 and time.monotonic() - wall_mark >= progress_every_s:
            wall_mark = time.monotonic()
            progress(finished, n_req, step)

    cut = last_assign if last_assign > 0 else step
    col = {k: np.asarray(v[:cut], dtype=np.float64) for k, v in rows.items()}
    time_sum = float(col["dt"].sum())
    waits = start_step - joined
    return DPSimResult(
        policy=policy.name,
        requests=n_req,
        finished=finished,
        steps=step,
        window_steps=cut,
        avg_imbalance=float(col["imb"].mean()),
        avg_imbalance_barrier=float(col["imb_b"].mean()),
        idle_fraction=float(col["idle"].mean()),
        idle_fraction_barrier=float(col["idle_b"].mean()),
        throughput_tok_s=float(col["active"].sum()) / time_sum if time_sum > 0 else 0.0,
        mean_tpot_s=float(np.mean((finish_s - start_s) / o)),
        energy_j=float(col["energy"].sum()),
        window_tokens=int(col["active"].sum()),
        avg_power_w=float(col["power"].mean()),
        makespan_s=clock,
        tokens_generated=int(np.sum(rows["active"])),
        mean_wait_steps=float(waits.mean()),
        max_wait_steps=int(waits.max()),
        decisions=decisions,
        decision_s=decision_s,
        start_step=start_step,
        finish_step=finish_step,
        start_s=start_s,
        finish_s=finish_s,
        loads=np.vstack(kept) if keep_loads and kept else None,
    )
