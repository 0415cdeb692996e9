"""The dispatcher's state and its active policies, which every part of it reads (core/dispatch/)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from core.admission import AdmissionControl, SloGate
from core.decision_log import DecisionLog, PrefixHits
from core.dispatch.canary import CANARY, Canary
from core.dispatch.prefix import PrefixTracker
from core.periodic import PeriodicRunner, SloWindow
from core.policies.base import QueuePolicy, ReschedulePolicy, RoutingPolicy, ScalingPolicy
from core.policies.rank.base import RankPolicyBase
from core.types import (
    PolicyEvent,
    PolicyKind,
    Request,
    Role,
)
from core.view import ClusterView

PolicySetting = tuple[str, dict[str, Any]]


@dataclass
class AssignmentScore:
    """How often a routing policy's decode choice was still the least-loaded instance at handoff."""

    hits: int = 0
    total: int = 0

    @property
    def ratio(self) -> float:
        return self.hits / self.total if self.total else float("nan")


@dataclass
class _Tracked:
    """Per-request facts the table's numeric columns don't hold."""

    request: Request
    router: RoutingPolicy
    """The routing policy that routed it; it also binds it late, whatever is active by then."""
    prefill_est: float
    """Seconds from routing to its projected first token (`prefill_due` − routed at)."""
    prefill_due: float
    """When its first token was projected to come out of its prefill instance as routed (batched
    with the prompts projected there, core/prefill.py); view.queues.due has it as projected now."""
    handoff_est: float = 0.0
    """Seconds from its prefill's first token to the client's, as projected when it was routed
    (`SloGate.handoff_s`; kept only under SLO admission, whose TTFT drift compares it)."""
    own_est: float = 0.0
    """Of its projected TTFT, its own service: its prefill alone on its instance and `handoff_est`."""
    joining_est: float = 0.0
    """Of its projected TTFT, what the prompts expected to join its prefill step add (`StepJoiners`; SLO admission)."""
    alone: bool = True
    """No other prefill the gateway routed was in flight on its prefill instance when it was routed."""
    in_prefill: bool = True
    """Routed and its prefill has not ended (counted in view.prefill_n)."""
    computed: int = 0
    """Prompt tokens its prefill computes (the uncached part on its prefill instance, as routed)."""
    routed_at: float = 0.0
    shadow_choices: list[int] = field(default_factory=list)
    sampled: bool = False
    """Whether the decision log wanted its decisions when it was routed (one it did not want then is
    never in the log: the log is not asked about it again)."""
    arm: str | None = None
    """Its arm in the canary running when it was routed (core/dispatch/canary.py; None: no canary ran)."""
    canary_policy: Any = None
    """The canary's candidate when it is in the canary arm (it routed it, or chooses its rank)."""
    miss_heard: bool = False
    """SLO admission's margin counted it as a miss before its end: it passed its TTFT target before
    its decode began (heard at the next arrival or release past that target, else at the hand-off)."""


class DispatcherBase:
    """What the dispatcher holds (set up by `Dispatcher.__init__`) and its active policies."""

    view: ClusterView
    true_lengths: bool
    completions: int
    migrations: int
    _index: dict[str, int]
    prefix: PrefixTracker
    _dp_groups: dict[int, tuple[int, int]]
    _tracked: dict[Hashable, _Tracked]
    admission: AdmissionControl
    gate: SloGate | None
    shed_reason: str
    _signals_at: tuple[float, int, int]
    _refused_at: dict[Role, int]
    slo_window: SloWindow
    runner: PeriodicRunner
    policies: dict[PolicyKind, Any]
    policy_events: list[PolicyEvent]
    shadows: list[tuple[str, RoutingPolicy]]
    scores: dict[str, AssignmentScore]
    ratio_load: str
    score: AssignmentScore
    decisions: DecisionLog | None
    prefix_hits: PrefixHits
    canary: Canary | None

    # --- the active policies --------------------------------------------------------------------
    @property
    def routing(self) -> RoutingPolicy:
        policy: RoutingPolicy = self.policies[PolicyKind.ROUTING]
        return policy

    @property
    def queue(self) -> QueuePolicy:
        policy: QueuePolicy = self.policies[PolicyKind.QUEUE]
        return policy

    @property
    def reschedule(self) -> ReschedulePolicy:
        policy: ReschedulePolicy = self.policies[PolicyKind.RESCHEDULE]
        return policy

    @property
    def scaling(self) -> ScalingPolicy:
        policy: ScalingPolicy = self.policies[PolicyKind.SCALING]
        return policy

    @property
    def rank(self) -> RankPolicyBase:
        policy: RankPolicyBase = self.policies[PolicyKind.RANK]
        return policy

    @property
    def needs_progress(self) -> bool:
        """Whether any active or shadow policy reads per-request progress."""
        canary = self.canary
        return bool(
            self.routing.needs_progress
            or any(p.needs_progress for _, p in self.shadows)
            or (canary is not None and getattr(canary.policy, "needs_progress", False))
        )

    @property
    def reads_prefix(self) -> bool:
        """Whether the active routing policy, or a routing canary's candidate, reads the prefix cache."""
        canary = self.canary
        return bool(self.routing.reads_prefix or (canary is not None and getattr(canary.policy, "reads_prefix", False)))

    def arm_of(self, request_id: Hashable) -> str | None:
        """The canary arm a tracked request was routed in (None: untracked, or no canary ran then)."""
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.arm

    def _canary_policy(self, request_id: Hashable, kind: PolicyKind) -> Any:
        """The canary's candidate of `kind` if the request is in its canary arm, else None."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.arm != CANARY or tracked.canary_policy is None:
            return None
        return tracked.canary_policy if getattr(tracked.canary_policy, "kind", None) == kind else None

    def set_targets(self, request: Request) -> None:
        """Fill the request's TTFT/TPOT targets from its SLO class where the client set none."""
        if request.slo_class == "default" and request.ttft_s is None:
            self.routing.assign_targets(request, self.view, self.queue)
        if request.ttft_s is None or request.tpot_s is None:
            slo = self.view.slo
            cls = slo.get(request.slo_class) or slo["default"]
            if request.ttft_s is None:
                request.ttft_s = cls.ttft_s
            if request.tpot_s is None:
                request.tpot_s = cls.tpot_s
