"""BF-IO's lookahead (H > 0): the projected loads of a DP group over the next H steps and the IO
increment of placing a new request on a rank (shared/design/papers/bf-io.md §3.5); bf_io.py's
`BfIo` places, pools and refines with it."""

from __future__ import annotations

import numpy as np

from core.policies.rank.state import TOL, DPState, Pairs, horizon_weights, project_loads

# --- H > 0 ------------------------------------------------------------------------------------


class Lookahead:
    """Projected loads L̂ (G, H+1), envelope E_h = max_g L̂_g(h) and the IO increment of a placement.

    A new request of size s adds s + h at horizon step h. With D_g,h = E_h − L̂_g,h − h its cost
    on rank g is over_g(s) = Σ_h d_h max(0, s − D_g,h) envelope-tokens, zero when s ≤ min_h D_g,h
    (the rank's safe margin); the tie-break is the weighted projected load P_g = Σ_h d_h L̂_g,h.
    """

    def __init__(self, state: DPState, horizon: int, decay: float) -> None:
        self.g = state.ranks
        self.lhat = project_loads(state, horizon)
        self.h = np.arange(horizon + 1, dtype=np.float64)
        self.w = horizon_weights(horizon, decay)
        self.w_sum = float(self.w.sum())
        self.wh_sum = float(self.w @ self.h)
        self.free = state.free.copy()
        self.load = self.lhat @ self.w
        self._envelope()

    def _envelope(self) -> None:
        self.env = self.lhat.max(axis=0)
        self.room = self.env[None, :] - self.lhat - self.h[None, :]
        self.margin = self.room.min(axis=1)

    def _place(self, g: int, s: float) -> None:
        add = s + self.h
        self.lhat[g] += add
        self.load[g] += s * self.w_sum + self.wh_sum
        self.free[g] -= 1
        if np.any(self.lhat[g] > self.env):
            self._envelope()
        else:
            self.room[g] -= add
            self.margin[g] = self.room[g].min()

    def _best_rank(self, s: float) -> int:
        open_ = self.free > 0
        safe = open_ & (self.margin >= s)
        if safe.any():
            return int(np.argmin(np.where(safe, self.load, np.inf)))
        over = np.maximum(s - self.room, 0.0) @ self.w
        over = np.where(open_, over, np.inf)
        best = over.min()
        ties = over <= best + TOL * max(1.0, best)
        return int(np.argmin(np.where(ties, self.load, np.inf)))

    def place_in_order(self, sizes: np.ndarray, admitted: list[int]) -> Pairs:
        """Place the given requests, largest first, each where it raises the envelope least."""
        out: Pairs = []
        for i in sorted(admitted, key=lambda i: -int(sizes[i])):
            g = self._best_rank(float(sizes[i]))
            self._place(g, float(sizes[i]))
            out.append((i, g))
        return out

    def _over_matrix(self, s: np.ndarray) -> np.ndarray:
        """over[i, g] = Σ_h d_h max(0, s_i − D_g,h) for every candidate and rank (sorted breakpoints)."""
        hn = self.room.shape[1]
        order = np.argsort(self.room, axis=1)
        room = np.take_along_axis(self.room, order, axis=1)
        w = self.w[order]
        cw = np.concatenate([np.zeros((self.g, 1)), np.cumsum(w, axis=1)], axis=1)
        cwd = np.concatenate([np.zeros((self.g, 1)), np.cumsum(w * room, axis=1)], axis=1)
        span = float(max(room.max(), s.max()) - min(room.min(), 0.0)) + 1.0
        offset = np.arange(self.g, dtype=np.float64) * 2.0 * span
        flat = (room + offset[:, None]).ravel()
        pos = np.searchsorted(flat, s[:, None] + offset[None, :], side="left")
        k = pos - np.arange(self.g)[None, :] * hn
        rows = np.arange(self.g)[None, :]
        over: np.ndarray = s[:, None] * cw[rows, k] - cwd[rows, k]
        return over

    def place_from_pool(self, sizes: np.ndarray, pool: list[int], n: int) -> Pairs:
        """Choose n requests from the pool and their ranks, each step the least IO increment
        G·over_g(s_i) − Σ_h d_h (s_i + h) (tie: least projected load, then the oldest request).

        A request that fits under some open rank's safe margin costs −Σ_h d_h (s_i + h), so the
        largest such one beats every smaller request; only larger ones need the exact costs, and
        they must beat it strictly (ties keep the placement that leaves the envelope alone).
        """
        cand = np.asarray(pool, dtype=np.int64)
        s = sizes[cand].astype(np.float64)
        out: Pairs = []
        for _ in range(min(n, len(cand))):
            open_ = self.free > 0
            reach = float(self.margin[open_].max())
            fits = np.flatnonzero(s <= reach)
            i, g, best = -1, -1, np.inf
            if len(fits):
                top = s[fits].max()
                i = int(fits[s[fits] == top][0])  # the oldest of the largest that fit
                ok = open_ & (self.margin >= top)
                g = int(np.argmin(np.where(ok, self.load, np.inf)))
                best = -(top * self.w_sum + self.wh_sum)
            big = np.flatnonzero(s > reach)
            if len(big):
                gain = s[big] * self.w_sum + self.wh_sum
                cost = self.g * self._over_matrix(s[big]) - gain[:, None]
                cost[:, ~open_] = np.inf
                low = cost.min()
                if low < best - TOL * max(1.0, abs(low)):
                    ties = cost <= low + TOL * max(1.0, abs(low))
                    k = int(np.argmin(np.where(ties, self.load[None, :], np.inf)))
                    row, g = divmod(k, self.g)
                    i = int(big[row])
            self._place(g, float(s[i]))
            out.append((int(cand[i]), g))
            cand, s = np.delete(cand, i), np.delete(s, i)
        return out

    def _top3(self) -> tuple[np.ndarray, np.ndarray]:
        """Per horizon step, the three most loaded ranks and their loads (padded with -inf)."""
        lhat = self.lhat
        if self.g < 3:
            lhat = np.vstack([lhat, np.full((3 - self.g, lhat.shape[1]), -np.inf)])
        top = np.argsort(-lhat, axis=0, kind="stable")[:3]
        return top, np.take_along_axis(lhat, top, axis=0)

    @staticmethod
    def _env_without(top: np.ndarray, val: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """(C, H+1) envelope over the ranks other than p[c] and q[c] (q may repeat p)."""
        p, q = p[:, None], q[:, None]
        hit1 = (top[0][None, :] == p) | (top[0][None, :] == q)
        hit2 = (top[1][None, :] == p) | (top[1][None, :] == q)
        out: np.ndarray = np.where(~hit1, val[0], np.where(~hit2, val[1], val[2]))
        return out

    def refine(self, pairs: Pairs, sizes: np.ndarray, left: list[int], locked: set[int]) -> Pairs:
        """Local search on the horizon cost: (a) exchange an admitted request for a waiting one
        (pool mode), (b) swap a new request on the straggler (the rank at the envelope for the
        most weight) with one elsewhere, (c) move it to a rank with a free slot; apply the best
        strictly improving move until none is left."""
        if not pairs:
            return pairs
        g_count, w, h = self.g, self.w, self.h
        idx = np.array([i for i, _ in pairs], dtype=np.int64)
        rank = np.array([g for _, g in pairs], dtype=np.int64)
        size = sizes[idx].astype(np.float64)
        swappable = np.array([i not in locked for i in idx.tolist()])
        wait_idx = np.asarray(left, dtype=np.int64)
        wait_size = sizes[wait_idx].astype(np.float64)
        for _ in range(4 * (len(pairs) + g_count)):
            env = self.lhat.max(axis=0)
            scale = TOL * max(1.0, float(w @ env))
            top, val = self._top3()
            at_env = self.lhat >= env[None, :] - 1e-9
            strag = int(np.argmax(at_env.astype(np.float64) @ w))  # the main straggler
            on_s = np.flatnonzero(rank == strag)
            best, move = -scale, None
            if len(on_s) and len(pairs) > 1:  # (b) swaps: rows p −= d, q += d (d = s_a − s_b)
                a = np.repeat(on_s, len(pairs))
                b = np.tile(np.arange(len(pairs)), len(on_s))
                keep = rank[a] != rank[b]
                a, b = a[keep], b[keep]
                d = (size[a] - size[b])[:, None]
                p, q = rank[a], rank[b]
                new = np.maximum(
                    self._env_without(top, val, p, q),
                    np.maximum(self.lhat[p] - d, self.lhat[q] + d),
                )
                delta = g_count * ((new - env[None, :]) @ w)
                if len(delta) and delta.min() < best:
                    k = int(np.argmin(delta))
                    best, move = float(delta[k]), ("swap", int(a[k]), int(b[k]))
            open_g = np.flatnonzero(self.free > 0)
            if len(on_s) and len(open_g):  # (c) moves: rows p −= s_a + h, q += s_a + h
                a = np.repeat(on_s, len(open_g))
                q = np.tile(open_g, len(on_s))
                keep = rank[a] != q
                a, q = a[keep], q[keep]
                p = rank[a]
                add = size[a][:, None] + h[None, :]
                new = np.maximum(
                    self._env_without(top, val, p, q),
                    np.maximum(self.lhat[p] - add, self.lhat[q] + add),
                )
                delta = g_count * ((new - env[None, :]) @ w)
                if len(delta) and delta.min() < best:
                    k = int(np.argmin(delta))
                    best, move = float(delta[k]), ("move", int(a[k]), int(q[k]))
            if len(wait_idx) and swappable.any():  # (a) exchanges: row p += s_c − s_a, Σ too
                a = np.repeat(np.flatnonzero(swappable), len(wait_idx))
                c = np.tile(np.arange(len(wait_idx)), int(swappable.sum()))
                d = (wait_size[c] - size[a])[:, None]
                p = rank[a]
                new = np.maximum(self._env_without(top, val, p, p), self.lhat[p] + d)
                delta = (g_count * (new - env[None, :]) - d) @ w
                if delta.min() < best:
                    k = int(np.argmin(delta))
                    best, move = float(delta[k]), ("exchange", int(a[k]), int(c[k]))
            if move is None:
                break
            kind, x, y = move
            if kind == "swap":
                shift = size[x] - size[y]
                self.lhat[rank[x]] -= shift
                self.lhat[rank[y]] += shift
                rank[x], rank[y] = rank[y], rank[x]
            elif kind == "move":
                self.lhat[rank[x]] -= size[x] + h
                self.lhat[y] += size[x] + h
                self.free[rank[x]] += 1
                self.free[y] -= 1
                rank[x] = y
            else:
                self.lhat[rank[x]] += wait_size[y] - size[x]
                idx[x], wait_idx[y] = wait_idx[y], idx[x]
                size[x], wait_size[y] = wait_size[y], size[x]
        return list(zip(idx.tolist(), rank.tolist(), strict=True))
