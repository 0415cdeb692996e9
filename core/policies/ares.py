"""ARES decode rescheduling (design/papers/ares.md): periodic decode-to-decode migrations.

Load is the KV tokens of the running requests on each decode instance (prompt + generated,
the paper's single load unit). Every `period_s` (the paper: 1 s) a round

1. predicts each running request's remaining output length N̂(r) and from it a token
   trajectory over H horizon steps of Δ decode iterations: point — n_r(t) = N(r) + tΔ while
   tΔ < N̂(r), then 0 (its KV is freed); expected — (N(r) + tΔ)·P(L > a + tΔ | L > a) from the
   survival function (spec §8, the better fit for the survival predictor);
2. sums them into per-instance loads N̂_i(t), t = 0..H, and weighs the future with
   β_t = γ^t / Σ_u γ^u: w_i = Σ_{t≥1} β_t·N̂_i(t);
3. overloaded O = {w_i > (1+θ)·w̄}; underloaded U = {N_i(0) < (1+θ)·w̄} (the paper's literal
   rule; `underload=strict`: {i ∉ O : w_i < (1−θ)·w̄});
4. candidates (r, s, t), s ∈ O, t ∈ U, s ≠ t: worth the move (N̂(r) > C_mig(r)/T_exec(s), the
   decode steps the transfer costs) and no OOM on the target over the horizon
   (max_τ N̂_t(τ) + n_r(τ) ≤ (1−m)·C_mem; `oom_check=literal`: N_t(0) + N̂(r) ≤ C_mem);
5. takes the move with the largest drop of σ̂² = Var_i N_i(0) + Σ_t β_t·Var_i N̂_i(t), if the
   drop is positive. Moving n_r(·) from s to t changes only two rows, so the drop is exact and
   vectorised: (2/|I|)·Σ_τ W_τ·n_r(τ)·(N̂_s(τ) − N̂_t(τ) − n_r(τ)) with W = (1, β_1..β_H);
6. `max_moves` > 1 (for large clusters) repeats 4-5 on the updated loads, each instance in at
   most one move per round. A moved request rests `cooldown_s` before it may move again.

`current_load` is the paper's "+rescheduling" baseline: the same round with H = 0 (w_i = N_i(0),
σ̂² = σ0²), no prediction, no worth filter, and the OOM check on the request's current tokens.

What a policy reads (live or simulated): `view.table` rows in state RUNNING (`inst`, `l_in`,
`l_obs`/`t_obs`/`v` for the generated tokens, `ids`), `view.survival` (survival predictor),
`view.profile` (kv_capacity_tokens, step_time, kv_transfer_time) and `view.decode_mask()`.
`ares_oracle` also reads `max_out` as the true output length, so it runs only in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from core.errors import PolicyError
from core.policies.ares_params import AresOracleParams, AresParams, CurrentLoadParams, RoundParams
from core.policies.base import ReschedulePolicyBase
from core.policies.registry import register
from core.predict.survival import SurvivalPredictor
from core.request_table import RUNNING
from core.types import Migration, PolicyKind
from core.view import ClusterView

_BLOCK = 256
"""Candidate moves checked for OOM at once, best first."""


@dataclass
class RoundReport:
    """What the last round saw and decided (for tests, dashboards and reasons)."""

    time: float
    instance_ids: list[str]
    """Decode instances of the round, in the order of the arrays below."""
    load_now: np.ndarray
    """N_i(0): KV tokens of the running requests per instance."""
    weighted: np.ndarray
    """w_i (= N_i(0) without a horizon)."""
    overloaded: list[str]
    underloaded: list[str]
    candidates: int
    """Requests on overloaded instances that passed the cool-down and worth filters."""
    sigma_before: float
    sigma_after: float
    rejected_oom: list[tuple[str, str, float]] = field(default_factory=list)
    """(request, target, gain) of better moves the OOM filter rejected, in the order tried."""
    moves: list[Migration] = field(default_factory=list)


class _Rebalancer(ReschedulePolicyBase):
    """The round of Algorithm 1; subclasses supply remaining lengths and the horizon."""

    needs_progress: ClassVar[bool] = True
    """Reads every running request's generated tokens (the simulator syncs them before a round)."""
    needs_true_lengths: ClassVar[bool] = False
    params: RoundParams

    def __init__(self, params: RoundParams) -> None:
        super().__init__(params)
        self._selection = str(getattr(params, "selection", "gain"))
        self._moved_at: dict[Any, float] = {}
        self.last: RoundReport | None = None

    # --- hooks ---------------------------------------------------------------------------------
    def horizon(self) -> tuple[int, int, np.ndarray]:
        """(H, Δ, β_1..β_H); H = 0 weighs the current load only."""
        return 0, 1, np.zeros(0)

    def remaining(self, view: ClusterView, rows: np.ndarray, gen: np.ndarray) -> np.ndarray | None:
        """Predicted remaining output tokens of the given table rows (None: no prediction)."""
        return None

    def trajectories(
        self,
        view: ClusterView,
        tokens: np.ndarray,
        gen: np.ndarray,
        rem: np.ndarray | None,
    ) -> np.ndarray:
        """(R, H+1) KV tokens each request holds at horizon steps 0..H."""
        h, delta, _ = self.horizon()
        steps = np.arange(h + 1, dtype=float) * delta
        grown = tokens[:, None] + steps[None, :]
        if rem is None:
            out: np.ndarray = grown
            return out
        alive = steps[None, :] < rem[:, None]
        out = np.where(alive, grown, 0.0)
        return out

    def worth(self, view: ClusterView, tokens: np.ndarray, rem: np.ndarray | None, step_s: np.ndarray) -> np.ndarray:
        """Filter 1: the request outlives its transfer (N̂ > C_mig / T_exec)."""
        return np.ones(len(tokens), dtype=bool)

    def fits(
        self,
        target_loads: np.ndarray,
        traj: np.ndarray,
        rem: np.ndarray | None,
        capacity: float,
    ) -> np.ndarray:
        """Filter 2 for a block of (target load row, request trajectory) pairs: no OOM."""
        limit = (1.0 - self.params.kv_margin) * capacity
        out: np.ndarray = np.max(target_loads + traj, axis=1) <= limit
        return out

    def order_key(self, tokens: np.ndarray, rem: np.ndarray | None) -> np.ndarray | None:
        """Primary sort key of a candidate request (None: by gain only)."""
        sel = self._selection
        if sel == "fewest_tokens":
            return tokens
        if sel == "most_tokens":
            return -tokens
        if rem is not None and sel == "shortest_remaining":
            return rem
        if rem is not None and sel == "longest_remaining":
            return -rem
        return None

    # --- the round -------------------------------------------------------------------------------
    def propose(self, view: ClusterView, now: float) -> list[Migration]:
        prm = self.params
        self.last = None
        dec = np.flatnonzero(view.decode_mask())
        n_inst = len(dec)
        if n_inst < 2:
            return []
        pos_of = np.full(view.n_instances, -1, dtype=np.int64)
        pos_of[dec] = np.arange(n_inst)
        t = view.table
        n = t.n
        inst = t.inst[:n]
        rows = np.flatnonzero((t.state[:n] == RUNNING) & (inst >= 0))
        pos = pos_of[inst[rows]]
        keep = pos >= 0
        rows, pos = rows[keep], pos[keep]
        gen = np.floor(t.generated_at(now, rows))
        tokens = t.l_in[rows] + gen
        rem = self.remaining(view, rows, gen) if len(rows) else None
        traj = self.trajectories(view, tokens, gen, rem)
        h, _, beta = self.horizon()
        weights = np.concatenate([[1.0], beta])
        loads = np.zeros((n_inst, h + 1))
        np.add.at(loads, pos, traj)
        w = loads[:, 1:] @ beta if h else loads[:, 0].copy()
        w_mean = float(w.mean())
        over = w > (1.0 + prm.theta) * w_mean
        if prm.underload == "literal":
            under = loads[:, 0] < (1.0 + prm.theta) * w_mean
        else:
            under = ~over & (w < (1.0 - prm.theta) * w_mean)
        ids = [view.instance_ids[int(x)] for x in dec]
        sigma = float(loads.var(axis=0) @ weights)
        report = RoundReport(
            time=now,
            instance_ids=ids,
            load_now=loads[:, 0].copy(),
            weighted=w,
            overloaded=[ids[i] for i in np.flatnonzero(over)],
            underloaded=[ids[i] for i in np.flatnonzero(under)],
            candidates=0,
            sigma_before=sigma,
            sigma_after=sigma,
        )
        self.last = report
        if not over.any() or not under.any():
            return []
        # Candidates: requests on overloaded instances, rested, worth their transfer.
        self._moved_at = {k: at for k, at in self._moved_at.items() if now - at < prm.cooldown_s}
        cand = np.flatnonzero(over[pos])
        if self._moved_at:
            cand = np.array(
                [c for c in cand.tolist() if t.ids[int(rows[c])] not in self._moved_at],
                dtype=np.int64,
            )
        if len(cand):
            batch = np.bincount(pos, minlength=n_inst)
            step_s = np.array(
                [float(view.profile.step_time(int(batch[p]), float(loads[p, 0]))) for p in pos[cand].tolist()]
            )
            crem = None if rem is None else rem[cand]
            cand = cand[self.worth(view, tokens[cand], crem, step_s)]
        report.candidates = len(cand)
        capacity = float(view.profile.kv_capacity_tokens)
        used = np.zeros(n_inst, dtype=bool)
        moves: list[Migration] = []
        for _ in range(prm.max_moves):
            c_ok = cand[~used[pos[cand]]] if len(cand) else cand
            u_ok = np.flatnonzero(under & ~used)
            if not len(c_ok) or not len(u_ok):
                break
            best = self._pick(view, loads, weights, traj, tokens, rem, pos, rows, c_ok, u_ok, capacity, sigma, report)
            if best is None:
                break
            c, u, gain = best
            s = int(pos[c])
            loads[s] -= traj[c]
            loads[u] += traj[c]
            used[s] = used[u] = True
            cand = cand[cand != c]
            rid = t.ids[int(rows[c])]
            self._moved_at[rid] = now
            sigma = float(loads.var(axis=0) @ weights)
            pred = "" if rem is None else f", N̂={rem[c]:.0f}"
            moves.append(
                Migration(
                    request_id=rid,  # type: ignore[arg-type]
                    source=ids[s],
                    target=ids[u],
                    reason=(
                        f"{self.name}: {ids[s]} w={w[s]:.0f} > (1+θ)·w̄={(1 + prm.theta) * w_mean:.0f}"
                        f" → {ids[u]} N(0)={report.load_now[u]:.0f}; request N={tokens[c]:.0f}"
                        f"{pred}; σ̂² −{gain:.4g}"
                    ),
                )
            )
        report.moves = moves
        report.sigma_after = sigma
        return moves

    def _pick(
        self,
        view: ClusterView,
        loads: np.ndarray,
        weights: np.ndarray,
        traj: np.ndarray,
        tokens: np.ndarray,
        rem: np.ndarray | None,
        pos: np.ndarray,
        rows: np.ndarray,
        c_ok: np.ndarray,
        u_ok: np.ndarray,
        capacity: float,
        sigma: float,
        report: RoundReport,
    ) -> tuple[int, int, float] | None:
        """The best (candidate index, target position, gain) that passes the OOM filter."""
        n_inst = loads.shape[0]
        a = traj[c_ok] * weights  # (C, H+1)
        own = np.einsum("ch,ch->c", a, loads[pos[c_ok]] - traj[c_ok])
        gain = (2.0 / n_inst) * (own[:, None] - a @ loads[u_ok].T)  # (C, U)
        gain[pos[c_ok][:, None] == u_ok[None, :]] = -np.inf
        ci, ui = np.nonzero(gain > 1e-9 * max(sigma, 1.0))
        if not len(ci):
            return None
        g = gain[ci, ui]
        key = self.order_key(tokens[c_ok], None if rem is None else rem[c_ok])
        order = np.argsort(-g, kind="stable") if key is None else np.lexsort((-g, key[ci]))
        crem = None if rem is None else rem
        for start in range(0, len(order), _BLOCK):
            blk = order[start : start + _BLOCK]
            cs, us = c_ok[ci[blk]], u_ok[ui[blk]]
            ok = self.fits(loads[us], traj[cs], None if crem is None else crem[cs], capacity)
            hit = np.flatnonzero(ok)
            stop = int(hit[0]) if len(hit) else len(blk)
            for k in range(stop):
                report.rejected_oom.append(
                    (str(view.table.ids[int(rows[cs[k]])]), report.instance_ids[int(us[k])], float(g[blk[k]]))
                )
            if len(hit):
                k = int(hit[0])
                return int(cs[k]), int(us[k]), float(g[blk[k]])
        return None


