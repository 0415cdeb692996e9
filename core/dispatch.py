"""The dispatcher: request table, estimators, the active policy of each kind, hot swap, shadow scoring.

It is pure: callers tell it the time and the events (routed, prefill started/ended, decode
started, progress, finished, failed, instance observed) and it answers decisions. The simulator
feeds it virtual time; the live gateway feeds it time.monotonic().
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import NoCapacityError, PolicyError
from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from core.perf import PerfProfile
from core.policies import registry
from core.policies.base import RoutingPolicy
from core.request_table import PENDING, RUNNING, RequestTable
from core.types import Assignment, InstanceState, PolicyEvent, PolicyKind, Request, Role
from core.view import ClusterView


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

    prefill_est: float
    shadow_choices: list[int] = field(default_factory=list)


class Dispatcher:
    """One request table, the estimators and the active policies; one instance per cluster."""

    def __init__(
        self,
        profile: PerfProfile,
        routing: str = "round_robin",
        routing_params: dict[str, Any] | None = None,
        *,
        shadow: Sequence[tuple[str, dict[str, Any]]] = (),
        survival_delta: int = 64,
        survival_alpha: float = 0.99,
        survival_prior_max: int | None = None,
        decode_rate_prior: float | None = None,
        ratio_load: str = "requests",
    ) -> None:
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
        self._index: dict[str, int] = {}
        self._tracked: dict[Hashable, _Tracked] = {}
        self.policies: dict[PolicyKind, Any] = {
            PolicyKind.ROUTING: registry.build(PolicyKind.ROUTING, routing, routing_params)
        }
        self.policy_events: list[PolicyEvent] = [
            PolicyEvent(
                0.0, PolicyKind.ROUTING, None, routing, dict(routing_params or {}), "config"
            )
        ]
        self.shadows: list[tuple[str, RoutingPolicy]] = [
            (self._shadow_label(n, p), registry.build(PolicyKind.ROUTING, n, p)) for n, p in shadow
        ]
        self.scores: dict[str, AssignmentScore] = {
            label: AssignmentScore() for label, _ in self.shadows
        }
        if ratio_load not in ("requests", "tokens"):
            raise ValueError("ratio_load must be 'requests' or 'tokens'")
        self.ratio_load = ratio_load
        """Load measure for the optimal-assignment ratio: running requests (ties count) or KV tokens."""
        self.score = AssignmentScore()
        """Optimal-assignment score of the decisions actually taken (whatever policy took them)."""

    @staticmethod
    def _shadow_label(name: str, params: dict[str, Any]) -> str:
        if not params:
            return name
        return name + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"

    # --- instances -------------------------------------------------------------------------
    @property
    def routing(self) -> RoutingPolicy:
        policy: RoutingPolicy = self.policies[PolicyKind.ROUTING]
        return policy

    @property
    def needs_progress(self) -> bool:
        """Whether any active or shadow policy reads per-request progress."""
        return bool(self.routing.needs_progress or any(p.needs_progress for _, p in self.shadows))

    def add_instance(self, instance_id: str, role: Role, healthy: bool = True) -> int:
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
        v.present = np.append(v.present, True)
        v.prefill_free_at = np.append(v.prefill_free_at, 0.0)
        v.running_n = np.append(v.running_n, 0)
        v.pending_n = np.append(v.pending_n, 0)
        v.invalidate()
        return i

    def remove_instance(self, instance_id: str) -> None:
        self.view.present[self._index[instance_id]] = False
        self.view.invalidate()

    def set_role(self, instance_id: str, role: Role) -> None:
        v, i = self.view, self._index[instance_id]
        v.roles[i] = role
        v.serves_prefill[i] = role.serves_prefill()
        v.serves_decode[i] = role.serves_decode()
        v.invalidate()

    def set_health(self, instance_id: str, healthy: bool) -> bool:
        """Mark an instance up or down; returns whether that changed anything."""
        i = self._index[instance_id]
        changed = bool(self.view.healthy[i]) != healthy
        self.view.healthy[i] = healthy
        self.view.invalidate()
        return changed

    def observe_instance(self, state: InstanceState) -> None:
        self.view.observed[str(state.id)] = state

    def index_of(self, instance_id: str) -> int:
        return self._index[instance_id]

    # --- policies ---------------------------------------------------------------------------
    def set_policy(
        self,
        kind: PolicyKind | str,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        source: str = "api",
        now: float = 0.0,
    ) -> PolicyEvent:
        """Hot swap: build and validate the new policy first, then replace one reference."""
        k = PolicyKind(kind) if kind in set(PolicyKind) else None
        if k is None:
            raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(PolicyKind)}")
        new = registry.build(k, name, params)
        old = self.policies.get(k)
        self.policies[k] = new
        if old is not None:
            old.close()
        event = PolicyEvent(
            now, k, getattr(old, "name", None), name, new.params.model_dump(), source
        )
        self.policy_events.append(event)
        return event

    def active_policies(self) -> dict[str, dict[str, Any]]:
        return {
            k.value: {"name": p.name, "params": p.params.model_dump()}
            for k, p in self.policies.items()
        }

    # --- request lifecycle ------------------------------------------------------------------
    def route(self, request: Request, now: float) -> Assignment:
        """Choose prefill and decode instances for a new request and start tracking it."""
        v = self.view
        v.now = now
        a = self.routing.route(request, v)
        p = self._index[a.prefill]
        est = float(v.prefill_time(request.prompt_tokens))
        v.prefill_free_at[p] = max(v.prefill_free_at[p], now) + est
        t = v.table
        i = t.add(request.id)
        t.prefill[i] = p
        t.l_in[i] = request.prompt_tokens
        t.max_out[i] = request.max_tokens
        t.arrival[i] = request.arrival
        t.tau[i] = a.projected_handoff or now + est
        if a.decode is not None:
            d = t.inst[i] = self._index[a.decode]
            v.pending_n[d] += 1
        tracked = _Tracked(est)
        for _, shadow in self.shadows:
            try:
                choice = shadow.route(request, v).decode
            except NoCapacityError:
                choice = None
            tracked.shadow_choices.append(self._index[choice] if choice is not None else -1)
        self._tracked[request.id] = tracked
        return a

    def on_prefill_start(self, rid: Hashable, now: float) -> None:
        t = self.view.table
        i = t.row[rid]
        t.tau[i] = (
            now + self._tracked[rid].prefill_est + self.view.profile.kv_transfer_time(t.l_in[i])
        )

    def on_prefill_end(self, rid: Hashable, now: float, seconds: float | None = None) -> None:
        """Prefill finished (KV transfer may follow); `seconds` is the measured prefill duration."""
        v = self.view
        t = v.table
        i = t.row[rid]
        p = int(t.prefill[i])
        tracked = self._tracked[rid]
        # Settle the projection: this request's estimate leaves the instance's backlog.
        v.prefill_free_at[p] = max(now, v.prefill_free_at[p] - tracked.prefill_est)
        if seconds is not None and seconds > 0:
            v.prefill_time.observe(t.l_in[i], seconds)
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
        est = self._tracked[rid].prefill_est
        old = int(t.prefill[i])
        v.prefill_free_at[old] = max(now, v.prefill_free_at[old] - est)
        start = np.where(mask, np.maximum(v.prefill_free_at, now), np.inf)
        p = int(np.argmin(start))
        v.prefill_free_at[p] = start[p] + est
        t.prefill[i] = p
        return v.instance_ids[p]

    def bind_decode(self, rid: Hashable, instance_id: str) -> None:
        """Bind a request to a decode instance (policies that choose at prefill end)."""
        t = self.view.table
        d = t.inst[t.row[rid]] = self._index[instance_id]
        self.view.pending_n[d] += 1

    def on_decode_start(self, rid: Hashable, now: float) -> None:
        """The handoff: decoding starts. Scores the routing against the real state right now."""
        v = self.view
        v.now = now
        t = v.table
        i = t.row[rid]
        d = int(t.inst[i])
        if d >= 0:
            self._score_handoff(d, self._tracked[rid].shadow_choices)
            v.pending_n[d] -= 1
            v.running_n[d] += 1
        t.state[i] = RUNNING
        t.decode_start[i] = now
        t.t_obs[i] = now
        t.l_obs[i] = 0.0
        t.v[i] = v.decode_rate.value

    def _score_handoff(self, chosen: int, shadow_choices: list[int]) -> None:
        v = self.view
        mask = v.decode_mask()
        if not mask.any():
            return
        load = v.running_counts() if self.ratio_load == "requests" else v.physical_load()
        best = load[mask].min() + 1e-6

        def hit(j: int) -> bool:
            return j >= 0 and bool(mask[j]) and bool(load[j] <= best)

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

    def on_finish(self, rid: Hashable, now: float, output_tokens: int) -> None:
        v = self.view
        t = v.table
        i = t.row[rid]
        if t.state[i] == RUNNING:
            v.decode_rate.observe(output_tokens, now - t.decode_start[i])
        v.survival.observe(output_tokens)
        self._forget(rid)

    def on_fail(self, rid: Hashable, now: float) -> None:
        """A request failed: stop tracking it (no estimator learns from it)."""
        if rid in self.view.table:
            t = self.view.table
            i = t.row[rid]
            if t.state[i] == PENDING:
                p = int(t.prefill[i])
                self.view.prefill_free_at[p] = max(
                    now, self.view.prefill_free_at[p] - self._tracked[rid].prefill_est
                )
            self._forget(rid)

    def _forget(self, rid: Hashable) -> None:
        v = self.view
        t = v.table
        i = t.row[rid]
        d = t.inst[i]
        if d >= 0:
            counts = v.running_n if t.state[i] == RUNNING else v.pending_n
            counts[d] -= 1
        t.remove(rid)
        self._tracked.pop(rid, None)

    # --- summaries ---------------------------------------------------------------------------
    def assignment_ratios(self) -> dict[str, float]:
        """The optimal-assignment ratio of the decisions taken and of each shadow policy."""
        out = {"active": self.score.ratio}
        out.update({label: s.ratio for label, s in self.scores.items()})
        return out

    def projected_loads(self) -> dict[str, float]:
        """Load per instance as the active routing policy sees it (for dashboards)."""
        v = self.view
        policy = self.routing
        if hasattr(policy, "projected_load"):
            loads = policy.projected_load(v.now, v)
        elif hasattr(policy, "load"):
            loads = policy.load(v)
        else:
            loads = (v.running_counts() + v.pending_counts()).astype(float)
        return {iid: float(loads[i]) for i, iid in enumerate(v.instance_ids)}
