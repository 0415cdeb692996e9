"""Priority orderings for `core.sim.instance.engine.InstanceSim` (γ-Boost's blocks: core/policies/gamma.py).

Section numbers refer to shared/design/papers/tail-aware.md ("the spec"), which follows Li et al.,
"Beyond Prediction: Tail-Aware Scheduling for LLM Inference".

* ``fcfs``: vLLM v1 / Sarathi (spec §3): running requests first in admission order, then the
  waiting FIFO (preempted requests back at its head); a running request short of KV preempts the
  latest-admitted one (possibly itself); no admission in a step that preempted.
* ``sjf`` (LTR+, spec §3): one order over running and waiting by (promoted first, output length);
  perfect or predicted lengths; LTR's starvation guard (idle ≥ `starv_steps` consecutive steps →
  top priority for `period_steps` scheduled steps); waiting requests never evict running ones.
* ``srpt`` (TRAIL+, spec §3): remaining decode tokens, preemptive (a waiting request may evict a
  running one with more remaining), except that a request that decoded ≥ 0.6 of its length is
  not preemptible.
* ``tail_aware`` (UniBoost, spec §2.5–2.9): Φ = a − b_γ(τ·ŵ), MemGuard bins and leases, the δ
  hysteresis on victims, γ adapted online from completed requests' E2E tail (γ-Ada).

Predicted lengths (our choice; the spec's baselines use oracle lengths and name no predictor):
L̂ = round(L·e^{σZ}), Z ~ N(0,1) drawn per request from (seed, request id), so SJF and SRPT see the
same predictions. σ = 0.5 gives a coefficient of variation of about 0.53, the order of the
paper's rerun-to-rerun CV of one prompt (up to 0.47), i.e. the irreducible error of any
predictor. An exhausted prediction (decoded ≥ L̂) leaves 0 tokens remaining.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.policies.gamma import (
    GammaAda,
    GammaAdaParams,
    boost,
    predicted_length,
    profile_tau,
    quantize,
)
from core.sim.instance.model import RUNNING, WAITING, Key, OrderedInstance, Ordering, SimRequest

# --- params ---------------------------------------------------------------------------------


class FcfsOrderingParams(BaseModel):
    """FCFS (vLLM v1 default) takes no parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _LengthParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lengths: Literal["perfect", "predicted"] = Field(
        "perfect", description="rank by the true output length or by a noisy prediction of it"
    )
    predictor_sigma: float = Field(
        0.5, ge=0, le=3, description="log-normal error σ of predicted lengths (L̂ = L·e^{σZ})"
    )
    seed: int = Field(0, ge=0, description="seed of the length predictor")


class SjfParams(_LengthParams):
    """SJF (LTR+): shortest (predicted) output first with LTR's starvation guard (spec §3)."""

    starvation_guard: bool = Field(True, description="LTR quantum control on idle steps")
    starv_steps: int = Field(100, ge=1, description="consecutive unscheduled steps before promotion (LTR `starv`)")
    period_steps: int = Field(50, ge=1, description="scheduled steps a promoted request keeps top priority (`period`)")


class SrptParams(_LengthParams):
    """SRPT (TRAIL+): fewest remaining decode tokens first, preemptive (spec §3)."""

    no_preempt_fraction: float = Field(
        0.6,
        ge=0,
        le=1,
        description="a request that decoded this fraction of its length is not preemptible",
    )


class TailAwareParams(GammaAdaParams):
    """UniBoost (spec §2.5–2.9): Φ = a − b_γ(τ·ŵ), MemGuard, δ hysteresis, γ-Ada."""

    delta_s: float = Field(0.1, ge=0, description="hysteresis δ (s): victim needs Φ_v > Φ_r + δ (Eq. 7; paper 0.1)")
    memguard: bool = Field(True, description="geometric bins + leases (spec §2.6); False = UniBoost-base, exact w̃")
    signal: Literal["unified", "phase"] = Field(
        "unified",
        description="w̃ = max(tokens processed, prompt) (§3.2/A.5) or Algorithm 1's phase signal",
    )
    tau_s: float | None = Field(None, gt=0, description="engine seconds per token τ; None = online EMA over busy steps")
    tau_ema_alpha: float = Field(0.01, gt=0, le=1, description="EMA weight per busy step of the online τ estimate")
    rekey_interval_s: float = Field(
        5.0, gt=0, description="seconds between τ refreshes / γ updates that re-key every Φ"
    )