@register(
    PolicyKind.RESCHEDULE,
    "current_load",
    CurrentLoadParams,
    "rebalance current KV-token loads: move the request that most reduces their variance "
    "from an overloaded to an underloaded decode instance (ARES's '+rescheduling' baseline)",
)
class CurrentLoad(_Rebalancer):
    """Algorithm 1 with H = 0: no prediction, OOM check on the request's current tokens."""

    params: CurrentLoadParams


class _HorizonRebalancer(_Rebalancer):
    params: AresOracleParams

    def __init__(self, params: AresOracleParams) -> None:
        super().__init__(params)
        h = params.horizon_steps
        g = params.gamma ** np.arange(1, h + 1, dtype=float)
        self._beta = g / g.sum()

    def horizon(self) -> tuple[int, int, np.ndarray]:
        return self.params.horizon_steps, self.params.step_tokens, self._beta

    def worth(self, view: ClusterView, tokens: np.ndarray, rem: np.ndarray | None, step_s: np.ndarray) -> np.ndarray:
        if rem is None or not self.params.worth_filter:
            return np.ones(len(tokens), dtype=bool)
        prof = view.profile
        c_mig = prof.kv_transfer_base_s + prof.kv_transfer_per_token_s * tokens
        out: np.ndarray = rem > c_mig / np.maximum(step_s, 1e-9)
        return out

    def fits(
        self,
        target_loads: np.ndarray,
        traj: np.ndarray,
        rem: np.ndarray | None,
        capacity: float,
    ) -> np.ndarray:
        if self.params.oom_check == "literal" and rem is not None:
            out: np.ndarray = target_loads[:, 0] + rem <= capacity
            return out
        return super().fits(target_loads, traj, rem, capacity)


