"""The periodic decision point: scaling signals and the runner that calls reschedule/scaling policies.

One runner serves both worlds: the simulator calls it at virtual times taken from `next_at`, the
live controller from a wall-clock loop. Each active periodic policy is called at its own
`period_s`; a policy whose `acts` is False (the no-op baselines) is never scheduled, so a run with
only baselines has no periodic events at all.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.types import InstancePhase, PeriodicDecisions, PolicyKind, Role
from core.view import PHASES, ClusterView

PERIODIC_KINDS = (PolicyKind.RESCHEDULE, PolicyKind.SCALING)


@dataclass
class ScalingSignals:
    """What a scaling policy decides on, computed by the dispatcher from its own table.

    Identical live and simulated: every number comes from the request table, the instance phases
    and (live) the polled KV usage.
    """

    now: float
    """The dispatcher's clock when the signals were taken."""
    phases: dict[Role, dict[InstancePhase, int]]
    """Instances per role (as currently assigned) and phase; STOPPED ones included."""
    decode_ids: list[str]
    """The ACTIVE decode-serving instances the arrays below describe, in index order."""
    decode_in_flight: np.ndarray
    """Per active decode instance: requests pending (bound, in prefill/transfer) or running on it."""
    decode_util: np.ndarray
    """Per active decode instance: in-flight / profile.max_num_seqs."""
    decode_kv: np.ndarray
    """Per active decode instance: KV usage in [0, 1] (polled if known, else KV tokens / capacity)."""
    prefill_ids: list[str]
    """The ACTIVE prefill-serving instances, in index order."""
    prefill_backlog_s: np.ndarray
    """Per active prefill instance: projected seconds of prefill work routed to it and not done."""
    queue_len: int
    """Requests held by admission (the queue policy)."""
    oldest_wait_s: float
    """How long the oldest held request has waited (0 when none is held)."""
    arrival_rate: float
    """Requests admitted, queued or shed per second over the last `window_s`."""
    window_s: float
    """The window of `arrival_rate`: time since the previous signals (the policy's period)."""
    completion_rate: float = 0.0
    """Requests finished per second over the same window (the processing rate)."""
    queued_wait_ratios: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per held request: how long it has waited over its TTFT target."""
    decode_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per active decode instance: KV tokens bound to it (running + pending prompts)."""
    slo: dict[Role, RoleSlo] = field(default_factory=dict)
    """Per role, the SLO it answers for over the last SLO window: prefill the TTFT, decode the
    TPOT (of the requests finished in the window, each against its own targets)."""

    refused_rate: dict[Role, float] = field(default_factory=dict)
    """Per role, requests per second SLO admission refused (429) or expired (503) over the window
    because that pool was short (decode: no slot; prefill: its backlog)."""

    def slo_of(self, role: Role) -> RoleSlo:
        """The windowed SLO figures of `role` (empty when nothing finished in the window)."""
        return self.slo.get(role) or RoleSlo()

    def count(self, role: Role, phase: InstancePhase = InstancePhase.ACTIVE) -> int:
        return self.phases.get(role, {}).get(phase, 0)

    def transitioning(self) -> bool:
        """Whether any instance is STARTING or DRAINING (scaling policies wait for it)."""
        return any(c.get(InstancePhase.STARTING, 0) or c.get(InstancePhase.DRAINING, 0) for c in self.phases.values())

    @property
    def util_mean(self) -> float:
        return float(self.decode_util.mean()) if len(self.decode_util) else 0.0

    @property
    def kv_mean(self) -> float:
        return float(self.decode_kv.mean()) if len(self.decode_kv) else 0.0

    @property
    def prefill_backlog_mean_s(self) -> float:
        return float(self.prefill_backlog_s.mean()) if len(self.prefill_backlog_s) else 0.0


@dataclass(frozen=True)
class RoleSlo:
    """One role's SLO over the window: the latency it answers for, how often it met its target."""

    metric: str = ""
    """"ttft" (prefill) or "tpot" (decode)."""
    samples: int = 0
    """Requests finished in the window with this latency measured."""
    attainment: float | None = None
    """Share of them that met their target (None when there were none)."""
    p90_s: float | None = None
    """The 90th percentile of the latency (seconds)."""
    target_s: float | None = None
    """The tightest target among them (seconds)."""

    def missed(self, attainment_low: float, min_samples: int) -> bool:
        """Enough samples and an attainment below `attainment_low`."""
        return self.attainment is not None and self.samples >= min_samples and self.attainment < attainment_low