# --- orderings --------------------------------------------------------------------------------


class _Base:
    name = ""
    admit_after_preemption = True

    def __init__(self) -> None:
        self._inst: OrderedInstance | None = None

    @property
    def inst(self) -> OrderedInstance:
        if self._inst is None:
            raise RuntimeError(f"ordering {self.name!r} is not bound to an instance")
        return self._inst

    def bind(self, inst: OrderedInstance) -> None:
        if self._inst is not None:
            raise RuntimeError(f"ordering {self.name!r} already serves an instance")
        self._inst = inst

    def on_arrival(self, r: SimRequest, now: float) -> None:
        pass

    def before_step(self, now: float) -> None:
        pass

    def on_scheduled(self, r: SimRequest) -> None:
        pass

    def on_evict(self, r: SimRequest) -> None:
        pass

    def after_step(self, dt: float, tokens: int, now: float) -> None:
        pass

    def on_finish(self, r: SimRequest, now: float) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {}


class FcfsOrdering(_Base):
    """vLLM v1 FCFS (Sarathi): running in admission order, then the waiting FIFO (spec §3)."""

    name = "fcfs"
    admit_after_preemption = False

    def __init__(self, params: FcfsOrderingParams | None = None) -> None:
        super().__init__()
        self.params = params or FcfsOrderingParams()

    def key(self, r: SimRequest) -> Key:
        if r.state == RUNNING:
            return (0.0, float(r.admit_seq))
        return (1.0, float(r.queue_seq))

    def victim(self, r: SimRequest, forced: bool) -> SimRequest | None:
        # vLLM: only a running request short of KV preempts, and it preempts running[-1].
        if r.state != RUNNING:
            return None
        return self.inst.running[-1]


class _Lengths(_Base):
    def __init__(self, params: _LengthParams) -> None:
        super().__init__()
        self.lp = params
        if params.lengths == "predicted":
            self.name += "(predicted)"

    def on_arrival(self, r: SimRequest, now: float) -> None:
        if r.pred == 0:
            p = self.lp
            r.pred = (
                r.output if p.lengths == "perfect" else predicted_length(r.rid, r.output, p.predictor_sigma, p.seed)
            )


class Sjf(_Lengths):
    """SJF / LTR+ (spec §3): key (promoted first, (predicted) output length, arrival).

    Non-preemptive for admission (the paper: it lacks "preemption to reclaim KV memory"); a
    running request short of KV preempts the lowest-priority running one, as vLLM's priority
    mode. Starvation guard as in the LTR code: a request unscheduled for `starv_steps`
    consecutive steps is promoted for `period_steps` scheduled steps, then demoted.
    """

    name = "sjf"

    def __init__(self, params: SjfParams | None = None) -> None:
        self.params = params or SjfParams()
        super().__init__(self.params)
        self._idle: list[tuple[int, int, SimRequest]] = []
        self.promotions = 0

    def key(self, r: SimRequest) -> Key:
        return (0.0 if r.promoted else 1.0, float(r.pred), r.arrival, float(r.rid))

    def on_arrival(self, r: SimRequest, now: float) -> None:
        super().on_arrival(r, now)
        if self.params.starvation_guard:
            heapq.heappush(self._idle, (r.idle_base, r.rid, r))

    def on_evict(self, r: SimRequest) -> None:
        if self.params.starvation_guard:
            heapq.heappush(self._idle, (r.idle_base, r.rid, r))

    def _promote(self, r: SimRequest, step: int) -> None:
        r.promoted = True
        r.runs = self.params.period_steps
        r.idle_base = step
        self.promotions += 1

    def before_step(self, now: float) -> None:
        if not self.params.starvation_guard:
            return
        inst = self.inst
        step = inst.step_no
        starv = self.params.starv_steps
        idle = self._idle
        while idle and step - idle[0][0] >= starv:
            base, rid, r = heapq.heappop(idle)
            if r.state != WAITING or r.idle_base != base:
                continue  # scheduled or re-queued since: stale entry
            self._promote(r, step)
            inst.requeue(r)
            heapq.heappush(idle, (r.idle_base, rid, r))
        for r in inst.running:
            if step - r.idle_base >= starv:
                self._promote(r, step)

    def on_scheduled(self, r: SimRequest) -> None:
        r.idle_base = self.inst.step_no + 1
        if r.promoted:
            r.runs -= 1
            if r.runs <= 0:
                r.promoted = False

    def victim(self, r: SimRequest, forced: bool) -> SimRequest | None:
        if r.state != RUNNING:
            return None
        return max(self.inst.running, key=self.key)

    def counters(self) -> dict[str, float]:
        return {"promotions": float(self.promotions)}


