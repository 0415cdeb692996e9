"""Rank policy `bf_io`, BF-IO (shared/design/papers/bf-io.md §3.5): a greedy on the predicted imbalance over the
next H steps.

New requests in decreasing size, each to the rank where it raises the projected straggler envelope
least (tie: least projected load). With H = 0 that is "largest request to the least loaded rank",
done with a heap, then an exchange pass moves requests off the straggler while that lowers the cost
(the exchange argument of Thm 1); H > 0 uses lookahead.py. `admit="pool"` also chooses *which*
requests to admit, by the exact IO increment G·Δmax − Δ(Σ load), as the IO and the authors' code
do; `max_wait_steps` bounds the starvation that causes.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Literal

import numpy as np
from pydantic import Field

from core.policies.rank.base import AssigningRankPolicy, DPParams
from core.policies.rank.lookahead import Lookahead
from core.policies.rank.state import TOL, DPState, Pairs, Waiting, fillable
from core.policies.registry import register
from core.types import PolicyKind


class BfIoParams(DPParams):
    """BF-IO: minimise the predicted imbalance over the next H steps, greedily."""

    horizon: int = Field(
        0,
        ge=0,
        le=512,
        description=(
            "H, lookahead steps; 0 uses current loads only (no predictor, the variant the theory "
            "covers); H > 0 needs predicted remaining lengths of the resident requests"
        ),
    )
    decay: float = Field(
        0.86,
        gt=0.0,
        le=1.0,
        description="weight decay^h of the h-th lookahead step (authors' code: 0.86; 1 = paper's sum)",
    )
    admit: Literal["fcfs", "pool"] = Field(
        "fcfs",
        description=(
            "fcfs: admit the oldest n_k requests, choose only their ranks (no starvation); pool: "
            "also choose which requests to admit by the IO cost, which favours large prompts "
            "(as the IO and the authors' code do)"
        ),
    )
    pool_window: int = Field(
        0,
        ge=0,
        description="pool: consider only the oldest max(N, n_k) waiting requests (0: all of them)",
    )
    max_wait_steps: int = Field(
        0,
        ge=0,
        description="pool: requests that have waited this many steps are admitted first (0: no cap)",
    )
    refine: bool = Field(
        True,
        description=(
            "after the greedy, move/swap new requests off the straggler (and, pool mode, exchange "
            "them for waiting ones) while that lowers the cost: a local search to a 1-exchange optimum"
        ),
    )


@register(
    PolicyKind.RANK,
    "bf_io",
    BfIoParams,
    "BF-IO: the rank where the request raises the predicted straggler load least over the next H steps",
)
class BfIoRank(AssigningRankPolicy):
    """BF-IO (shared/design/papers/bf-io.md §3.5): greedy on the horizon-H imbalance objective."""

    params: BfIoParams

    def __init__(self, params: BfIoParams | None = None) -> None:
        super().__init__(params or BfIoParams())
        self.needs_requests = self.params.horizon > 0

    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        p = self.params
        n = fillable(state, waiting)
        if n == 0:
            return []
        sizes = waiting.sizes
        if p.admit == "fcfs":
            forced, pool = list(range(n)), []
        else:
            window = len(waiting) if p.pool_window == 0 else min(len(waiting), max(p.pool_window, n))
            assert waiting.waited is not None
            overdue = (
                np.flatnonzero(waiting.waited[:window] >= p.max_wait_steps)[:n].tolist() if p.max_wait_steps > 0 else []
            )
            taken = set(overdue)
            forced, pool = overdue, [i for i in range(window) if i not in taken]
        if p.horizon == 0:
            loads = state.loads.tolist()
            free = state.free.tolist()
            pairs = _lpt_h0(loads, free, sizes, forced)
            rest = n - len(pairs)
            if rest > 0:
                pairs += _pool_h0(loads, free, sizes, pool, rest)
            if p.refine:
                left = sorted(set(pool) - {i for i, _ in pairs}) if p.admit == "pool" else []
                loads_arr = np.asarray(loads, dtype=np.float64)
                free_arr = np.asarray(free, dtype=np.int64)
                locked = set(forced) if pool else set()
                pairs = _refine_h0(loads_arr, free_arr, pairs, sizes, left, locked)
            return pairs
        look = Lookahead(state, p.horizon, p.decay)
        pairs = look.place_in_order(sizes, forced)
        rest = n - len(pairs)
        if rest > 0:
            pairs += look.place_from_pool(sizes, pool, rest)
        if p.refine:
            left = sorted(set(pool) - {i for i, _ in pairs}) if p.admit == "pool" else []
            pairs = look.refine(pairs, sizes, left, set(forced) if pool else set())
        return pairs


# --- H = 0 ------------------------------------------------------------------------------------


def _lpt_h0(loads: list[int], free: list[int], sizes: np.ndarray, admitted: list[int]) -> Pairs:
    """Largest first, each to the least loaded rank with a free slot (tie: lowest index).

    With H = 0 the IO increment of a rank, G·max(0, L_g + s − max L), and the tie-break (least
    load) both grow with L_g, so the least loaded rank is the greedy's choice. Updates loads/free.
    """
    heap = [(loads[g], g) for g in range(len(loads)) if free[g] > 0]
    heapq.heapify(heap)
    s = sizes.tolist()
    order = sorted(admitted, key=lambda i: -s[i])
    out: Pairs = []
    for i in order:
        load, g = heapq.heappop(heap)
        load += s[i]
        loads[g] = load
        free[g] -= 1
        out.append((i, g))
        if free[g] > 0:
            heapq.heappush(heap, (load, g))
    return out


def _pool_h0(loads: list[int], free: list[int], sizes: np.ndarray, pool: list[int], n: int) -> Pairs:
    """Choose n requests from `pool` and their ranks, each step minimising the IO increment.

    Placing s on rank g costs G·max(0, L_g + s − M) − s (M = max load): the least loaded rank is
    best for every s, and for it the best request is the largest one under the headroom M − L_g,
    or the smallest one above it if its overshoot costs less. Ties go to the oldest request.
    """
    g_count = len(loads)
    s = sizes.tolist()
    keys = sorted((s[i], -i) for i in pool)
    heap = [(loads[g], g) for g in range(g_count) if free[g] > 0]
    heapq.heapify(heap)
    top = max(loads)
    out: Pairs = []
    for _ in range(min(n, len(keys))):
        load, g = heap[0]
        room = top - load
        below = bisect_right(keys, (room, 1)) - 1
        pick, best = -1, float("inf")
        if below >= 0:
            pick, best = below, -float(keys[below][0])
        if below + 1 < len(keys):
            size_up = keys[below + 1][0]
            above = bisect_right(keys, (size_up, 1)) - 1  # the oldest of that size
            cost = g_count * (load + size_up - top) - size_up
            if cost < best - TOL:
                pick = above
        size, neg_i = keys.pop(pick)
        heapq.heappop(heap)
        load += size
        loads[g] = load
        top = max(top, load)
        free[g] -= 1
        out.append((-neg_i, g))
        if free[g] > 0:
            heapq.heappush(heap, (load, g))
    return out


def _refine_h0(
    loads: np.ndarray,
    free: np.ndarray,
    pairs: Pairs,
    sizes: np.ndarray,
    left: list[int],
    locked: set[int],
) -> Pairs:
    """Exchange pass on the final loads: swap a new request off the straggler while the cost drops.

    Moves, best first: (a) pool mode, exchange an admitted request for a waiting one when
    G·Δmax − Δ(Σ load) < 0; (b) swap new requests a (on a maximiser m) and b (elsewhere,
    s_b < s_a), or (c) move a to a rank with a free slot, when both ranks end strictly below the
    max: the max drops or has one maximiser fewer, the tie-break of the theory's exact minimiser.
    Stops at a local optimum. Requests in `locked` (admitted because overdue) are never
    exchanged for waiting ones.
    """
    if not pairs:
        return pairs
    g_count = len(loads)
    idx = np.array([i for i, _ in pairs], dtype=np.int64)
    rank = np.array([g for _, g in pairs], dtype=np.int64)
    size = sizes[idx].astype(np.float64)
    swappable = np.array([i not in locked for i, _ in pairs])
    waiting_idx = np.asarray(left, dtype=np.int64)
    waiting_size = sizes[waiting_idx].astype(np.float64)
    for _ in range(4 * (len(pairs) + g_count)):
        order = np.argsort(-loads, kind="stable")
        top, m = loads[order[0]], int(order[0])
        second = loads[order[1]] if g_count > 1 else -np.inf
        if len(waiting_idx):
            # (a) admitted a (rank g) ↔ waiting c: rank g becomes L_g − s_a + s_c.
            new_g = loads[rank][:, None] - size[:, None] + waiting_size[None, :]
            rest_max = np.where(rank == m, second, top)[:, None]
            delta = g_count * (np.maximum(rest_max, new_g) - top) - (waiting_size[None, :] - size[:, None])
            delta[~swappable] = np.inf
            k = int(np.argmin(delta))
            a, c = divmod(k, len(waiting_idx))
            if delta.flat[k] < -TOL * max(1.0, top):
                loads[rank[a]] += waiting_size[c] - size[a]
                idx[a], waiting_idx[c] = waiting_idx[c], idx[a]
                size[a], waiting_size[c] = waiting_size[c], size[a]
                continue
        on_m = np.flatnonzero(rank == m)
        if not len(on_m):
            break
        off_m = np.flatnonzero(rank != m)
        # (b) swap a (on m) with b (elsewhere); (c) move a to a rank with a free slot.
        d = size[on_m][:, None] - size[off_m][None, :]
        swap_worst = np.where(
            (d > 0) & (loads[rank[off_m]][None, :] + d < top),
            np.maximum(top - d, loads[rank[off_m]][None, :] + d),
            np.inf,
        )
        open_g = np.flatnonzero((free > 0) & (np.arange(g_count) != m))
        moved = loads[open_g][None, :] + size[on_m][:, None]
        move_worst = np.where(
            (size[on_m][:, None] > 0) & (moved < top),
            np.maximum(top - size[on_m][:, None], moved),
            np.inf,
        )
        best_swap = float(swap_worst.min()) if swap_worst.size else np.inf
        best_move = float(move_worst.min()) if move_worst.size else np.inf
        if min(best_swap, best_move) == np.inf:
            break
        if best_move <= best_swap:
            a_k, g_k = divmod(int(np.argmin(move_worst)), len(open_g))
            a, g = int(on_m[a_k]), int(open_g[g_k])
            loads[m] -= size[a]
            loads[g] += size[a]
            free[m] += 1
            free[g] -= 1
            rank[a] = g
            continue
        a_k, b_k = divmod(int(np.argmin(swap_worst)), len(off_m))
        a, b = int(on_m[a_k]), int(off_m[b_k])
        shift = size[a] - size[b]
        loads[m] -= shift
        loads[rank[b]] += shift
        rank[a], rank[b] = rank[b], rank[a]
    return list(zip(idx.tolist(), rank.tolist(), strict=True))
