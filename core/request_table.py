"""The dispatcher's request table: dense NumPy columns for every tracked request, O(1) add/remove."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

PENDING = 1
"""Routed, prefill (or KV transfer) not finished yet; bound to a decode instance or not."""
RUNNING = 2
"""Decoding on its decode instance."""

_FLOAT_COLUMNS = ("l_in", "l_obs", "t_obs", "v", "tau", "arrival", "decode_start", "max_out", "ttft_slo", "tpot_slo")
_INT_COLUMNS = ("inst", "prefill", "state", "rank")


class RequestTable:
    """Struct-of-arrays over tracked requests; rows are dense (swap-remove), so policies vectorise.

    Columns: `inst` decode instance index (-1 unbound), `prefill` prefill instance index, `state`
    PENDING/RUNNING, `l_in` prompt tokens, `l_obs` generated tokens at the last observation `t_obs`,
    `v` observed decode rate (tokens/s), `tau` projected decode start (pending rows), `arrival`,
    `decode_start`, `max_out` max output tokens (the true output length in the simulator),
    `ttft_slo` / `tpot_slo` the request's latency targets (seconds).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.n = 0
        self.ids: list[Hashable] = []
        self.row: dict[Hashable, int] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        for name in _FLOAT_COLUMNS:
            old = getattr(self, name, None)
            col = np.zeros(capacity, dtype=float)
            if old is not None:
                col[: self.n] = old[: self.n]
            setattr(self, name, col)
        for name in _INT_COLUMNS:
            old = getattr(self, name, None)
            icol = np.full(capacity, -1, dtype=np.int64)
            if old is not None:
                icol[: self.n] = old[: self.n]
            setattr(self, name, icol)
        self._floats = tuple(getattr(self, n) for n in _FLOAT_COLUMNS)
        self._all = self._floats + tuple(getattr(self, n) for n in _INT_COLUMNS)

    # Columns (declared for type checkers; allocated in _alloc).
    l_in: np.ndarray
    l_obs: np.ndarray
    t_obs: np.ndarray
    v: np.ndarray
    tau: np.ndarray
    arrival: np.ndarray
    decode_start: np.ndarray
    max_out: np.ndarray
    ttft_slo: np.ndarray
    tpot_slo: np.ndarray
    inst: np.ndarray
    prefill: np.ndarray
    state: np.ndarray
    rank: np.ndarray
    """Data-parallel rank on its decode instance (-1: none chosen, or not a DP group)."""

    def __len__(self) -> int:
        return self.n

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self.row

    def add(self, rid: Hashable) -> int:
        """Append a zeroed row for `rid` and return its index."""
        if rid in self.row:
            raise KeyError(f"request {rid!r} is already tracked")
        if self.n == self.capacity:
            self._alloc(self.capacity * 2)
        i = self.n
        self.n += 1
        self.ids.append(rid)
        self.row[rid] = i
        for col in self._floats:
            col[i] = 0.0
        self.inst[i] = -1
        self.prefill[i] = -1
        self.rank[i] = -1
        self.state[i] = PENDING
        return i

    def remove(self, rid: Hashable) -> None:
        """Drop `rid`, moving the last row into its place."""
        i = self.row.pop(rid)
        last = self.n - 1
        if i != last:
            moved = self.ids[last]
            self.ids[i] = moved
            self.row[moved] = i
            for col in self._all:
                col[i] = col[last]
        self.ids.pop()
        self.n = last

    def generated_at(self, now: float, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Estimated generated tokens of running rows at `now`: l_obs + v·(now − t_obs)."""
        sel = slice(0, self.n) if rows is None else rows
        est = self.l_obs[sel] + self.v[sel] * np.maximum(now - self.t_obs[sel], 0.0)
        out: np.ndarray = np.minimum(est, np.maximum(self.max_out[sel] - 1, self.l_obs[sel]))
        return out
