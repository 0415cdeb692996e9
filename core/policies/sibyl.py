"""SIBYL: route to the decode instance with the least *projected* load at the handoff moment τ.

L_j(τ) = Σ_running L_I + Σ_pending,τ_k≤τ L_II + Σ_pending,τ_k>τ L_III  (spec: design/papers/sibyl.md)
  L_I   = (l_in + l(τ)) · Ŝ(l(τ)) / Ŝ(l(now)),  l(τ) = l(now) + v_k·(τ − now)
  L_II  = (l_in + l) · Ŝ(l),                      l = (τ − τ_k)·v̄_sys
  L_III = max(0, l_in − v̄_sys·(τ_k − τ))           (eq. 8; Algorithm 1's line 17 has the sign wrong)
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from core.policies.base import PolicyParams, RoutingPolicyBase
from core.policies.choice import (
    RotatingArgmin,
    decode_candidates,
    least_queued_prefill,
    projected_handoff,
)
from core.policies.registry import register
from core.request_table import RUNNING
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView

_EPS = 1e-9


class SibylParams(PolicyParams):
    prob_at_1: bool = Field(False, description="ablation PROB@1: survival probability fixed at 1")
    no_type1: bool = Field(False, description="ablation: ignore running requests (Type 1)")
    no_type2: bool = Field(
        False, description="ablation: ignore pending requests that start before τ"
    )
    no_type3: bool = Field(
        False, description="ablation: ignore pending requests that start after τ"
    )
    unit: Literal["tokens", "requests"] = Field(
        "tokens",
        description=(
            "tokens: physical pressure (prompt + generated KV tokens) as in the paper; "
            "requests: expected number of requests alive at τ (Type 3 adds its decayed share)"
        ),
    )


@register(
    PolicyKind.ROUTING,
    "sibyl",
    SibylParams,
    "least projected load at the handoff moment (residual survival + shadow load)",
)
class Sibyl(RoutingPolicyBase):
    params: SibylParams
    needs_progress = True

    def __init__(self, params: SibylParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()

    def projected_load(self, tau: float, view: ClusterView) -> np.ndarray:
        """L_j(τ) for every instance index, over whole table columns (no boolean gathers)."""
        t, prm, now = view.table, self.params, view.now
        n = t.n
        inst, l_in = t.inst[:n], t.l_in[:n]
        run = t.state[:n] == RUNNING
        v_sys = view.decode_rate.value
        v = t.v[:n]
        # Pending rows have l_obs = v = 0, so l(now) is 0 for them without masking.
        l_now = t.l_obs[:n] + v * (now - t.t_obs[:n])
        gap = tau - t.tau[:n]
        # Running rows: l(τ) = l(now) + v·(τ − now). Pending rows (Type 2): l = (τ − τ_k)·v̄_sys.
        l_eval = np.where(run, l_now + v * (tau - now), np.maximum(gap, 0.0) * v_sys)
        if prm.prob_at_1:
            weights = l_in + l_eval if prm.unit == "tokens" else np.ones(n)
        else:
            survival = view.survival
            # Ŝ(0) = 1, so pending rows divide by one.
            prob = survival(l_eval) / np.maximum(survival(l_now), _EPS)
            weights = (l_in + l_eval) * prob if prm.unit == "tokens" else prob
        after = ~run & (gap < 0)
        decayed = np.maximum(0.0, l_in + v_sys * gap)  # l_in − v̄·(τ_k − τ), eq. 8
        if prm.unit == "requests":
            decayed = decayed / np.maximum(l_in, 1.0)
        weights = np.where(after, decayed, weights)
        if prm.no_type1:
            weights = np.where(run, 0.0, weights)
        if prm.no_type2:
            weights = np.where(~run & ~after, 0.0, weights)
        if prm.no_type3:
            weights = np.where(after, 0.0, weights)
        bound = inst >= 0
        return np.bincount(
            np.where(bound, inst, 0),
            weights=np.where(bound, weights, 0.0),
            minlength=view.n_instances,
        )

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        tau = projected_handoff(request, prefill_end, view)
        d = self._argmin(self.projected_load(tau, view), decode_candidates(view))
        return Assignment(view.instance_ids[p], view.instance_ids[d], tau)