class Srpt(_Lengths):
    """SRPT / TRAIL+ (spec §3): key = (predicted) remaining decode tokens; preemptive for
    running and waiting requesters, except victims that decoded ≥ `no_preempt_fraction` of
    their (predicted) length."""

    name = "srpt"

    def __init__(self, params: SrptParams | None = None) -> None:
        self.params = params or SrptParams()
        super().__init__(self.params)

    def key(self, r: SimRequest) -> Key:
        return (float(max(r.pred - r.generated, 0)), r.arrival, float(r.rid))

    def victim(self, r: SimRequest, forced: bool) -> SimRequest | None:
        run = self.inst.running
        if forced:
            return max(run, key=self.key)
        kr = self.key(r)
        frac = self.params.no_preempt_fraction
        best: SimRequest | None = None
        best_k: Key = kr
        for v in run:
            if v is r or v.generated >= frac * v.pred:
                continue
            kv = self.key(v)
            if kv > best_k:
                best, best_k = v, kv
        return best


class TailAware(_Base):
    """UniBoost / γ-Boost for one instance (spec §2.5–2.9).

    * Score (§2.2, §2.5): Φ = a − b_γ(x) with x = τ·ŵ seconds (§2.3 units), a = original
      arrival, w̃ = max(w, prompt) with w = prompt tokens prefilled + tokens generated
      (`signal="unified"`), or prompt during prefill / decoded tokens after it (`"phase"`).
    * MemGuard (§2.6): ŵ = k·2^⌊log2(max(1, w̃/k))⌋; Φ changes only when ŵ does. A scheduled
      request holds a lease on its bin: it is served in the first pass (leased running by Φ)
      and is never a victim; a bin change drops the lease until it is scheduled again.
    * Victims (§2.9): running, unleased, Φ_v > Φ_r + δ; the largest Φ, and among those within δ
      of it the smallest resident KV. Safety valve (§2.6): a running request short of KV with
      no eligible victim evicts the largest-Φ running request (possibly itself), counted in
      `valve_evictions`. A waiting request with no eligible victim waits.
    * γ-Ada (§2.7) on completed requests' E2E; τ (§2.3) from an EMA of step time and step
      tokens over busy steps (or `tau_s`). Every `rekey_interval_s` τ is refreshed, γ updated
      if due, and every Φ re-keyed (leases kept).
    * Step (§2.8): pass 1 = leased running by Φ, pass 2 = everything else by Φ (ties: arrival,
      id). Our reading of §2.8's "strict order": a waiting request never overtakes a blocked
      one with a lower Φ, but resident requests further down that fit still run (§2.8: "every
      resident decode runs each step unless higher-Φ prefills take the budget").
    * Eviction is by recompute (vLLM v1), not the spec's default swap (§2.9).
    """

    name = "tail_aware"

    def __init__(self, params: TailAwareParams | None = None) -> None:
        super().__init__()
        self.params = params or TailAwareParams()
        self.ada = GammaAda(self.params)
        self._ema_t = 0.0
        self._ema_n = 0.0
        self._tau_prior = 5e-4
        self.tau = 5e-4
        """τ used by the current Φ keys (s/token)."""
        self.gamma = self.ada.gamma(self.tau)
        self._last_rekey = -math.inf
        self.valve_evictions = 0
        self.trace: list[tuple[float, float, float]] = []
        """(time, γ, τ) at every re-key check (every `rekey_interval_s` while busy)."""

    def bind(self, inst: OrderedInstance) -> None:
        super().bind(inst)
        self._tau_prior = self.params.tau_s or profile_tau(inst.profile)
        self.tau = self._tau_prior
        self.gamma = self.ada.gamma(self.tau)

    # --- Φ ----------------------------------------------------------------------------------
    def signal(self, r: SimRequest) -> float:
        if self.params.signal == "phase":
            return float(r.prompt if r.in_prefill else r.generated)
        return float(max(r.work, r.prompt))

    def bin_of(self, r: SimRequest) -> int:
        s = self.signal(r)
        if self.params.memguard:
            return quantize(s, self.params.bin_tokens)
        return max(1, int(s))

    def phi_of(self, arrival: float, w_hat: int) -> float:
        return arrival - boost(self.tau * w_hat, self.gamma)

    def key(self, r: SimRequest) -> Key:
        return (0.0 if r.lease and r.state == RUNNING else 1.0, r.phi, r.arrival, float(r.rid))

    def on_arrival(self, r: SimRequest, now: float) -> None:
        r.bin = self.bin_of(r)
        r.phi = self.phi_of(r.arrival, r.bin)
        r.lease = False

    def current_tau(self) -> float:
        if self.params.tau_s is not None or self._ema_n <= 0:
            return self._tau_prior
        return self._ema_t / self._ema_n

    def _rekey_all(self) -> None:
        inst = self.inst
        for r in inst.running:
            r.phi = self.phi_of(r.arrival, r.bin)
        for r in inst.waiting.values():
            r.phi = self.phi_of(r.arrival, r.bin)
        inst.rekey_waiting()

    def before_step(self, now: float) -> None:
        if now - self._last_rekey >= self.params.rekey_interval_s:
            self._last_rekey = now
            tau = self.current_tau()
            self.ada.update(now, tau)
            gamma = self.ada.gamma(tau)
            self.trace.append((now, gamma, tau))
            if tau != self.tau or gamma != self.gamma:
                self.tau, self.gamma = tau, gamma
                self._rekey_all()
        for r in self.inst.running:
            b = self.bin_of(r)
            if b != r.bin:
                r.bin = b
                r.lease = False  # its preemption point (spec §2.6)
                r.phi = self.phi_of(r.arrival, b)

    def on_scheduled(self, r: SimRequest) -> None:
        if self.params.memguard:
            r.lease = True

    def on_evict(self, r: SimRequest) -> None:
        r.lease = False

    def victim(self, r: SimRequest, forced: bool) -> SimRequest | None:
        run = self.inst.running
        delta = self.params.delta_s
        limit = r.phi + delta
        cands = [v for v in run if v is not r and not v.lease and v.phi > limit]
        if cands:
            top = max(v.phi for v in cands)
            near = [v for v in cands if v.phi >= top - delta]
            return min(near, key=lambda v: (v.blocks, -v.phi, -v.arrival, -v.rid))
        if r.state == RUNNING or forced:
            self.valve_evictions += 1
            return max(run, key=lambda v: (v.phi, v.arrival, v.rid))
        return None

    def after_step(self, dt: float, tokens: int, now: float) -> None:
        a = self.params.tau_ema_alpha
        self._ema_t = (1 - a) * self._ema_t + a * dt
        self._ema_n = (1 - a) * self._ema_n + a * tokens

    def on_finish(self, r: SimRequest, now: float) -> None:
        self.ada.observe(now, now - r.arrival)

    def counters(self) -> dict[str, float]:
        return {
            "valve_evictions": float(self.valve_evictions),
            "gamma_updates": float(self.ada.updates),
            "gamma": self.gamma,
            "tau": self.tau,
            "u_k": self.gamma * self.tau * self.params.bin_tokens,
        }


# --- registry -------------------------------------------------------------------------------

ORDERINGS: dict[str, tuple[type[Any], type[BaseModel]]] = {
    "fcfs": (FcfsOrdering, FcfsOrderingParams),
    "sjf": (Sjf, SjfParams),
    "srpt": (Srpt, SrptParams),
    "tail_aware": (TailAware, TailAwareParams),
}


def build_ordering(name: str, params: dict[str, Any] | None = None) -> Ordering:
    """A fresh ordering by name with validated params (one ordering serves one instance)."""
    if name not in ORDERINGS:
        raise ValueError(f"unknown ordering {name!r}; available: {', '.join(sorted(ORDERINGS))}")
    cls, model = ORDERINGS[name]
    ordering: Ordering = cls(model.model_validate(params or {}))
    return ordering
