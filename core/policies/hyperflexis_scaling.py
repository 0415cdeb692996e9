"""HyperFlexis scaling (seed 004, §4): per-pool load signals, one action per tick, P↔D role flips.

Spec: ../shared/design/papers/hyperflexis.md §4.2–4.3 (the paper gives no thresholds; these are
the spec's concrete choices). Every `period_s`:

- prefill pool is hot when the p90 of held requests' wait / TTFT target > `wait_high`, or its
  utilisation (projected prefill backlog over one period, capped at 1) > `util_high`, or input
  outpaces processing (arrival rate / completion rate, EWMA over `rate_window_s`) > `rate_high`;
- decode pool is hot when its utilisation — per instance the larger of in-flight / max_num_seqs
  and KV usage, averaged — exceeds `util_high`;
- either pool is hot when SLO admission refuses (429) or expires (503) at least `refused_high`
  requests a second for want of it (prefill for its backlog, decode for slots or KV): refusals
  are demand the engines never show, since admission lets in only what they can start in time;
- a pool is low when its utilisation < `util_low`, nothing is refused for want of it, nothing
  waits past `wait_low` of its TTFT and the rate ratio < `rate_low`, for `low_ticks` decisions
  in a row;
- a hot pool takes an instance from a low pool by a role flip (its least-loaded instance drains,
  then flips; no restart), else gets a new one while the cluster is below `max_instances`;
- a pool low for long enough loses its least-loaded instance (drained first), never below
  `min_per_role`, and never within `no_scale_in_after_out_s` of the last scale-out.
Nothing happens while an instance is starting or draining: instances still starting count as
capacity, so the policy never provisions twice for one surge.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field, model_validator

from core.periodic import ScalingSignals
from core.policies.base import PeriodicParams, ScalingPolicyBase
from core.policies.registry import register
from core.types import PolicyKind, Role, ScaleAction
from core.view import ClusterView


class HyperFlexisScalingParams(PeriodicParams):
    period_s: float = Field(
        1.0, gt=0, description="seconds between decisions (the paper's τ: 0.5–2 s made little difference)"
    )
    util_high: float = Field(0.85, gt=0, le=1, description="a pool is hot above this mean utilisation")
    util_low: float = Field(0.3, ge=0, lt=1, description="a pool is low below this mean utilisation")
    wait_high: float = Field(0.5, gt=0, description="prefill hot: p90 of held requests' wait / TTFT target above this")
    wait_low: float = Field(0.1, ge=0, description="low only while that p90 stays below this")
    rate_high: float = Field(1.05, gt=0, description="prefill hot: arrival rate / completion rate above this")
    rate_low: float = Field(0.7, ge=0, description="low only while that ratio stays below this")
    rate_window_s: float = Field(5.0, gt=0, description="EWMA time constant of the two rates")
    low_ticks: int = Field(5, ge=1, description="decisions in a row a pool must be low before it shrinks")
    no_scale_in_after_out_s: float = Field(
        60.0, ge=0, description="no scale-in this soon after a scale-out (one cold start)"
    )
    max_instances: int = Field(8, ge=2, description="the cluster never grows past this many instances")
    min_per_role: int = Field(1, ge=1, description="never fewer active instances of a role than this")
    refused_high: float = Field(
        0.5,
        ge=0,
        description="a pool is hot when SLO admission refuses or expires this many requests a second for want of it; "
        "0 turns it off",
    )
    flips: bool = Field(True, description="serve a hot pool from a low one by a role flip before adding an instance")

    @model_validator(mode="after")
    def _check(self) -> HyperFlexisScalingParams:
        if self.util_low >= self.util_high or self.wait_low >= self.wait_high or self.rate_low >= self.rate_high:
            raise ValueError("each low threshold must be below its high one (hysteresis)")
        return self


@register(
    PolicyKind.SCALING,
    "hyperflexis",
    HyperFlexisScalingParams,
    "HyperFlexis: per-pool utilisation, wait/TTFT and input/processing rate; role flips before adding",
)
class HyperFlexisScaling(ScalingPolicyBase):
    params: HyperFlexisScalingParams

    def __init__(self, params: HyperFlexisScalingParams) -> None:
        super().__init__(params)
        self._in_rate: float | None = None
        self._out_rate: float | None = None
        self._rates_since: float | None = None
        self._low = {Role.PREFILL: 0, Role.DECODE: 0}
        self._last_out = -math.inf

    def _rates(self, s: ScalingSignals) -> float:
        """EWMA of input and processing rates; their ratio (0 with no input). Before the averages
        span one `rate_window_s` the ratio is not used (0): completions trail arrivals by a whole
        request latency, so a fresh start would read as input outpacing processing."""
        if self._rates_since is None:
            self._rates_since = s.now
        w = 1.0 - math.exp(-s.window_s / self.params.rate_window_s) if s.window_s > 0 else 1.0
        self._in_rate = (
            s.arrival_rate if self._in_rate is None else self._in_rate + w * (s.arrival_rate - self._in_rate)
        )
        # processing starts level with input (balance until shown otherwise), not at zero
        self._out_rate = (
            s.arrival_rate if self._out_rate is None else self._out_rate + w * (s.completion_rate - self._out_rate)
        )
        if self._in_rate < 1e-9 or s.now - self._rates_since < self.params.rate_window_s:
            return 0.0
        return self._in_rate / max(self._out_rate, 1e-9)

    def utilisation(self, s: ScalingSignals, role: Role) -> np.ndarray:
        """Per active instance of `role`, in [0, 1]."""
        u: np.ndarray
        if role == Role.DECODE:
            u = np.minimum(np.maximum(s.decode_util, s.decode_kv), 1.0)
        else:
            u = np.minimum(s.prefill_backlog_s / self.params.period_s, 1.0)
        return u

    def propose(self, signals: ScalingSignals, view: ClusterView, now: float) -> list[ScaleAction]:
        p = self.params
        ratio = self._rates(signals)
        waits = signals.queued_wait_ratios
        wait90 = float(np.percentile(waits, 90)) if len(waits) else 0.0
        util = {r: self.utilisation(signals, r) for r in (Role.PREFILL, Role.DECODE)}
        mean = {r: float(u.mean()) if len(u) else 0.0 for r, u in util.items()}
        refused = {r: signals.refused_rate.get(r, 0.0) for r in (Role.PREFILL, Role.DECODE)}
        hot = {
            Role.PREFILL: [
                why
                for ok, why in (
                    (wait90 > p.wait_high, f"p90 wait/TTFT {wait90:.2f} > {p.wait_high:g}"),
                    (
                        mean[Role.PREFILL] > p.util_high,
                        f"prefill utilisation {mean[Role.PREFILL]:.2f} > {p.util_high:g}",
                    ),
                    (ratio > p.rate_high, f"input/processing {ratio:.2f} > {p.rate_high:g}"),
                )
                if ok
            ],
            Role.DECODE: [f"decode utilisation {mean[Role.DECODE]:.2f} > {p.util_high:g}"]
            if mean[Role.DECODE] > p.util_high
            else [],
        }
        for r in (Role.PREFILL, Role.DECODE):
            if p.refused_high > 0 and refused[r] >= p.refused_high:
                hot[r].insert(0, f"admission refused {refused[r]:.1f}/s ≥ {p.refused_high:g}/s for want of {r}")
        calm = wait90 < p.wait_low and ratio < p.rate_low
        for r in (Role.PREFILL, Role.DECODE):
            low_now = not hot[r] and mean[r] < p.util_low and refused[r] == 0 and (calm or r == Role.DECODE)
            self._low[r] = self._low[r] + 1 if low_now else 0
        if signals.transitioning():
            return []
        ids = {Role.PREFILL: signals.prefill_ids, Role.DECODE: signals.decode_ids}
        active = sum(signals.count(r) for r in (Role.PREFILL, Role.DECODE))
        # a hot pool (the one refused more first): flip from the other one, else add
        for r in sorted((Role.PREFILL, Role.DECODE), key=lambda r: -refused[r]):
            if not hot[r]:
                continue
            other = Role.DECODE if r == Role.PREFILL else Role.PREFILL
            why = " or ".join(hot[r])
            if p.flips and self._low[other] > 0 and not hot[other] and len(ids[other]) > p.min_per_role:
                victim = self._least_loaded(ids[other], util[other])
                self._low[other] = 0
                return [
                    ScaleAction(
                        "flip",
                        r,
                        victim,
                        reason=(
                            f"{r} hot ({why}); {other} low (utilisation {mean[other]:.2f}): "
                            f"{victim}, its least loaded, becomes {r}"
                        ),
                    )
                ]
            if active < p.max_instances:
                self._last_out = now
                return [ScaleAction("add", r, reason=f"{r} hot ({why}); {active} active < max {p.max_instances}")]
        for r in (Role.PREFILL, Role.DECODE):  # a pool low for long enough shrinks by one
            if (
                self._low[r] >= p.low_ticks
                and len(ids[r]) > p.min_per_role
                and now - self._last_out >= p.no_scale_in_after_out_s
            ):
                victim = self._least_loaded(ids[r], util[r])
                ticks = self._low[r]
                self._low[r] = 0
                return [
                    ScaleAction(
                        "remove",
                        r,
                        victim,
                        reason=(
                            f"{r} low for {ticks} decisions (utilisation {mean[r]:.2f} < {p.util_low:g}); "
                            f"{victim} is the least loaded"
                        ),
                    )
                ]
        return []

    @staticmethod
    def _least_loaded(ids: list[str], util: np.ndarray) -> str:
        """Least utilised; among equals the newest (highest index) goes first."""
        k = len(util) - 1 - int(np.argmin(util[::-1]))
        return ids[k]
