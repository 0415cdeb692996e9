"""Scaling policies: `static` (never acts) and `threshold` (saturation and admission's refusals, with hysteresis)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from core.periodic import ScalingSignals
from core.policies.base import PeriodicParams, ScalingPolicyBase
from core.policies.registry import register
from core.types import PolicyKind, Role, ScaleAction
from core.view import ClusterView


@register(
    PolicyKind.SCALING,
    "static",
    PeriodicParams,
    "baseline: the cluster keeps the instances it was started with",
)
class StaticScaling(ScalingPolicyBase):
    """Never proposes an action, so it is never scheduled (acts=False)."""

    acts = False

    def propose(self, signals: ScalingSignals, view: ClusterView, now: float) -> list[ScaleAction]:
        return []


class ThresholdParams(PeriodicParams):
    role: Literal["decode", "prefill"] = Field(
        "decode",
        description=(
            "which pool this policy sizes by its own measures (KV, utilisation, backlog, SLO); admission's refusals "
            "grow whichever pool they were refused for"
        ),
    )
    kv_high: float = Field(0.8, gt=0, le=1, description="saturated at mean KV usage ≥ this (llm-d's 0.80)")
    queue_high: int = Field(5, ge=1, description="saturated at this many held requests (llm-d's 5)")
    util_high: float = Field(
        0.9,
        gt=0,
        description="decode: saturated at mean in-flight / max_num_seqs ≥ this",
    )
    util_low: float = Field(0.3, ge=0, description="decode: low when mean in-flight / max_num_seqs ≤ this")
    kv_low: float = Field(0.3, ge=0, le=1, description="decode: low when mean KV usage ≤ this")
    backlog_high_s: float = Field(
        2.0,
        gt=0,
        description="prefill: saturated at mean queued prefill work ≥ this many seconds",
    )
    backlog_low_s: float = Field(
        0.2, ge=0, description="prefill: low when mean queued prefill work ≤ this many seconds"
    )
    slo_attainment: float = Field(
        0.9,
        ge=0,
        le=1,
        description=(
            "saturated when fewer than this share of the requests finished in the SLO window met "
            "the pool's own SLO (decode: TPOT, prefill: TTFT); 0 turns the SLO signal off"
        ),
    )
    refused_high: float = Field(
        0.5,
        ge=0,
        description=(
            "a pool is saturated when SLO admission refuses or expires this many requests per second for want of it "
            "(this policy's pool or the other one, which is drained back once low); 0 turns it off"
        ),
    )
    slo_min_samples: int = Field(
        8, ge=1, description="the SLO signal counts only with at least this many requests in its window"
    )
    scale_in_after_s: float = Field(60.0, ge=0, description="scale in only after the pool has been low this long")
    cooldown_s: float = Field(60.0, ge=0, description="no action within this many seconds of the previous one")
    min_instances: int = Field(1, ge=1, description="never scale the pool below this")
    max_instances: int = Field(64, ge=1, description="never scale the pool above this")
    period_s: float = Field(5.0, gt=0, description="seconds between two decisions")

    @model_validator(mode="after")
    def _check(self) -> ThresholdParams:
        if self.util_low >= self.util_high or self.kv_low >= self.kv_high:
            raise ValueError("low thresholds must be below the high ones (hysteresis)")
        if self.backlog_low_s >= self.backlog_high_s:
            raise ValueError("backlog_low_s must be below backlog_high_s")
        if self.min_instances > self.max_instances:
            raise ValueError("min_instances must be ≤ max_instances")
        return self


@dataclass(frozen=True)
class PoolAssessment:
    """One pool's state as `threshold` judges it."""

    hot: list[str]
    """The high thresholds crossed, as reasons (the pool's own measures and its refusals)."""
    refusing: str | None
    """The refusal threshold crossed, as a reason (None when admission refuses too little for want of it)."""
    low: bool
    """Every measure low, nothing refused for want of it, and no threshold crossed."""
    numbers: str
    """The measures, for the reasons."""