@register(
    PolicyKind.RESCHEDULE,
    "ares_oracle",
    AresOracleParams,
    "ARES with the true remaining output lengths (simulator only; the paper's ARES-Oracle)",
)
class AresOracle(_HorizonRebalancer):
    """N̂(r) = the true remaining length (`max_out` is the true output length in the simulator)."""

    needs_true_lengths: ClassVar[bool] = True
    params: AresOracleParams

    def remaining(self, view: ClusterView, rows: np.ndarray, gen: np.ndarray) -> np.ndarray | None:
        out: np.ndarray = np.maximum(view.table.max_out[rows] - gen, 1.0)
        return out


@register(
    PolicyKind.RESCHEDULE,
    "ares",
    AresParams,
    "ARES: migrate the running request whose move most reduces the time-weighted variance of "
    "current and predicted KV-token loads (survival or learned remaining-length predictor)",
)
class Ares(_HorizonRebalancer):
    """ARES with a survival-based or learned remaining-length predictor."""

    params: AresParams

    def __init__(self, params: AresParams) -> None:
        super().__init__(params)
        self._model: Any = None
        if params.predictor == "learned":
            from core.predict.learned import load

            try:
                self._model = load(str(params.model_path))
            except (OSError, ValueError, ImportError) as exc:
                raise PolicyError(f"ares: cannot load model_path {params.model_path!r}: {exc}") from exc

    def _expected(self) -> bool:
        traj = self.params.trajectory
        return traj == "expected" or (traj == "auto" and self.params.predictor == "survival")

    def _survival(self, view: ClusterView) -> SurvivalPredictor:
        return SurvivalPredictor(
            view.survival,
            max_len=view.profile.max_model_len,
            statistic=self.params.survival_statistic,
        )

    def remaining(self, view: ClusterView, rows: np.ndarray, gen: np.ndarray) -> np.ndarray | None:
        if self._model is not None:
            out: np.ndarray = self._model.predict(view.table.l_in[rows], gen)
            return out
        return self._survival(view).remaining(gen)

    def trajectories(
        self,
        view: ClusterView,
        tokens: np.ndarray,
        gen: np.ndarray,
        rem: np.ndarray | None,
    ) -> np.ndarray:
        if not self._expected():
            return super().trajectories(view, tokens, gen, rem)
        h, delta, _ = self.horizon()
        steps = np.arange(h + 1, dtype=float) * delta
        p = self._survival(view).conditional(gen[:, None], steps[None, :])
        p[:, 0] = 1.0
        out: np.ndarray = (tokens[:, None] + steps[None, :]) * p
        return out
