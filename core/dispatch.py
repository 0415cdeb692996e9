"""The dispatcher: request table, estimators, the active policy of each kind, admission, hot swap.

It is pure: callers tell it the time and the events (arrived, routed, prefill started/ended,
decode started, progress, finished, failed, instance added/drained/observed) and it answers
decisions (admit or hold or shed, which instances, which periodic actions). The simulator feeds
it virtual time; the live gateway feeds it time.monotonic(). Both drive the same methods.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.admission import AdmissionControl, SloAdmission, SloGate
from core.cache.events import KVEvent
from core.cache.index import PrefixLookup
from core.cache.tracker import PrefixTracker
from core.errors import NoCapacityError, PolicyError
from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from core.perf import PerfProfile
from core.periodic import PERIODIC_KINDS, PeriodicRunner, ScalingSignals, SloWindow, compute_signals
from core.policies import registry
from core.policies.base import QueuePolicy, ReschedulePolicy, RoutingPolicy, ScalingPolicy
from core.policies.rank import RankPolicyBase, dp_state
from core.predict.survival import SurvivalPredictor
from core.request_table import RUNNING, RequestTable
from core.sim.dp.model import DPState
from core.slo import SLOClass
from core.types import (
    Admission,
    Assignment,
    InstancePhase,
    InstanceState,
    PeriodicDecisions,
    PolicyEvent,
    PolicyKind,
    Request,
    Role,
)
from core.view import ClusterView, phase_code

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
    prefill_due: float
    shift_base: float = 0.0
    """Its prefill instance's cumulative projection shift when `prefill_due` was set (see _end_prefill)."""
    """When its prefill was projected to end on its prefill instance (FIFO behind the backlog)."""
    in_prefill: bool = True
    """Routed and its prefill has not ended (counted in view.prefill_n)."""
    computed: int = 0
    """Prompt tokens its prefill computes (the uncached part on its prefill instance, as routed)."""
    routed_at: float = 0.0
    shadow_choices: list[int] = field(default_factory=list)


