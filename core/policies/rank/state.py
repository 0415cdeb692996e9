"""What a rank policy decides on: a data-parallel group's snapshot (`DPState`), the waiting pool and the IO objective.

Model (shared/design/papers/bf-io.md §2): G ranks of B slots; a request resident on rank g weighs
w_i = s_i + gen_i KV tokens and grows by one token per step; rank load L_g = Σ w_i, and every step
waits for the most loaded rank. The IO objective (§3.2) sums, over the next H steps, the tokens
the other ranks could have processed while they wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Pairs = list[tuple[int, int]]
"""(waiting index, rank) for every admitted request."""

TOL = 1e-9
"""Tolerance of cost comparisons in the assignment policies."""


def _ints(a: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    out = np.asarray(a, dtype=np.int64).reshape(-1)
    if len(out) and out.min() < 0:
        raise ValueError(f"{name} must be non-negative")
    return out


@dataclass(frozen=True, eq=False)
class DPState:
    """Snapshot of one group at a decision point: after the step's completions, before admission.

    Per-rank `loads`, `running` and `capacity` suffice for H = 0 policies. Lookahead (H > 0) also
    needs the resident requests: their rank, size w_i = s_i + gen_i and predicted remaining steps.
    """

    loads: np.ndarray
    """(G,) resident KV tokens per rank."""
    running: np.ndarray
    """(G,) resident requests per rank."""
    capacity: np.ndarray
    """(G,) slots per rank (B, a rank's max_num_seqs)."""
    active_rank: np.ndarray | None = None
    """(n,) rank of each resident request (optional)."""
    active_size: np.ndarray | None = None
    """(n,) its current KV tokens s_i + gen_i."""
    active_remaining: np.ndarray | None = None
    """(n,) predicted remaining decode steps (≥ 1); None: no predictor, every request survives H."""

    def __post_init__(self) -> None:
        loads, running = _ints(self.loads, "loads"), _ints(self.running, "running")
        capacity = _ints(self.capacity, "capacity")
        if not (len(loads) == len(running) == len(capacity)) or not len(loads):
            raise ValueError("loads, running and capacity need one entry per rank (at least one)")
        if np.any(running > capacity):
            raise ValueError("a rank runs more requests than it has slots")
        object.__setattr__(self, "loads", loads)
        object.__setattr__(self, "running", running)
        object.__setattr__(self, "capacity", capacity)
        if self.active_rank is None:
            if self.active_size is not None or self.active_remaining is not None:
                raise ValueError("active_size/active_remaining need active_rank")
            return
        rank = _ints(self.active_rank, "active_rank")
        size = _ints(self.active_size if self.active_size is not None else [], "active_size")
        if len(size) != len(rank) or (len(rank) and rank.max() >= len(loads)):
            raise ValueError("active_rank/active_size disagree in length or name a missing rank")
        g = len(loads)
        if not np.array_equal(np.bincount(rank, minlength=g), running) or not np.array_equal(
            np.bincount(rank, weights=size, minlength=g).astype(np.int64), loads
        ):
            raise ValueError("per-request detail does not add up to loads/running")
        object.__setattr__(self, "active_rank", rank)
        object.__setattr__(self, "active_size", size)
        if self.active_remaining is not None:
            rem = _ints(self.active_remaining, "active_remaining")
            if len(rem) != len(rank) or (len(rem) and rem.min() < 1):
                raise ValueError("active_remaining needs one value >= 1 per resident request")
            object.__setattr__(self, "active_remaining", rem)

    @property
    def ranks(self) -> int:
        return len(self.loads)

    @property
    def free(self) -> np.ndarray:
        """(G,) free slots per rank."""
        free: np.ndarray = self.capacity - self.running
        return free

    @classmethod
    def from_loads(cls, loads: Sequence[int] | np.ndarray, running: Sequence[int] | np.ndarray, slots: int) -> DPState:
        """A snapshot from per-rank counters only (enough for fcfs, jsq and bf_io with H = 0)."""
        running_arr = np.asarray(running, dtype=np.int64)
        return cls(np.asarray(loads), running_arr, np.full(len(running_arr), slots, dtype=np.int64))

    @classmethod
    def from_requests(
        cls,
        ranks: int,
        slots: int,
        rank_of: Sequence[int] | np.ndarray,
        size: Sequence[int] | np.ndarray,
        remaining: Sequence[int] | np.ndarray | None = None,
        *,
        overfull: bool = False,
    ) -> DPState:
        """A snapshot from the resident requests (rank, s_i + gen_i, predicted remaining steps).

        `overfull`: a rank may hold more requests than its slots (a live group queues what does
        not fit); such a rank has no free slot instead of being an error."""
        rank_arr, size_arr = _ints(rank_of, "rank_of"), _ints(size, "size")
        if len(rank_arr) != len(size_arr) or (len(rank_arr) and rank_arr.max() >= ranks):
            raise ValueError("rank_of and size must have equal length and name ranks < G")
        loads = np.bincount(rank_arr, weights=size_arr, minlength=ranks).astype(np.int64)
        running = np.bincount(rank_arr, minlength=ranks).astype(np.int64)
        capacity = np.full(ranks, slots, dtype=np.int64)
        return cls(
            loads,
            running,
            np.maximum(capacity, running) if overfull else capacity,
            rank_arr,
            size_arr,
            None if remaining is None else np.asarray(remaining),
        )


@dataclass(frozen=True, eq=False)
class Waiting:
    """The central waiting pool, oldest first: each request's KV tokens on admission and its wait."""

    sizes: np.ndarray
    """(n,) KV tokens the request brings to its rank (its prompt, s_i)."""
    waited: np.ndarray | None = None
    """(n,) steps it has waited in the pool (zeros when None)."""

    def __post_init__(self) -> None:
        sizes = _ints(self.sizes, "sizes")
        object.__setattr__(self, "sizes", sizes)
        waited = np.zeros(len(sizes), dtype=np.int64) if self.waited is None else _ints(self.waited, "waited")
        if len(waited) != len(sizes):
            raise ValueError("waited needs one entry per waiting request")
        object.__setattr__(self, "waited", waited)

    def __len__(self) -> int:
        return len(self.sizes)


def fillable(state: DPState, waiting: Waiting) -> int:
    """n_k = min(|W|, Σ_g free_g): how many requests a round must admit."""
    return int(min(len(waiting), int(state.free.sum())))


def horizon_weights(horizon: int, decay: float) -> np.ndarray:
    """d_h = decay^h, h = 0..H (the authors' 0.86^h; decay 1 is the paper's unweighted sum)."""
    weights: np.ndarray = np.power(float(decay), np.arange(horizon + 1, dtype=np.float64))
    return weights


def project_loads(state: DPState, horizon: int) -> np.ndarray:
    """(G, H+1) predicted loads L̂_g(k+h) of the resident requests, without new admissions.

    A resident request with predicted remaining r steps is still there after h more steps iff
    r > h, and then weighs w_i + h. Without a predictor every request survives the window.
    """
    g = state.ranks
    h = np.arange(horizon + 1, dtype=np.float64)
    out = state.loads[:, None].astype(np.float64) + state.running[:, None] * h[None, :]
    if horizon == 0:
        return out
    if state.active_rank is None:
        raise ValueError("a lookahead (H > 0) needs the resident requests in the snapshot")
    rem = state.active_remaining
    if rem is None:
        return out
    assert state.active_size is not None
    done = rem <= horizon
    rank, size, when = state.active_rank[done], state.active_size[done], rem[done]
    gone_size = np.zeros((g, horizon + 1))
    gone_count = np.zeros((g, horizon + 1))
    np.add.at(gone_size, (rank, when), size)
    np.add.at(gone_count, (rank, when), 1.0)
    out -= np.cumsum(gone_size, axis=1) + np.cumsum(gone_count, axis=1) * h[None, :]
    return out


def io_cost(projected: np.ndarray, weights: np.ndarray) -> float:
    """Σ_h d_h (G·max_g L̂_g(k+h) − Σ_g L̂_g(k+h)): the (IO) objective of shared/design/papers/bf-io.md §3.2."""
    g = projected.shape[0]
    per_h = g * projected.max(axis=0) - projected.sum(axis=0)
    return float(np.dot(weights, per_h))


def assignment_cost(
    state: DPState,
    waiting: Waiting,
    pairs: Sequence[tuple[int, int]],
    horizon: int = 0,
    decay: float = 0.86,
) -> float:
    """The IO objective of admitting `pairs` (waiting index, rank): a new request weighs s_i + h."""
    lhat = project_loads(state, horizon)
    h = np.arange(horizon + 1, dtype=np.float64)
    for i, rank in pairs:
        lhat[rank] += float(waiting.sizes[i]) + h
    return io_cost(lhat, horizon_weights(horizon, decay))


def check_assignment(state: DPState, waiting: Waiting, pairs: Sequence[tuple[int, int]]) -> None:
    """Raise ValueError unless `pairs` admits distinct waiting requests into free slots, filling n_k."""
    seen: set[int] = set()
    used = np.zeros(state.ranks, dtype=np.int64)
    for i, rank in pairs:
        if not (0 <= i < len(waiting)) or i in seen:
            raise ValueError(f"waiting index {i} is out of range or admitted twice")
        if not (0 <= rank < state.ranks):
            raise ValueError(f"rank {rank} does not exist")
        seen.add(i)
        used[rank] += 1
    if np.any(used > state.free):
        raise ValueError("an assignment overfills a rank")
    if len(pairs) != fillable(state, waiting):
        raise ValueError(f"admitted {len(pairs)} requests, the round must admit {fillable(state, waiting)}")


def dp_state(ranks: int, slots: int, rank_of: np.ndarray, size: np.ndarray, remaining: np.ndarray | None) -> DPState:
    """The snapshot a rank policy decides on, from the requests resident on one group (a rank
    holding more than its slots, the rest queued by the group, simply has none free)."""
    return DPState.from_requests(ranks, max(slots, 1), rank_of, size, remaining, overfull=True)
