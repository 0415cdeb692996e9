"""SIBYL: route to the decode instance with the least *projected* load at the handoff moment τ.

L_j(τ) = Σ_running L_I + Σ_pending,τ_k≤τ L_II + Σ_pending,τ_k>τ L_III  (spec: design/papers/sibyl.md)
  L_I   = (l_in + l(τ)) · Ŝ(l(τ)) / Ŝ(l(now)),  l(τ) = l(now) + v_k·(τ − now)
  L_II  = (l_in + l) · Ŝ(l),                      l = (τ − τ_k)·v̄_sys
  L_III = max(0, l_in − v̄_sys·(τ_k − τ))           (eq. 8; Algorithm 1's line 17 has the sign wrong)

`horizon="lifetime"` (ours, not the paper's) replaces the snapshot at τ by the average load over
the new request's expected decode lifetime W = [τ, τ + T], T = E[L]/v̄_sys with E[L] = ∫Ŝ: a
request's TPOT depends on how many requests share its instance (processor sharing) or on the
step time (iteration mode) over its whole decode, not at its first token. With the prefix
integrals I(x) = ∫₀ˣŜ and J(x) = ∫₀ˣ u·Ŝ(u) du every row costs O(1):
  running k (age l_k(now), rate v_k):  P̄_k = [I(l_k(τ+T)) − I(l_k(τ))] / (v_k·T·Ŝ(l_k(now)))
  pending k (decode from τ_k):         P̄_k = [I(x₁) − I(x₀)] / (v̄·T),  x = max(0, (t − τ_k)·v̄)
and the KV tokens it holds on average over W likewise with l_in·ΔI + ΔJ. A pending request that
starts after τ is simply alive for part of W (no separate Type 3 rule).
`lifetime_weighting="tpot"` weighs the moment when the newcomer is u tokens old by its share of
the newcomer's expected TPOT, w(u) = E[1{L > u}/L] (from Ŝ), on a 7-cell quadrature.

Measured (benchmarks/README.md, "Routing sweep"): the τ projection in request units reaches the
clairvoyant reference wherever there is headroom; the lifetime horizon dilutes the near-term
count because the router re-balances within seconds, so it is an option, not the default.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.policies.base import PolicyParams, RoutingPolicyBase
from core.policies.choice import (
    RotatingArgmin,
    decode_candidates,
    least_queued_prefill,
    projected_handoff,
    sole_candidate,
)
from core.policies.registry import register
from core.request_table import RUNNING
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView

_EPS = 1e-9


class SibylParams(PolicyParams):
    prob_at_1: bool = Field(False, description="ablation PROB@1: survival probability fixed at 1")
    no_type1: bool = Field(False, description="ablation: ignore running requests (Type 1)")
    no_type2: bool = Field(False, description="ablation: ignore pending requests that start before τ")
    no_type3: bool = Field(False, description="ablation: ignore pending requests that start after τ")
    unit: Literal["auto", "tokens", "requests", "step_time"] = Field(
        "requests",
        description=(
            "requests (default, the best in benchmarks/README.md's routing sweep); "
            "tokens: physical pressure (prompt + generated KV tokens) as in the paper; "
            "requests: expected number of requests alive (Type 3 adds its decayed share at τ); "
            "step_time: the decode step time they add, per_seq·requests + per_kv_token·tokens "
            "from the profile; auto: tokens with horizon=tau (the paper), and with "
            "horizon=lifetime requests when the profile's decode speed depends on the request "
            "count only (a TPS(N) curve or no per-KV-token step cost), else step_time"
        ),
    )
    horizon: Literal["tau", "lifetime"] = Field(
        "tau",
        description=(
            "tau: the paper's projection to the handoff moment τ; lifetime: the survival-weighted "
            "load averaged over the new request's expected decode lifetime [τ, τ + E[L]/v̄_sys]"
        ),
    )
    lifetime_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "horizon=lifetime, lifetime_weighting=uniform: window length in output tokens (default E[L] from Ŝ)"
        ),
    )
    lifetime_weighting: Literal["uniform", "tpot"] = Field(
        "uniform",
        description=(
            "horizon=lifetime: uniform — every moment of [τ, τ + E[L]/v̄] counts the same; "
            "tpot — moment τ + s counts by its share of the new request's expected TPOT, "
            "E[1{L > v̄·s}/L] (a short request's TPOT depends only on its first seconds)"
        ),
    )


def _sum_per_instance(inst: np.ndarray, weights: np.ndarray, n_instances: int) -> np.ndarray:
    """Row weights summed per decode instance index; rows not yet bound to one (index −1) count nowhere."""
    try:  # the common case: every tracked request is bound (bincount refuses negative indices)
        return np.bincount(inst, weights=weights, minlength=n_instances)
    except ValueError:
        bound = inst >= 0
        return np.bincount(np.where(bound, inst, 0), weights=np.where(bound, weights, 0.0), minlength=n_instances)


@register(
    PolicyKind.ROUTING,
    "sibyl",
    SibylParams,
    "least projected load at the handoff moment (residual survival + shadow load); "
    "horizon=lifetime averages it over the new request's expected decode lifetime",
)
class Sibyl(RoutingPolicyBase):
    params: SibylParams
    needs_progress = True

    def __init__(self, params: SibylParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()
        self._nodes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._floored: tuple[np.ndarray, np.ndarray] | None = None

    def unit(self, view: ClusterView) -> str:
        """The load unit actually used (resolves unit=auto against the horizon and profile)."""
        u = self.params.unit
        if u != "auto":
            return u
        if self.params.horizon == "tau":
            return "tokens"
        prof = view.profile
        if prof.tps_curve is not None or prof.decode_step_per_kv_token_s == 0:
            return "requests"
        return "step_time"

    def projected_load(self, tau: float, view: ClusterView) -> np.ndarray:
        """The load of every instance index as this policy's horizon and unit define it."""
        if self.params.horizon == "lifetime":
            return self.lifetime_load(tau, view)
        return self.tau_load(tau, view)

    def display_load(self, view: ClusterView) -> np.ndarray:
        """The projected load at view.now, for dashboards."""
        return self.projected_load(view.now, view)

    _EDGES = np.array([0.0, 8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0, 32768.0])
    """Token ages of the new request bounding the quadrature cells of lifetime_weighting=tpot."""

    def _tpot_nodes(self, view: ClusterView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ages in tokens, their TPOT weights, Ŝ table with a leading 0 for ages < 0)."""
        sv = view.survival
        dense = sv._tables()  # folds buffered completions first
        cached = self._nodes
        if cached is not None and cached[0] is dense:
            return cached[1], cached[2], cached[3]
        top = float(len(dense) - 1)
        edges = np.unique(np.append(np.minimum(self._EDGES, top), top))
        weights = np.diff(sv.tpot_weight_cdf(edges))
        mids = np.where(edges[:-1] > 0, np.sqrt(edges[:-1] * edges[1:]), 0.5 * edges[1:])
        keep = weights > 1e-9
        ages, weights = mids[keep], weights[keep] / max(weights[keep].sum(), _EPS)
        ext = np.concatenate([[0.0], np.ones_like(dense) if self.params.prob_at_1 else dense])
        self._nodes = (dense, ages, weights, ext)
        return ages, weights, ext

    def _rows(self, view: ClusterView, v_sys: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pending rows' indices, and per row its decode rate (v̄_sys for pending rows and where
        the observed one is ≤ ε) and age l(now) (0 for pending rows): the running rule over whole
        columns, the few pending rows overwritten by index (no full-length np.where)."""
        t, now = view.table, view.now
        n = t.n
        pend = (t.state[:n] != RUNNING).nonzero()[0]
        v_obs = t.v[:n]
        v = np.where(v_obs > _EPS, v_obs, v_sys)
        v[pend] = v_sys
        l_now = now - t.t_obs[:n]
        np.multiply(v_obs, l_now, out=l_now)
        np.add(t.l_obs[:n], l_now, out=l_now)
        l_now[pend] = 0.0
        return pend, v, l_now

    def _tpot_weighted(self, tau: float, view: ClusterView, unit: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Per row: TPOT-weighted expected presence (and KV tokens) over the new request's life."""
        t, now = view.table, view.now
        n = t.n
        v_sys = max(view.decode_rate.value, _EPS)
        ages, cw, ext = self._tpot_nodes(view)
        pend, v, l_now = self._rows(view, v_sys)
        # Age at τ (negative for a pending request that starts after τ), +1 for the padded table.
        a = v * (tau - now)
        np.add(l_now, a, out=a)
        a[pend] = (tau - t.tau[pend]) * v_sys
        a += 1.0
        b = v / v_sys  # tokens this row generates while the new request generates one
        acc = np.zeros(n)
        tok = np.zeros(n) if unit != "requests" else None
        for age, c in zip(ages.tolist(), cw.tolist(), strict=True):
            x = b * age
            x += a
            p = ext.take(x.astype(np.int64), mode="clip")
            p *= c
            acc += p
            if tok is not None:
                x -= 1.0
                np.maximum(x, 0.0, out=x)
                x += t.l_in[:n]
                x *= p
                tok += x
        if self.params.prob_at_1:
            return acc, tok
        norm = self._floored_survival(view)[1].take(l_now.astype(np.int64), mode="clip")  # max(Ŝ(l_now), ε)
        return acc / norm, (None if tok is None else tok / norm)

    def lifetime_load(self, tau: float, view: ClusterView) -> np.ndarray:
        """Average load over [τ, τ + T] per instance index (see the module docstring)."""
        t, prm, now = view.table, self.params, view.now
        if prm.lifetime_weighting == "tpot":
            return self._tpot_load(tau, view)
        n = t.n
        sv = view.survival
        v_sys = max(view.decode_rate.value, _EPS)
        life = float(prm.lifetime_tokens or max(sv.mean_length(), 1.0))
        T = life / v_sys
        # Per-row rate and age at τ, and the stretch of its life [x0, x1] (tokens) inside W:
        # x = max(l(now) + v·(t − start), l(now)) at t = τ and τ + T. Running rows start now;
        # pending rows decode from τ_k at v̄_sys and are 0 tokens old now.
        pend, v, l_now = self._rows(view, v_sys)
        tau_p = t.tau[pend]
        zero = np.zeros(len(pend))
        v_p = v[pend]
        x0 = v * (tau - now)
        np.add(l_now, x0, out=x0)
        np.maximum(x0, l_now, out=x0)
        x0[pend] = np.maximum(zero + v_p * (tau - tau_p), zero)
        x1 = v * (tau + T - now)
        np.add(l_now, x1, out=x1)
        np.maximum(x1, l_now, out=x1)
        x1[pend] = np.maximum(zero + v_p * (tau + T - tau_p), zero)
        norm = v * T
        if not prm.prob_at_1:
            norm *= self._floored_survival(view)[1].take(l_now.astype(np.int64), mode="clip")  # max(Ŝ(l_now), ε)
            d_int = sv.integral_at(x1) - sv.integral_at(x0)
        else:
            d_int = x1 - x0
        unit = self.unit(view)
        if unit == "requests":
            weights = d_int / norm
        else:
            d_mom = (
                sv.integral_at(x1, moment=True) - sv.integral_at(x0, moment=True)
                if not prm.prob_at_1
                else 0.5 * (x1 * x1 - x0 * x0)
            )
            tokens = (t.l_in[:n] * d_int + d_mom) / norm
            if unit == "tokens":
                weights = tokens
            else:
                prof = view.profile
                weights = prof.decode_step_per_seq_s * d_int / norm + prof.decode_step_per_kv_token_s * tokens
        return self._per_instance(weights, tau, view)

    def _per_instance(self, weights: np.ndarray, tau: float, view: ClusterView) -> np.ndarray:
        """Sum row weights per decode instance, after the ablations drop their request types."""
        t, prm = view.table, self.params
        n = t.n
        if prm.no_type1 or prm.no_type2 or prm.no_type3:
            run = t.state[:n] == RUNNING
            if prm.no_type1:
                weights = np.where(run, 0.0, weights)
            if prm.no_type2 or prm.no_type3:
                before = t.tau[:n] <= tau
                if prm.no_type2:
                    weights = np.where(~run & before, 0.0, weights)
                if prm.no_type3:
                    weights = np.where(~run & ~before, 0.0, weights)
        return _sum_per_instance(t.inst[:n], weights, view.n_instances)

    def _tpot_load(self, tau: float, view: ClusterView) -> np.ndarray:
        unit = self.unit(view)
        presence, tokens = self._tpot_weighted(tau, view, unit)
        if unit == "requests":
            weights = presence
        elif unit == "tokens":
            assert tokens is not None
            weights = tokens
        else:
            assert tokens is not None
            prof = view.profile
            weights = prof.decode_step_per_seq_s * presence + prof.decode_step_per_kv_token_s * tokens
        return self._per_instance(weights, tau, view)

    def _floored_survival(self, view: ClusterView) -> tuple[np.ndarray, np.ndarray]:
        """Ŝ's per-token table and max(Ŝ, ε) (the divisor of L_I), the latter kept while Ŝ is unchanged."""
        dense = view.survival._tables()  # folds buffered completions first
        cached = self._floored
        if cached is None or cached[0] is not dense:
            cached = self._floored = (dense, np.maximum(dense, _EPS))
        return cached

    def tau_load(self, tau: float, view: ClusterView) -> np.ndarray:
        """L_j(τ) for every instance index.

        The hot path of every decision and of the simulator (issue 27): each NumPy call costs a
        pass over the table, so whole columns get only the running rule, the two survival lookups
        and the sum per instance; the (few) pending rows are overwritten by index, and Type 3 is
        computed only for those that start after τ. Every row's weight is the same arithmetic in
        the same order as the plain np.where form, so the loads are bit-identical to it
        (tests/core/policies/test_sibyl_projection.py).
        """
        t, prm, now = view.table, self.params, view.now
        n = t.n
        state = t.state[:n]
        pend = (state != RUNNING).nonzero()[0]
        v_sys = view.decode_rate.value
        v = t.v[:n]
        # l(now) = l_obs + v·(now − t_obs); pending rows have l_obs = v = 0, so 0 without masking.
        l_now = now - t.t_obs[:n]
        l_now *= v
        l_now += t.l_obs[:n]
        # Running rows: l(τ) = l(now) + v·(τ − now). Pending rows (Type 2): l = (τ − τ_k)·v̄_sys.
        l_eval = v * (tau - now)
        l_eval += l_now
        gap = tau - t.tau[pend]
        l_pend = np.maximum(gap, 0.0)
        l_pend *= v_sys
        l_eval[pend] = l_pend
        if prm.prob_at_1:
            prob = np.ones(n)
        else:
            # Ŝ(l) from the per-token table (truncate, clip: SurvivalEstimator.__call__); Ŝ(0) = 1,
            # so pending rows divide by one.
            dense, floored = self._floored_survival(view)
            prob = dense.take(l_eval.astype(np.int64), mode="clip")
            prob /= floored.take(l_now.astype(np.int64), mode="clip")
        unit = self.unit(view)
        if unit == "tokens":
            weights = l_eval
            weights += t.l_in[:n]
            weights *= prob
        elif unit == "requests":
            weights = prob
        else:
            prof = view.profile
            a, b = prof.decode_step_per_seq_s, prof.decode_step_per_kv_token_s
            weights = (a + b * (t.l_in[:n] + l_eval)) * prob
        late = gap < 0  # of the pending rows: those starting after τ (Type 3)
        after = pend[late]
        if len(after):
            l_in = t.l_in[after]
            decayed = v_sys * gap[late]
            decayed += l_in
            np.maximum(decayed, 0.0, out=decayed)  # l_in − v̄·(τ_k − τ), eq. 8
            if unit == "requests":
                decayed /= np.maximum(l_in, 1.0)
            elif unit != "tokens":
                decayed = a * decayed / np.maximum(l_in, 1.0) + b * decayed
            weights[after] = decayed
        if prm.no_type1:
            weights[state == RUNNING] = 0.0
        if prm.no_type2:
            weights[pend[~late]] = 0.0
        if prm.no_type3:
            weights[after] = 0.0
        return _sum_per_instance(t.inst[:n], weights, view.n_instances)

    def choose_decode_at(self, request: Request, view: ClusterView, tau: float) -> int:
        candidates = decode_candidates(view)
        only = sole_candidate(view)
        if only is not None:
            note(view, "decode", self.name, "", None, candidates, only, {"tau_in_s": tau - view.now})
            return only
        load = self.projected_load(tau, view)
        d = self._argmin(load, candidates)
        note(view, "decode", self.name, "projected_load_at_tau", load, candidates, d, {"tau_in_s": tau - view.now})
        return d

    def decode_loads(self, request: Request, view: ClusterView, tau: float) -> np.ndarray:
        return self.projected_load(tau, view)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        tau = projected_handoff(request, prefill_end, view)
        d = self.choose_decode_at(request, view, tau)
        return Assignment(view.instance_ids[p], view.instance_ids[d], tau)
