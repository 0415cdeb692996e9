"""The dispatcher: request table, estimators, the active policy of each kind, admission, hot swap.

It is pure: callers tell it the time and the events (arrived, routed, prefill started/ended,
decode started, progress, finished, failed, instance added/drained/observed) and it answers
decisions (admit or hold or shed, which instances, which periodic actions). The simulator feeds
it virtual time; the live gateway feeds it time.monotonic(). Both drive the same methods.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from core.admission import AdmissionControl, SloGate
from core.cache.events import KVEvent
from core.cache.index import PrefixLookup
from core.decision_log import DecisionLog, PrefixHits, periodic_records
from core.dispatch.base import AssignmentScore, PolicySetting, _Tracked
from core.dispatch.canary import SPLIT_KINDS, Canary
from core.dispatch.lifecycle import LifecycleMixin
from core.dispatch.prefix import APPROXIMATE_TTL_S, PrefixTracker
from core.errors import PolicyError
from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from core.perf import PerfProfile
from core.periodic import PERIODIC_KINDS, PeriodicRunner, ScalingSignals, SloWindow, compute_signals
from core.policies import registry
from core.policies.base import RoutingPolicy
from core.request_table import RequestTable
from core.slo import SLOClass
from core.types import (
    PeriodicDecisions,
    PolicyEvent,
    PolicyKind,
    Request,
    Role,
)
from core.view import ClusterView


class Dispatcher(LifecycleMixin):
    """One request table, the estimators and the active policies; one instance per cluster."""

    def __init__(
        self,
        profile: PerfProfile,
        routing: str = "round_robin",
        routing_params: dict[str, Any] | None = None,
        *,
        shadow: Sequence[PolicySetting] = (),
        queue: PolicySetting = ("fcfs", {}),
        reschedule: PolicySetting = ("none", {}),
        scaling: PolicySetting = ("static", {}),
        rank: PolicySetting = ("engine", {}),
        true_lengths: bool = False,
        survival_delta: int = 64,
        survival_alpha: float = 0.99,
        survival_prior_max: int | None = None,
        decode_rate_prior: float | None = None,
        ratio_load: str = "requests",
        slo: dict[str, SLOClass] | None = None,
    ) -> None:
        if ratio_load not in ("requests", "tokens"):
            raise ValueError("ratio_load must be 'requests' or 'tokens'")
        self.true_lengths = true_lengths
        """Whether Request.max_tokens is the true output length (the simulator), so oracle
        routing policies (needs_true_lengths) may run."""
        max_len = profile.max_model_len
        prior_rate = decode_rate_prior or profile.per_request_rate(max(1, profile.max_num_seqs // 4))
        self.view = ClusterView(
            profile=profile,
            table=RequestTable(),
            survival=SurvivalEstimator(survival_delta, survival_alpha, max_len, survival_prior_max),
            prefill_time=PrefillTimeEstimator(profile),
            decode_rate=DecodeRateEstimator(prior_rate),
        )
        if slo:
            self.view.slo = {**self.view.slo, **slo}
        self.completions = 0
        """Requests finished (the processing rate of the scaling signals)."""
        self.migrations = 0
        """Running requests moved between decode instances (live migrations executed)."""
        self._index: dict[str, int] = self.view.index
        self.prefix = PrefixTracker(self.view)
        """Where `view.prefix` comes from (off until a caller chooses a source, see `use_prefix_*`);
        a live console that can serve decode-only requests sets `view.decode_only`."""
        self._dp_groups: dict[int, tuple[int, int]] = {}
        """Decode instances that are data-parallel groups: index → (ranks, slots per rank)."""
        self._tracked: dict[Hashable, _Tracked] = {}
        self.admission = AdmissionControl()
        """Requests held by the queue policy, and when each was queued."""
        self.gate: SloGate | None = None
        """SLO-protecting admission limits (`use_slo_admission`; off unless a caller turns it on)."""
        self.shed_reason = ""
        """Why the last request answered SHED was refused."""
        self._signals_at = (0.0, 0, 0)
        self._refused_at: dict[Role, int] = {}
        self.slo_window = SloWindow()
        """TTFT and TPOT of recently finished requests (the scaling signals' per-role SLO)."""
        self.runner = PeriodicRunner()
        self.policies: dict[PolicyKind, Any] = {}
        self.policy_events: list[PolicyEvent] = []
        initial: list[tuple[PolicyKind, str, dict[str, Any] | None]] = [
            (PolicyKind.ROUTING, routing, routing_params),
            (PolicyKind.QUEUE, *queue),
            (PolicyKind.RESCHEDULE, *reschedule),
            (PolicyKind.SCALING, *scaling),
            (PolicyKind.RANK, *rank),
        ]
        for kind, name, params in initial:
            policy = self._build(kind, name, params)
            self.policies[kind] = policy
            if kind in PERIODIC_KINDS:
                self.runner.schedule(kind, policy, 0.0)
            self.policy_events.append(PolicyEvent(0.0, kind, None, name, policy.params.model_dump(), "config"))
        self.shadows: list[tuple[str, RoutingPolicy]] = [
            (self._shadow_label(n, p), self._build(PolicyKind.ROUTING, n, p)) for n, p in shadow
        ]
        self.scores: dict[str, AssignmentScore] = {label: AssignmentScore() for label, _ in self.shadows}
        self.ratio_load = ratio_load
        """Load measure for the optimal-assignment ratio: running requests (ties count) or KV tokens."""
        self.score = AssignmentScore()
        """Optimal-assignment score of the decisions actually taken (whatever policy took them)."""
        self.decisions: DecisionLog | None = None
        """Where decision records go (`use_decisions`); None: no records are made."""
        self.prefix_hits = PrefixHits()
        """Achieved against achievable prefix-cache hits of the routing decisions taken."""
        self.canary: Canary | None = None
        """The policy canary running (`start_canary`; None: every request is decided by the active policies)."""

    def use_decisions(self, log: DecisionLog | None) -> None:
        """Record decisions into `log` from now on (core/decision_records.py; None: stop recording)."""
        self.decisions = log if log is not None and log.enabled else None

    @staticmethod
    def _shadow_label(name: str, params: dict[str, Any]) -> str:
        if not params:
            return name
        return name + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"

    def _build(self, kind: PolicyKind, name: str, params: dict[str, Any] | None) -> Any:
        if registry.spec(kind, name).sim_only and not self.true_lengths:
            raise PolicyError(
                f"{name} knows every request's true output length, so it runs only in the simulator (sim, runs whatif)"
            )
        return registry.build(kind, name, params)

    def set_policy(
        self,
        kind: PolicyKind | str,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        source: str = "api",
        now: float = 0.0,
    ) -> PolicyEvent:
        """Hot swap: build and validate the new policy first, then replace one reference.

        Routed requests keep their bindings (and the policy that binds them late). A new queue
        policy receives the held requests in the old one's release order, with their original
        queueing times, before the old one is closed; none is shed by a smaller max_queued.
        A new periodic policy is first called one period after the swap.
        """
        k = PolicyKind(kind) if kind in set(PolicyKind) else None
        if k is None:
            raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(PolicyKind)}")
        new = self._build(k, name, params)
        old = self.policies.get(k)
        if k == PolicyKind.QUEUE and old is not None:
            self.admission.hand_over(old, new)
        self.policies[k] = new
        if k in PERIODIC_KINDS:
            self.runner.schedule(k, new, now)
            if k == PolicyKind.SCALING:
                self._signals_at = (now, self.admission.arrivals, self.completions)
                self._refused_at = dict(self.gate.refused) if self.gate is not None else {}
        if old is not None:
            old.close()
        event = PolicyEvent(now, k, getattr(old, "name", None), name, new.params.model_dump(), source)
        self.policy_events.append(event)
        return event

    def start_canary(
        self,
        kind: PolicyKind | str,
        name: str,
        params: dict[str, Any] | None,
        in_canary: Callable[[Request], bool],
        label: str = "canary",
    ) -> Canary:
        """Decide the requests `in_canary` says are in the canary arm (asked once per request, when it is
        routed) with the candidate `name`, built and validated as a swap builds it; the active policy
        decides the rest. A kind that cannot be split, or a second canary, is a PolicyError."""
        k = PolicyKind(kind) if kind in set(PolicyKind) else None
        if k not in SPLIT_KINDS:
            can = ", ".join(s.value for s in SPLIT_KINDS)
            raise PolicyError(
                f"a {kind} policy cannot be canaried: it acts on every request at once (canaries split {can})"
            )
        if self.canary is not None:
            raise PolicyError(f"a canary of {self.canary.kind} policy {self.canary.name} is already running")
        self.canary = Canary(k, self._build(k, name, params), in_canary, label)
        return self.canary

    def stop_canary(self) -> Canary | None:
        """End the canary: new requests are all decided by the active policies. Requests already routed
        under the candidate keep it (it binds them late and chooses their rank), as after a swap."""
        canary, self.canary = self.canary, None
        return canary

    def active_policies(self) -> dict[str, dict[str, Any]]:
        """Name and params of the active policy of every kind."""
        return {k.value: {"name": p.name, "params": p.params.model_dump()} for k, p in self.policies.items()}

    # --- the prefix cache (core/dispatch/prefix.py) ----------------------------------------------
    def use_prefix_lookup(self, lookup: PrefixLookup, block_size: int, decode_only: bool = True) -> None:
        """Exact: routing reads the world's own caches (the simulator's pools)."""
        self.prefix.exact(lookup, block_size, decode_only)

    def use_prefix_routes(
        self,
        block_size: int,
        ttl_s: float | None = APPROXIMATE_TTL_S,
        capacity_blocks: int | None = None,
        decode_only: bool = False,
    ) -> None:
        """Approximate: what was routed to an instance counts as cached there (PrefixTracker.approximate);
        `decode_only`: the console can serve a request on a decode instance alone."""
        self.prefix.approximate(block_size, ttl_s, capacity_blocks, decode_only)

    def use_prefix_events(self, block_size: int, decode_only: bool = False) -> None:
        """Precise: each instance's cache comes from its KV events, given to `apply_kv_events`."""
        self.prefix.precise(block_size, decode_only)

    def apply_kv_events(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """KV events of one instance, keys already ours, in its order (precise source only)."""
        self.prefix.apply(instance_id, events)

    def clear_prefix_cache(self, instance_id: str) -> None:
        """Forget what an instance caches: it reset its cache, restarted, lost events or left."""
        self.prefix.clear(instance_id)

    # --- the periodic decision point ------------------------------------------------------------
    def next_periodic_at(self) -> float:
        """When `periodic` next has something to call (inf when every periodic policy is a no-op)."""
        return self.runner.next_at()

    def start_periodic(self, now: float) -> None:
        """Anchor every periodic cadence (and the arrival-rate window) at `now`.

        The constructor anchors them at 0, which is right for the simulator; a live caller whose
        clock is time.monotonic() calls this once when traffic starts.
        """
        for kind in PERIODIC_KINDS:
            self.runner.schedule(kind, self.policies[kind], now)
        self._signals_at = (now, self.admission.arrivals, self.completions)
        self._refused_at = dict(self.gate.refused) if self.gate is not None else {}

    def periodic(self, now: float) -> PeriodicDecisions:
        """Call the reschedule and scaling policies that are due; the caller executes the result."""
        self.view.now = now
        out = self.runner.run(now, self.view, self.policies, lambda: self.scaling_signals(now))
        log = self.decisions
        if log is not None and out:
            log.add(periodic_records("scale", self.scaling.name, now, out.scale))
            log.add(periodic_records("reschedule", self.reschedule.name, now, out.migrations))
        return out

    def scaling_signals(self, now: float) -> ScalingSignals:
        """The signals a scaling policy sees; the arrival-rate window restarts at each call."""
        v = self.view
        v.now = now
        t0, n0, c0 = self._signals_at
        window = now - t0
        arrivals = self.admission.arrivals
        rate = (arrivals - n0) / window if window > 0 else 0.0
        done = (self.completions - c0) / window if window > 0 else 0.0
        self._signals_at = (now, arrivals, self.completions)
        refused = dict(self.gate.refused) if self.gate is not None else {}
        refused_rate = {
            role: (n - self._refused_at.get(role, 0)) / window if window > 0 else 0.0 for role, n in refused.items()
        }
        self._refused_at = refused
        held = self.admission.held_since
        waits = (
            [(now - held.get(r.id, now)) / (r.ttft_s or self.view.slo["default"].ttft_s) for r in self.queue.items()]
            if held
            else []
        )
        return compute_signals(
            v,
            queue_len=len(self.admission),
            oldest_wait_s=self.admission.oldest_wait(now),
            arrival_rate=rate,
            window_s=max(window, 0.0),
            completion_rate=done,
            queued_wait_ratios=np.asarray(waits, dtype=float),
            slo=self.slo_window.role_slo(now),
            refused_rate=refused_rate,
        )

    # --- summaries ------------------------------------------------------------------------------
    def assignment_ratios(self) -> dict[str, float]:
        """The optimal-assignment ratio of the decisions taken and of each shadow policy."""
        out = {"active": self.score.ratio}
        out.update({label: s.ratio for label, s in self.scores.items()})
        return out

    def projected_loads(self) -> dict[str, float]:
        """Load per instance as the active routing policy sees it (for dashboards)."""
        v = self.view
        loads = self.routing.display_load(v)
        return {iid: float(loads[i]) for i, iid in enumerate(v.instance_ids)}
