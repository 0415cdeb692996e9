"""The dispatcher's instances: add, phase, health, roles, data-parallel groups (core/dispatch/)."""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from core.decision_records import Record
from core.dispatch.base import DispatcherBase
from core.dispatch.recording import rank_record
from core.perf import PerfProfile
from core.policies.rank.state import DPState, dp_state
from core.predict.survival import SurvivalPredictor
from core.prefill import StepTerms
from core.request_table import RUNNING
from core.types import (
    InstancePhase,
    InstanceState,
    PolicyKind,
    Role,
)
from core.view import phase_code


class InstancesMixin(DispatcherBase):
    """Instances the dispatcher routes to."""

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
        v.queues.add_instance()
        v.prefill_free_at = v.queues.free_at
        v.kv_usage = np.append(v.kv_usage, np.nan)
        v.waiting_obs = np.append(v.waiting_obs, 0)
        v.waiting_obs_at = np.append(v.waiting_obs_at, np.inf)
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
        policy = self._canary_policy(rid, PolicyKind.RANK) or self.rank
        if group is None or not policy.acts:
            return None
        state = self.dp_state(int(t.inst[i]), now, exclude=i, needs_requests=policy.needs_requests)
        rank = policy.choose(state, int(t.l_in[i]))
        t.rank[i] = -1 if rank is None else rank
        if self.decisions is not None and self.decisions.sampled(rid):
            rec = rank_record(policy.name, rid, v.instance_ids[int(t.inst[i])], state, rank, now)
            self.decisions.add([Record.of(rec)])
        return rank

    def dp_state(self, index: int, now: float, exclude: int = -1, needs_requests: bool | None = None) -> DPState:
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
        if (self.rank.needs_requests if needs_requests is None else needs_requests) and len(rows):
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
        """Record polled KV usage and engine-side waiting requests, and when they were reported
        (unknown ids are ignored)."""
        i = self._index.get(str(state.id))
        if i is None:
            return
        self.view.kv_usage[i] = state.kv_usage
        self.view.waiting_obs[i] = state.waiting
        self.view.waiting_obs_at[i] = math.inf if state.observed_at is None else state.observed_at

    def index_of(self, instance_id: str) -> int:
        return self._index[instance_id]

    # --- per-instance step terms (a live calibration) ------------------------------------------
    def set_instance_profile(self, instance_id: str, profile: PerfProfile | None) -> None:
        """Project the instance's prefill steps with `profile`'s step terms from now on (its
        calibrated profile: core/calibration/online.py); None: the shared terms again (the
        cluster's profile, the prefill estimator's coefficients). Unknown ids are ignored."""
        i = self._index.get(instance_id)
        if i is None:
            return
        q = self.view.queues
        q.set_terms(i, None if profile is None else StepTerms.of(profile, chunked=q.terms.chunked))

    def instance_terms(self, instance_id: str) -> StepTerms:
        """The step terms the instance's prefill steps are projected with."""
        return self.view.queues.terms_of(self._index[instance_id])

    def prefill_backlog_s(self, instance_id: str, now: float) -> float:
        """Seconds until what the projection holds on the instance has drained (0: nothing queued),
        the backlog SLO admission judges a new prompt by (before its drift correction)."""
        return max(float(self.view.prefill_free_at[self._index[instance_id]]) - now, 0.0)