class SloWindow:
    """TTFT and TPOT of the requests finished in the last `window_s` seconds, against each one's
    own targets; the dispatcher fills it on every finish, the scaling signals read it."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._ttft: deque[tuple[float, float, float]] = deque()
        self._tpot: deque[tuple[float, float, float]] = deque()

    def add(
        self, now: float, ttft_s: float | None, ttft_target: float, tpot_s: float | None, tpot_target: float
    ) -> None:
        """One finished request; None for a latency that was not measured."""
        if ttft_s is not None:
            self._ttft.append((now, ttft_s, ttft_target))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s, tpot_target))
        self._drop(now)

    def _drop(self, now: float) -> None:
        """Forget what finished before the window (so memory stays bounded when nobody reads it)."""
        for q in (self._ttft, self._tpot):
            while q and q[0][0] < now - self.window_s:
                q.popleft()

    def role_slo(self, now: float) -> dict[Role, RoleSlo]:
        out: dict[Role, RoleSlo] = {}
        self._drop(now)
        for role, metric, q in ((Role.PREFILL, "ttft", self._ttft), (Role.DECODE, "tpot", self._tpot)):
            if not q:
                out[role] = RoleSlo(metric)
                continue
            values = np.fromiter((x[1] for x in q), dtype=float, count=len(q))
            targets = np.fromiter((x[2] for x in q), dtype=float, count=len(q))
            out[role] = RoleSlo(
                metric,
                len(q),
                float(np.mean(values <= targets)),
                float(np.percentile(values, 90)),
                float(targets.min()),
            )
        return out


def compute_signals(
    view: ClusterView,
    *,
    queue_len: int,
    oldest_wait_s: float,
    arrival_rate: float,
    window_s: float,
    completion_rate: float = 0.0,
    queued_wait_ratios: np.ndarray | None = None,
    slo: dict[Role, RoleSlo] | None = None,
    refused_rate: dict[Role, float] | None = None,
) -> ScalingSignals:
    """Build ScalingSignals from the view at `view.now`."""
    phases: dict[Role, dict[InstancePhase, int]] = {}
    for i, role in enumerate(view.roles):
        by_phase = phases.setdefault(role, {})
        ph = PHASES[int(view.phase[i])]
        by_phase[ph] = by_phase.get(ph, 0) + 1
    dmask = view.decode_mask()
    pmask = view.prefill_mask()
    ids = np.asarray(view.instance_ids, dtype=object)
    in_flight = (view.pending_n + view.running_n)[dmask]
    return ScalingSignals(
        now=view.now,
        phases=phases,
        decode_ids=[str(x) for x in ids[dmask]],
        decode_in_flight=in_flight,
        decode_util=in_flight / float(view.profile.max_num_seqs),
        decode_kv=view.kv_estimate()[dmask],
        prefill_ids=[str(x) for x in ids[pmask]],
        prefill_backlog_s=np.maximum(view.prefill_free_at[pmask] - view.now, 0.0),
        queue_len=queue_len,
        oldest_wait_s=oldest_wait_s,
        arrival_rate=arrival_rate,
        window_s=window_s,
        completion_rate=completion_rate,
        queued_wait_ratios=np.zeros(0) if queued_wait_ratios is None else queued_wait_ratios,
        decode_tokens=view.decode_tokens()[dmask],
        slo=slo or {},
        refused_rate=refused_rate or {},
    )


@dataclass
class PeriodicRunner:
    """Calls each acting periodic policy when its period comes round."""

    due: dict[PolicyKind, float] = field(default_factory=dict)
    """Next call time per periodic kind (absent: not scheduled)."""

    def schedule(self, kind: PolicyKind, policy: Any, now: float) -> None:
        """(Re)start a kind's cadence: first call one period after `now`, or never for no-ops."""
        if policy.acts:
            self.due[kind] = now + float(policy.params.period_s)
        else:
            self.due.pop(kind, None)

    def next_at(self) -> float:
        """The earliest due call, or inf when no periodic policy acts."""
        return min(self.due.values(), default=math.inf)

    def run(
        self,
        now: float,
        view: ClusterView,
        policies: dict[PolicyKind, Any],
        signals: Callable[[], Any],
    ) -> PeriodicDecisions:
        """Call every policy that is due at `now` and advance its cadence by whole periods."""
        out = PeriodicDecisions()
        for kind in PERIODIC_KINDS:
            at = self.due.get(kind)
            if at is None or at > now:
                continue
            policy = policies[kind]
            if kind == PolicyKind.RESCHEDULE:
                out.migrations.extend(policy.propose(view, now))
            else:
                out.scale.extend(policy.propose(signals(), view, now))
            period = float(policy.params.period_s)
            nxt = at + period
            self.due[kind] = nxt if nxt > now else now + period
        return out