class Dispatcher:
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
        prior_rate = decode_rate_prior or profile.per_request_rate(
            max(1, profile.max_num_seqs // 4)
        )
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
        self._prefill_shift: defaultdict[int, float] = defaultdict(float)
        """Per prefill instance index: the sum of the shifts its projection took as prefills ended
        early or late (a queued request's due moves with every shift after it was queued)."""
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
            self.policy_events.append(
                PolicyEvent(0.0, kind, None, name, policy.params.model_dump(), "config")
            )
        self.shadows: list[tuple[str, RoutingPolicy]] = [
            (self._shadow_label(n, p), self._build(PolicyKind.ROUTING, n, p)) for n, p in shadow
        ]
        self.scores: dict[str, AssignmentScore] = {
            label: AssignmentScore() for label, _ in self.shadows
        }
        self.ratio_load = ratio_load
        """Load measure for the optimal-assignment ratio: running requests (ties count) or KV tokens."""
        self.score = AssignmentScore()
        """Optimal-assignment score of the decisions actually taken (whatever policy took them)."""

    @staticmethod
    def _shadow_label(name: str, params: dict[str, Any]) -> str:
        if not params:
            return name
        return name + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"

    def _build(self, kind: PolicyKind, name: str, params: dict[str, Any] | None) -> Any:
        if registry.spec(kind, name).sim_only and not self.true_lengths:
            raise PolicyError(
                f"{name} knows every request's true output length, so it runs only in the "
                "simulator (sim, runs whatif)"
            )
        return registry.build(kind, name, params)

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
        return bool(self.routing.needs_progress or any(p.needs_progress for _, p in self.shadows))

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
        event = PolicyEvent(
            now, k, getattr(old, "name", None), name, new.params.model_dump(), source
        )
        self.policy_events.append(event)
        return event

    def active_policies(self) -> dict[str, dict[str, Any]]:
        """Name and params of the active policy of every kind."""
        return {
            k.value: {"name": p.name, "params": p.params.model_dump()}
            for k, p in self.policies.items()
        }

    # --- the prefix cache (core/cache/tracker.py) ----------------------------------------------
    def use_prefix_lookup(self, lookup: PrefixLookup, block_size: int, decode_only: bool = True) -> None:
        """Exact: routing reads the world's own caches (the simulator's pools)."""
        self.prefix.exact(lookup, block_size, decode_only)

    def use_prefix_routes(
        self, block_size: int, ttl_s: float | None = 300.0, capacity_blocks: int | None = None, decode_only: bool = False,
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

    # --- instances ------------------------------------------------------------------------------
    def add_instance(
        self,
        instance_id: str,
        role: Role,
        healthy: bool = True,
        *,
        phase: InstancePhase = InstancePhase.ACTIVE,
    ) -> int:
        """Start tracking an instance (STARTING while it loads, then set_phase ACTIVE); its index."""
        v = self.view
        if instance_id in self._index:
            raise ValueError(f"instance {instance_id!r} already exists")
        i = len(v.instance_ids)
        self._index[instance_id] = i
        v.instance_ids.append(instance_id)
        v.roles.append(role)
        v.serves_prefill = np.append(v.serves_prefill, role.serves_prefill())
        v.serves_decode = np.append(v.serves_decode, role.serves_decode())
        v.healthy = np.append(v.healthy, healthy)
        v.phase = np.append(v.phase, np.int8(phase_code(phase)))
        v.prefill_free_at = np.append(v.prefill_free_at, 0.0)
        v.kv_usage = np.append(v.kv_usage, np.nan)
        v.waiting_obs = np.append(v.waiting_obs, 0)
        v.running_n = np.append(v.running_n, 0)
        v.pending_n = np.append(v.pending_n, 0)
        v.prefill_n = np.append(v.prefill_n, 0)
        v.invalidate()
        return i

    def set_data_parallel(self, instance_id: str, ranks: int, slots: int = 0) -> None:
        """The instance is a data-parallel group of `ranks` ranks (1: not a group) with `slots`
        running slots each (the profile's max_num_seqs if 0); the rank policy places requests."""
        i = self._index[instance_id]
        if ranks > 1:
            self._dp_groups[i] = (ranks, slots or self.view.profile.max_num_seqs)
        else:
            self._dp_groups.pop(i, None)

    def choose_rank(self, rid: Hashable, now: float) -> int | None:
        """The rank a request about to decode on a data-parallel group runs on (the rank policy's
        choice, kept in the table); None when its instance is not a group or the policy leaves
        the choice to the group."""
        v = self.view
        t = v.table
        i = t.row[rid]
        group = self._dp_groups.get(int(t.inst[i]))
        policy = self.rank
        if group is None or not policy.acts:
            return None
        rank = policy.choose(self.dp_state(int(t.inst[i]), now, exclude=i), int(t.l_in[i]))
        t.rank[i] = -1 if rank is None else rank
        return rank

    def dp_state(self, index: int, now: float, exclude: int = -1) -> DPState:
        """What each rank of group `index` holds: the tracked requests sent to a rank there (their
        prompt plus tokens generated so far; predicted remaining steps when the policy looks ahead)."""
        ranks, slots = self._dp_groups[index]
        t = self.view.table
        n = t.n
        rows = np.flatnonzero((t.inst[:n] == index) & (t.rank[:n] >= 0))
        rows = rows[rows != exclude]
        running = t.state[rows] == RUNNING
        generated = np.where(running, t.generated_at(now, rows), 0.0)
        size = (t.l_in[rows] + generated).astype(np.int64)
        remaining = None
        if self.rank.needs_requests and len(rows):
            remaining = np.maximum(SurvivalPredictor(self.view.survival).remaining(generated), 1.0).astype(np.int64)
        return dp_state(ranks, slots, t.rank[rows], size, remaining)

    def rank_loads(self, instance_id: str, now: float) -> list[int] | None:
        """Resident KV tokens per rank of a data-parallel group, from the requests the rank policy
        placed there; None when it is not a group or the group chooses ranks itself."""
        i = self._index[instance_id]
        if i not in self._dp_groups or not self.rank.acts:
            return None  # under `engine` the group places requests itself: the gateway does not know where
        return [int(x) for x in self.dp_state(i, now).loads]

    def set_phase(self, instance_id: str, phase: InstancePhase) -> None:
        """Move an instance to `phase`; only ACTIVE (and healthy) instances are routable."""
        self.view.phase[self._index[instance_id]] = phase_code(phase)
        self.view.invalidate()

    def begin_drain(self, instance_id: str) -> None:
        """Route nothing new to the instance; what it holds finishes (see in_flight)."""
        self.set_phase(instance_id, InstancePhase.DRAINING)

    def remove_instance(self, instance_id: str) -> None:
        """The instance is gone (STOPPED): not routable; its index stays reserved."""
        self.set_phase(instance_id, InstancePhase.STOPPED)

    def flip_role(self, instance_id: str, role: Role) -> None:
        """The instance serves `role` from now on (callers drain its old work first)."""
        v, i = self.view, self._index[instance_id]
        v.roles[i] = role
        v.serves_prefill[i] = role.serves_prefill()
        v.serves_decode[i] = role.serves_decode()
        v.invalidate()

    def phase_of(self, instance_id: str) -> InstancePhase:
        return self.view.phase_of(self._index[instance_id])

    def role_of(self, instance_id: str) -> Role:
        return self.view.roles[self._index[instance_id]]

    def in_flight(self, instance_id: str) -> int:
        """Requests in prefill on the instance plus those pending or running on it as decode."""
        v, i = self.view, self._index[instance_id]
        return int(v.prefill_n[i] + v.pending_n[i] + v.running_n[i])

    def set_health(self, instance_id: str, healthy: bool) -> bool:
        """Mark an instance up or down; returns whether that changed anything."""
        i = self._index[instance_id]
        changed = bool(self.view.healthy[i]) != healthy
        self.view.healthy[i] = healthy
        self.view.invalidate()
        return changed

    def observe_instance(self, state: InstanceState) -> None:
        """Record polled KV usage and engine-side waiting requests (unknown ids are ignored)."""
        i = self._index.get(str(state.id))
        if i is None:
            return
        self.view.kv_usage[i] = state.kv_usage
        self.view.waiting_obs[i] = state.waiting

    def index_of(self, instance_id: str) -> int:
        return self._index[instance_id]

    # --- admission (the queue policy) -----------------------------------------------------------
    def use_slo_admission(self, settings: SloAdmission) -> SloGate:
        """Hold and shed by the SLO from now on (core.admission.SloAdmission says how)."""
        self.gate = SloGate(settings, self.view.profile, self.view.slo)
        return self.gate

    def retry_after_s(self, now: float) -> float | None:
        """What a refused client is told to wait, when SLO admission is on (else None)."""
        if self.gate is None:
            return None
        self.view.now = now
        return self.gate.retry_after_s(self.view, now, len(self.admission))

    def _room(self) -> int:
        """Requests that may still enter: max_in_flight_per_instance × routable decode − tracked;
        none while every prefill instance has more than max_prefill_backlog_s of work (if set)."""
        params = self.queue.params
        v = self.view
        room = params.max_in_flight_per_instance * v.routable_count(Role.DECODE) - v.table.n
        if params.max_prefill_backlog_s is not None and room > 0:
            # one request per prefill instance under the limit: each release is routed (and
            # lengthens a backlog) before the next decision
            mask = v.prefill_mask()
            if mask.any():
                room = min(room, int(np.count_nonzero(v.prefill_free_at[mask] - v.now <= params.max_prefill_backlog_s)))
        if self.gate is not None and room > 0:
            room = min(room, self.gate.decode_room(v))
        return room

    @property
    def arrivals_total(self) -> int:
        """Requests seen by admit (routed, queued or shed)."""
        return self.admission.arrivals

    def admit(self, request: Request, now: float) -> Admission:
        """ROUTE if there is room and nothing is held; else hold it (QUEUED) or, if full, SHED.

        Room: tracked requests < max_in_flight_per_instance × routable decode instances. With no
        routable instance of a role it answers ROUTE, so `route` fails at once with
        NoCapacityError instead of holding a request nothing could release. The caller routes
        (calls `route`) only on ROUTE; a QUEUED request comes back from `release`
        or `expire`, or leaves through `cancel`.
        """
        adm = self.admission
        v = self.view
        v.now = now
        gate = self.gate
        if gate is not None:
            gate.observe(request)
        if not adm.held_since and self._room() > 0 and (gate is None or gate.fits_now(request, v, now)):
            adm.arrivals += 1  # the common case, without the policy
            return Admission.ROUTE
        if not v.routable_count(Role.DECODE) or not v.routable_count(Role.PREFILL):
            adm.arrivals += 1  # nothing could ever release it: route, and `route` says what is missing
            return Admission.ROUTE
        self.set_targets(request)
        self.shed_reason = f"the gateway queue is full ({len(adm)} requests held); retry later"
        if gate is None:
            return adm.admit(self.queue, request, now, self._room())
        decision, why = gate.hold_or_shed(adm, self.queue, request, v, now)
        self.shed_reason = why or self.shed_reason
        return decision

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

    def release(self, now: float) -> list[Request]:
        """Held requests to route now, in the queue policy's order, while there is room.

        Call after a request finishes or fails, after instances become active, and periodically.
        """
        if not self.admission:
            return []
        v = self.view
        v.now = now
        if self.gate is None:
            return self.admission.release(self.queue, now, self._room())
        return self.gate.release(self.admission, self.queue, v, now, self._room())

    def expire(self, now: float) -> list[Request]:
        """Held requests queued ttl_s ago or earlier, or (SLO admission) that could no longer start
        within their wait bound, removed from the queue; the caller fails them."""
        out = self.admission.expire(self.queue, now)
        return out if self.gate is None else self.gate.expire(self.admission, self.queue, self.view, now, out)

    def next_expiry_at(self) -> float:
        """When the oldest held request expires (inf when none is held)."""
        return self.admission.next_expiry_at(self.queue)

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a held request (its client went away); False if it was not held."""
        gone = self.admission.cancel(self.queue, request_id)
        if self.gate is not None and not self.admission:
            self.gate.held_work_s = 0.0
        return gone

    def queue_depth(self) -> int:
        """Requests held by admission."""
        return len(self.admission)

    def queue_depth_by_class(self) -> dict[str, int]:
        """Held requests per priority band or SLO class (as the queue policy classifies them)."""
        return self.queue.depth_by_class()

    # --- request lifecycle ----------------------------------------------------------------------
    def route(self, request: Request, now: float) -> Assignment:
        """Choose prefill (and, unless bound late, decode) instances; start tracking the request."""
        v = self.view
        v.now = now
        if request.tpot_s is None or request.ttft_s is None:
            self.set_targets(request)
        router = self.routing
        try:
            a = router.route(request, v)
            if a.prefill is None:
                if a.decode is None:
                    raise ValueError(f"{router.name}: a decode-only assignment needs a decode instance")
                p = -1
                computed = request.prompt_tokens - int(v.cached_tokens(request)[self._index[a.decode]])
                est = 0.0
                due = now
            else:
                p = self._index[a.prefill]
                computed = request.prompt_tokens - int(v.cached_tokens(request)[p])
                est = float(v.prefill_time(computed))
                due = v.prefill_free_at[p] = max(v.prefill_free_at[p], now) + est
                v.prefill_n[p] += 1
        finally:
            v.forget_cached()
        self.prefix.routed((a.prefill, a.decode), request.prefix_keys, now)
        t = v.table
        i = t.add(request.id)
        t.prefill[i] = p
        t.l_in[i] = request.prompt_tokens
        t.max_out[i] = request.max_tokens
        t.arrival[i] = request.arrival
        t.ttft_slo[i] = request.ttft_s
        t.tpot_slo[i] = request.tpot_s
        t.tau[i] = a.projected_handoff or now + est
        if a.decode is not None:
            d = t.inst[i] = self._index[a.decode]
            v.pending_n[d] += 1
        tracked = _Tracked(request, router, est, float(due), in_prefill=p >= 0, routed_at=now, computed=computed,
                           shift_base=self._prefill_shift[p] if p >= 0 else 0.0)
        for _, shadow in self.shadows:
            try:
                choice = shadow.route(request, v).decode
            except NoCapacityError:
                choice = None
            tracked.shadow_choices.append(self._index[choice] if choice is not None else -1)
        self._tracked[request.id] = tracked
        return a

    def bind_late(self, request_id: Hashable, now: float) -> str:
        """Choose the decode instance of a request routed without one (call at prefill end).

        Asked of the policy that routed the request, even if another is active now.
        Raises NoCapacityError when no decode instance is routable.
        """
        v = self.view
        v.now = now
        t = v.table
        i = t.row[request_id]
        if t.inst[i] >= 0:
            raise ValueError(f"request {request_id!r} is already bound to a decode instance")
        tracked = self._tracked[request_id]
        try:
            d = tracked.router.choose_decode(tracked.request, v)
        finally:
            v.forget_cached()
        t.inst[i] = d
        v.pending_n[d] += 1
        self.prefix.routed((v.instance_ids[d],), tracked.request.prefix_keys, now)
        return v.instance_ids[d]

    def decode_of(self, request_id: Hashable) -> str | None:
        """The decode instance a tracked request is bound to, if any."""
        t = self.view.table
        d = int(t.inst[t.row[request_id]])
        return self.view.instance_ids[d] if d >= 0 else None

    def on_prefill_start(self, rid: Hashable, now: float) -> None:
        t = self.view.table
        i = t.row[rid]
        t.tau[i] = (
            now + self._tracked[rid].prefill_est + self.view.profile.kv_transfer_time(t.l_in[i])
        )

    def _end_prefill(self, tracked: _Tracked, p: int, now: float, completed: bool = True) -> None:
        """Settle the projection. The instance's free-at time already has this request's work in
        it: a prefill that ends shifts it by how late (or early) it ended against its projected
        end; one that leaves unfinished takes what was left of its work out."""
        v = self.view
        if tracked.in_prefill:
            tracked.in_prefill = False
            v.prefill_n[p] -= 1
            # its due as projected now: the shifts settled since it was queued moved it too (without
            # this, every request queued behind a late one would add that lateness again)
            due = tracked.prefill_due + self._prefill_shift[p] - tracked.shift_base
            shift = now - due if completed else -min(tracked.prefill_est, max(due - now, 0.0))
            self._prefill_shift[p] += shift
            v.prefill_free_at[p] = max(now, v.prefill_free_at[p] + shift)

    def on_prefill_end(self, rid: Hashable, now: float, seconds: float | None = None) -> None:
        """Prefill finished (KV transfer may follow); `seconds` is the measured prefill duration."""
        v = self.view
        t = v.table
        i = t.row[rid]
        tracked = self._tracked[rid]
        self._end_prefill(tracked, int(t.prefill[i]), now)
        if seconds is not None and seconds > 0:
            v.prefill_time.observe(tracked.computed, seconds)
        t.tau[i] = now + v.profile.kv_transfer_time(t.l_in[i])

    def retry_prefill(self, rid: Hashable, tried: Sequence[str], now: float) -> str | None:
        """Move a request whose prefill failed to the least-queued healthy prefill instance not tried."""
        v = self.view
        t = v.table
        i = t.row[rid]
        mask = v.prefill_mask().copy()
        for iid in tried:
            mask[self._index[iid]] = False
        if not mask.any():
            return None
        tracked = self._tracked[rid]
        est = tracked.prefill_est
        old = int(t.prefill[i])
        self._end_prefill(tracked, old, now, completed=False)
        start = np.where(mask, np.maximum(v.prefill_free_at, now), np.inf)
        p = int(np.argmin(start))
        v.prefill_free_at[p] = start[p] + est
        tracked.prefill_due = float(v.prefill_free_at[p])
        tracked.shift_base = self._prefill_shift[p]
        v.prefill_n[p] += 1
        tracked.in_prefill = True
        t.prefill[i] = p
        return v.instance_ids[p]

    def retry_decode(self, rid: Hashable, tried: Sequence[str], now: float) -> str | None:
        """Rebind a request whose decode instance could not be reached (nothing streamed yet) to the
        routable decode instance not tried with the fewest requests on it; None if there is none."""
        v = self.view
        mask = v.decode_mask().copy()
        for iid in tried:
            mask[self._index[iid]] = False
        if not mask.any():
            return None
        load = np.where(mask, v.running_n + v.pending_n, np.iinfo(np.int64).max)
        target = v.instance_ids[int(np.argmin(load))]
        self._rebind(rid, target)
        return target

    def on_decode_start(self, rid: Hashable, now: float) -> None:
        """The handoff: decoding starts. Scores the routing against the real state right now."""
        v = self.view
        v.now = now
        t = v.table
        i = t.row[rid]
        tracked = self._tracked[rid]
        if tracked.in_prefill:  # the caller skipped on_prefill_end
            self._end_prefill(tracked, int(t.prefill[i]), now)
        d = int(t.inst[i])
        if d >= 0:
            self._score_handoff(d, tracked.shadow_choices)
            v.pending_n[d] -= 1
            v.running_n[d] += 1
        t.state[i] = RUNNING
        t.decode_start[i] = now
        t.t_obs[i] = now
        t.l_obs[i] = 0.0
        t.v[i] = v.decode_rate.value

    def _score_handoff(self, chosen: int, shadow_choices: list[int]) -> None:
        v = self.view
        if not v.routable_count(Role.DECODE):
            return
        mask = v.decode_mask()
        load = v.running_counts() if self.ratio_load == "requests" else v.physical_load()
        best = float(load[mask].min()) + 1e-6

        def hit(j: int) -> bool:
            return j >= 0 and bool(mask[j]) and float(load[j]) <= best

        self.score.total += 1
        self.score.hits += hit(chosen)
        for (label, _), j in zip(self.shadows, shadow_choices, strict=True):
            s = self.scores[label]
            s.total += 1
            s.hits += hit(j)

    def on_progress(self, rid: Hashable, generated: float, now: float) -> None:
        """`generated` output tokens so far for a decoding request (e.g. per streamed chunk)."""
        t = self.view.table
        i = t.row.get(rid)
        if i is None or t.state[i] != RUNNING:
            return
        dt = now - t.t_obs[i]
        if dt > 0:
            t.v[i] = (generated - t.l_obs[i]) / dt
        t.l_obs[i] = generated
        t.t_obs[i] = now

    def on_progress_bulk(self, rids: Iterable[Hashable], generated: np.ndarray, now: float) -> None:
        """Vectorised on_progress for many requests observed at the same moment."""
        t = self.view.table
        if len(generated) == 0:
            return
        rows = np.array([t.row[r] for r in rids], dtype=np.int64)
        dt = now - t.t_obs[rows]
        ok = dt > 0
        t.v[rows[ok]] = (generated[ok] - t.l_obs[rows[ok]]) / dt[ok]
        t.l_obs[rows] = generated
        t.t_obs[rows] = now

    def on_finish(self, rid: Hashable, now: float, output_tokens: int, first_token_at: float | None = None) -> None:
        """A request finished; `first_token_at` (when known) lets the routing policy learn its latencies."""
        v = self.view
        t = v.table
        i = t.row[rid]
        if t.state[i] == RUNNING:
            v.decode_rate.observe(output_tokens, now - t.decode_start[i])
        v.survival.observe(output_tokens)
        self.completions += 1
        tracked = self._tracked.get(rid)
        if tracked is not None:
            req = tracked.request
            self.queue.observe_completion(req, now - req.arrival, output_tokens)
            tpot: float | None = None
            if first_token_at is not None:
                tpot = (now - first_token_at) / (output_tokens - 1) if output_tokens > 1 else 0.0
                self.routing.observe_completion(req, first_token_at - req.arrival, tpot, tracked.routed_at - req.arrival)
            # a whole reply has no first-token time: its TTFT is taken at the handoff, its TPOT is unknown
            first = first_token_at if first_token_at is not None else (float(t.decode_start[i]) if t.state[i] == RUNNING else None)
            self.slo_window.add(now, None if first is None else first - req.arrival, float(t.ttft_slo[i]),
                                tpot if output_tokens > 1 else None, float(t.tpot_slo[i]))
        self._forget(rid, now)

    def on_fail(self, rid: Hashable, now: float) -> None:
        """A request failed: stop tracking it (no estimator learns from it)."""
        if rid in self.view.table:
            self._forget(rid, now)

    def on_migrated(self, rid: Hashable, target: str, now: float) -> None:
        """A request now decodes on `target` (its KV moved there); its progress carries over."""
        if self._rebind(rid, target):
            self.migrations += 1

    def _rebind(self, rid: Hashable, target: str) -> bool:
        """Move a tracked request's decode binding (and its count) to `target`; False if untracked."""
        v = self.view
        t = v.table
        i = t.row.get(rid)
        if i is None:
            return False
        old, new = int(t.inst[i]), self._index[target]
        counts = v.running_n if t.state[i] == RUNNING else v.pending_n
        if old >= 0:
            counts[old] -= 1
        counts[new] += 1
        t.inst[i] = new
        t.rank[i] = -1  # a rank belongs to the old instance; the new one's is chosen with its leg
        return True

    def _forget(self, rid: Hashable, now: float) -> None:
        v = self.view
        t = v.table
        i = t.row[rid]
        tracked = self._tracked.pop(rid, None)
        if tracked is not None and tracked.in_prefill:
            self._end_prefill(tracked, int(t.prefill[i]), now, completed=False)
        d = t.inst[i]
        if d >= 0:
            counts = v.running_n if t.state[i] == RUNNING else v.pending_n
            counts[d] -= 1
        t.remove(rid)

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
        return self.runner.run(now, self.view, self.policies, lambda: self.scaling_signals(now))

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
        refused_rate = {role: (n - self._refused_at.get(role, 0)) / window if window > 0 else 0.0 for role, n in refused.items()}
        self._refused_at = refused
        held = self.admission.held_since
        waits = [
            (now - held.get(r.id, now)) / (r.ttft_s or self.view.slo["default"].ttft_s)
            for r in self.queue.items()
        ] if held else []
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
