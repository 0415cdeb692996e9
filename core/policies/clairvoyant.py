"""CLAIRVOYANT (simulator only): a reference that knows every request's true output length.

It is not an optimum (it is greedy, it ignores requests that have not arrived yet and it assumes
the decode speed model), but it bounds what a predictor-driven router can hope for in our models:
a perfect output-length predictor plugged into the same greedy choice.

For each decode instance it replays the future of what is already there without new arrivals.
Under processor sharing every running request of an instance advances the same token counter,
and in iteration mode every batched sequence advances one token per step, so in "counter space"
(tokens generated from now on) request k occupies [s_k, e_k): running ones [0, remaining),
pending ones [(τ_k − now)·v̄, … + output) and the new one [a, a + L), a = (τ − now)·v̄. With n(c)
other requests alive at counter c, one token costs every one of them g(n(c) + 1) seconds:
  processor sharing  g(N) = N / TPS(N)  (1 / per-request rate)
  iteration          g(N, K) = step_time(N, K),  K(c) = Σ_alive (l_in + generated) (linear in c)
so the new request's decode time is ∫_a^{a+L} g(n(c) + 1) dc, a sum over the segments between
the breakpoints (one sort per decision over all tracked requests). `objective=sum` adds the TPOT
every other request on the instance loses to the newcomer, ∫ Σ_alive (1/out_k)·(g(n+1) − g(n)) dc,
which makes it the greedy choice for the sum (mean) of TPOTs; `objective=self` is the new
request's own TPOT only. In iteration mode an instance whose projected KV (plus the newcomer's)
overflows its capacity before the newcomer finishes is avoided whenever another is not.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.perf import PerfProfile
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
_OVERFLOW = 1.0
"""Cost added to an instance whose KV would overflow (seconds; far above any TPOT)."""


class ClairvoyantParams(PolicyParams):
    objective: Literal["sum", "self"] = Field(
        "sum",
        description=(
            "sum: new request's TPOT + the TPOT it adds to the requests it shares the instance "
            "with (greedy for mean TPOT); self: the new request's own expected TPOT"
        ),
    )
    model: Literal["auto", "ps", "iteration"] = Field(
        "auto",
        description=(
            "decode speed model: ps (TPS(N)/N per request), iteration (step_time(B, K) per token); "
            "auto: ps when the profile has a TPS(N) curve, else iteration"
        ),
    )


@register(
    PolicyKind.ROUTING,
    "clairvoyant",
    ClairvoyantParams,
    "simulator-only reference: knows true output lengths, picks the instance where the new "
    "request (and its neighbours) decode fastest",
)
class Clairvoyant(RoutingPolicyBase):
    params: ClairvoyantParams
    needs_progress = True
    needs_true_lengths = True
    """Reads `table.max_out` as the true output length: the dispatcher refuses it when live."""

    def __init__(self, params: ClairvoyantParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()
        self._gtab: tuple[int, np.ndarray] | None = None

    def _model(self, prof: PerfProfile) -> str:
        if self.params.model != "auto":
            return self.params.model
        return "ps" if prof.tps_curve is not None else "iteration"

    def _ps_table(self, prof: PerfProfile, size: int) -> np.ndarray:
        """g(N) = N / TPS(N) seconds per token for N = 0 … size − 1 (g(0) = 0)."""
        if self._gtab is None or self._gtab[0] != id(prof) or len(self._gtab[1]) < size:
            n = max(size, 1024)
            g = np.zeros(n)
            g[1:] = [k / prof.total_tps(k) for k in range(1, n)]
            self._gtab = (id(prof), g)
        return self._gtab[1]

    def costs(self, request: Request, tau: float, view: ClusterView) -> np.ndarray:
        """Cost of placing `request` (decoding from τ) on each instance index; inf where not routable."""
        t, now, prof = view.table, view.now, view.profile
        mask = decode_candidates(view)
        cand = np.flatnonzero(mask)
        n = t.n
        v_sys = max(view.decode_rate.value, _EPS)
        inst = t.inst[:n]
        run = t.state[:n] == RUNNING
        out = np.maximum(t.max_out[:n], 1.0)
        gen = np.where(run, np.minimum(t.generated_at(now), out - 1.0), 0.0)
        s = np.where(run, 0.0, np.maximum(t.tau[:n] - now, 0.0) * v_sys)
        e = np.where(run, s + np.maximum(out - gen, 1.0), s + out)
        a = max(tau - now, 0.0) * v_sys
        L = float(max(request.max_tokens, 1))
        b = a + L
        keep = (inst >= 0) & (e > a) & (s < b)
        keep &= mask[np.where(inst >= 0, inst, 0)]
        rows = np.flatnonzero(keep)
        ri = inst[rows]
        rs, re = np.clip(s[rows], a, b), np.clip(e[rows], a, b)
        iw = 1.0 / out[rows]
        # KV a row holds at counter c is off + c (prompt + generated so far).
        off = t.l_in[:n][rows] + gen[rows] - s[rows]
        m, k = len(cand), len(rows)
        span = b + 1.0
        # Points: instance window starts first (stable sort keeps them first on ties), then row
        # starts and ends, then window ends.
        p_inst = np.concatenate([cand, ri, ri, cand])
        p_pos = np.concatenate([np.full(m, a), rs, re, np.full(m, b)])
        order = np.argsort(p_inst * span + p_pos, kind="stable")
        ones = np.ones(k)
        d_n = np.concatenate([np.zeros(m), ones, -ones, np.zeros(m)])[order]
        d_w = np.concatenate([np.zeros(m), iw, -iw, np.zeros(m)])[order]
        si, sp = p_inst[order], p_pos[order]
        cn = np.cumsum(d_n)[:-1]
        cw = np.cumsum(d_w)[:-1]
        seg = np.diff(sp)
        seg = np.where(si[1:] == si[:-1], seg, 0.0)
        seg_inst = si[:-1]
        nn = np.rint(cn).astype(np.int64)
        objective = self.params.objective
        if self._model(prof) == "ps":
            g = self._ps_table(prof, int(nn.max(initial=0)) + 2)
            top = len(g) - 1
            g_with = g[np.minimum(nn + 1, top)]
            own = seg * g_with
            extra = seg * cw * (g_with - g[np.minimum(nn, top)]) if objective == "sum" else None
            overflow = None
        else:
            d_k = np.concatenate([np.zeros(m), off, -off, np.zeros(m)])[order]
            ck = np.cumsum(d_k)[:-1]
            mid = sp[:-1] + 0.5 * seg
            k_new_mid = request.prompt_tokens + (mid - a)
            k_mid = ck + nn * mid + k_new_mid
            per_seq, per_kv = prof.decode_step_per_seq_s, prof.decode_step_per_kv_token_s
            own = seg * (prof.decode_step_base_s + per_seq * (nn + 1) + per_kv * k_mid)
            extra = seg * cw * (per_seq + per_kv * k_new_mid) if objective == "sum" else None
            end = sp[1:]
            k_end = ck + nn * end + request.prompt_tokens + (end - a)
            over = np.where(seg > 0, k_end + nn + 1 - prof.kv_capacity_tokens, 0.0)
            overflow = np.zeros(view.n_instances)
            np.maximum.at(overflow, seg_inst, over)
        size = view.n_instances
        cost = np.bincount(seg_inst, weights=own, minlength=size) / L
        if extra is not None:
            cost += np.bincount(seg_inst, weights=extra, minlength=size)
        if overflow is not None:
            cost += np.where(overflow > 0, _OVERFLOW + overflow / prof.kv_capacity_tokens, 0.0)
        return np.where(mask, cost, np.inf)

    def display_load(self, view: ClusterView) -> np.ndarray:
        """Running + pending requests (the cost needs a request; dashboards get counts)."""
        return np.asarray(view.running_counts() + view.pending_counts(), dtype=float)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        tau = projected_handoff(request, prefill_end, view)
        costs, mask = self.costs(request, tau, view), decode_candidates(view)
        d = self._argmin(costs, mask)
        note(view, "decode", self.name, "cost", costs, mask, d, {"tau_in_s": tau - view.now})
        return Assignment(view.instance_ids[p], view.instance_ids[d], tau)