@register(
    PolicyKind.SCALING,
    "threshold",
    ThresholdParams,
    "saturation thresholds (KV, queue, utilisation, admission's refusals) with hysteresis, sustained-low scale-in, "
    "cooldown",
)
class ThresholdScaling(ScalingPolicyBase):
    """Saturation-based sizing of one pool, after llm-d's saturation autoscaler, and of the pool
    admission turns requests away for.

    Decode pool: saturated when mean KV usage ≥ kv_high, held requests ≥ queue_high, or mean
    utilisation (in-flight / max_num_seqs) ≥ util_high → add one instance. Low when all of
    KV ≤ kv_low, utilisation ≤ util_low and nothing held; after `scale_in_after_s` of
    uninterrupted low, remove the least-loaded active instance (the executor drains it first).
    Prefill pool: the same with the mean projected prefill backlog (seconds) for utilisation.
    Either pool is also saturated when its SLO was missed over the dispatcher's SLO window
    (attainment of TPOT for decode, TTFT for prefill below `slo_attainment`, with at least
    `slo_min_samples` requests in the window), and is never low while it is.

    Refusals are demand: SLO admission refuses (429) or expires (503) a request for want of the
    pool that bounds it (prefill for its backlog, decode for slots or KV), and an engine never
    looks loaded past what admission lets in, so the refused requests are the load it cannot
    see. At `refused_high` refusals a second for want of a pool, that pool is saturated — the
    pool this policy sizes or the other one. An instance added to the other pool is drained
    back (to the count it had before) once that pool has been low for `scale_in_after_s`; a pool
    is never low while anything is refused for want of it.
    Between the thresholds nothing happens and the low timer restarts (hysteresis). At most one
    action per decision (to the pool refused more when both are saturated), none within
    `cooldown_s` of the last, and none while any instance is STARTING or DRAINING, so the policy
    sees the effect of one action before the next.
    """

    params: ThresholdParams

    def __init__(self, params: ThresholdParams) -> None:
        super().__init__(params)
        self._last_action = -math.inf
        self._low_since: dict[Role, float | None] = {Role.PREFILL: None, Role.DECODE: None}
        self._baseline: dict[Role, int] = {}
        """The other pool's active instances before this policy first added one there: it drains back to this."""

    def propose(self, signals: ScalingSignals, view: ClusterView, now: float) -> list[ScaleAction]:
        p = self.params
        own = Role(p.role)
        other = Role.PREFILL if own == Role.DECODE else Role.DECODE
        pools = {own: self._assess(signals, own), other: self._assess(signals, other)}
        for role, pool in pools.items():
            if not pool.low:
                self._low_since[role] = None
            elif self._low_since[role] is None:
                self._low_since[role] = now
        if signals.transitioning() or now - self._last_action < p.cooldown_s:
            return []
        action = self._scale_out(signals, pools, own) or self._scale_in(signals, pools, own, now)
        if action is None:
            return []
        self._last_action = now
        self._low_since[action.role] = None
        return [action]

    @staticmethod
    def _ids(s: ScalingSignals, role: Role) -> list[str]:
        return s.decode_ids if role == Role.DECODE else s.prefill_ids

    def _scale_out(self, s: ScalingSignals, pools: dict[Role, PoolAssessment], own: Role) -> ScaleAction | None:
        """Add one instance to a saturated pool below max_instances: the own pool by any high
        threshold, the other by its refusals; the pool refused more first, the own one on a tie."""
        p = self.params
        why = {own: pools[own].hot, **{r: [a.refusing] for r, a in pools.items() if r != own and a.refusing}}
        hot = [r for r, reasons in why.items() if reasons and len(self._ids(s, r)) < p.max_instances]
        if not hot:
            return None
        role = max(hot, key=lambda r: (s.refused_rate.get(r, 0.0), r == own))
        active = len(self._ids(s, role))
        if role != own:
            self._baseline.setdefault(role, active)
        return ScaleAction(
            "add", role, reason=f"{role} saturated: {' or '.join(why[role])} ({pools[role].numbers}; {active} active)"
        )

    def _scale_in(
        self, s: ScalingSignals, pools: dict[Role, PoolAssessment], own: Role, now: float
    ) -> ScaleAction | None:
        """Remove the least-loaded instance of a pool low for scale_in_after_s: the own pool down to
        min_instances, the other down to what it had before this policy added to it."""
        p = self.params
        for role, pool in pools.items():
            since = self._low_since[role]
            floor = p.min_instances if role == own else self._baseline.get(role)
            if floor is None or since is None or now - since < p.scale_in_after_s:
                continue
            ids = self._ids(s, role)
            active = len(ids)
            floor = max(floor, p.min_instances)
            if active <= floor:
                continue
            if role != own and active - 1 <= floor:
                del self._baseline[role]
            load = s.decode_in_flight if role == Role.DECODE else s.prefill_backlog_s
            # Least loaded; among equals the newest (highest index) goes first.
            k = len(load) - 1 - int(np.argmin(load[::-1]))
            bound = f"min {p.min_instances}" if role == own else f"{floor} before admission's refusals added to it"
            return ScaleAction(
                "remove",
                role,
                ids[k],
                reason=(
                    f"{role} low for {now - since:.0f} s ≥ {p.scale_in_after_s:g} s "
                    f"({pool.numbers}; {active} active > {bound}); "
                    f"{ids[k]} is the least loaded ({load[k]:g})"
                ),
            )
        return None

    def _assess(self, s: ScalingSignals, role: Role) -> PoolAssessment:
        """Which high thresholds `role`'s pool crosses, whether every measure is low, and the numbers."""
        p = self.params
        hot: list[str] = []
        if s.queue_len >= p.queue_high:
            hot.append(f"queue {s.queue_len} ≥ {p.queue_high}")
        refused = s.refused_rate.get(role, 0.0)
        refusing = None
        if p.refused_high > 0 and refused >= p.refused_high:
            refusing = f"admission refused {refused:.1f}/s ≥ {p.refused_high:g}/s for want of {role} capacity"
            hot.append(refusing)
        slo = s.slo_of(role)
        if p.slo_attainment > 0 and slo.missed(p.slo_attainment, p.slo_min_samples):
            assert slo.attainment is not None and slo.p90_s is not None
            hot.append(
                f"{slo.metric.upper()} attainment {slo.attainment:.0%} < {p.slo_attainment:.0%} over "
                f"{slo.samples} requests (p90 {slo.p90_s * 1000:.0f} ms, target {(slo.target_s or 0) * 1000:.0f} ms)"
            )
        if role == Role.DECODE:
            kv, util = s.kv_mean, s.util_mean
            if kv >= p.kv_high:
                hot.append(f"KV mean {kv:.3g} ≥ {p.kv_high:g}")
            if util >= p.util_high:
                hot.append(f"utilisation {util:.3g} ≥ {p.util_high:g}")
            low = kv <= p.kv_low and util <= p.util_low and s.queue_len == 0
            numbers = f"KV mean {kv:.2f}, utilisation {util:.2f}, queue {s.queue_len}"
        else:
            backlog = s.prefill_backlog_mean_s
            if backlog >= p.backlog_high_s:
                hot.append(f"prefill backlog {backlog:.2f} s ≥ {p.backlog_high_s:g} s")
            low = backlog <= p.backlog_low_s and s.queue_len == 0
            numbers = f"prefill backlog {backlog:.2f} s, queue {s.queue_len}"
        if refused > 0:
            numbers += f", refused {refused:.2f}/s"
        return PoolAssessment(hot, refusing, low and refused == 0 and not hot, numbers)
