"""The read-only cluster view a policy decides on: instances, the request table, the estimators."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from core.perf import PerfProfile
from core.request_table import RUNNING, RequestTable
from core.types import InstanceState, Role


@dataclass
class ClusterView:
    """What policies see. The dispatcher owns and updates it in place; policies must not mutate it."""

    profile: PerfProfile
    table: RequestTable
    survival: SurvivalEstimator
    prefill_time: PrefillTimeEstimator
    decode_rate: DecodeRateEstimator
    now: float = 0.0
    instance_ids: list[str] = field(default_factory=list)
    """Every instance ever added, by index; an index is never reused."""
    roles: list[Role] = field(default_factory=list)
    serves_prefill: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    serves_decode: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    healthy: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    present: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    prefill_free_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """When each prefill instance is projected to have finished what was routed to it."""
    observed: dict[str, InstanceState] = field(default_factory=dict)
    """The latest polled state of each instance (live backends)."""
    running_n: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Running (decoding) requests per instance index, kept incrementally by the dispatcher."""
    pending_n: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Requests bound to each decode instance that have not started decoding yet."""
    _masks: dict[Role, np.ndarray] = field(default_factory=dict)

    def invalidate(self) -> None:
        """Forget cached masks after instances are added, removed, flipped or change health."""
        self._masks.clear()

    def routable(self, role: Role) -> np.ndarray:
        """Boolean mask over instance indices that are present, healthy and serve `role`."""
        mask = self._masks.get(role)
        if mask is None:
            serves = self.serves_decode if role == Role.DECODE else self.serves_prefill
            mask = self._masks[role] = serves & self.healthy & self.present
        return mask

    def decode_mask(self) -> np.ndarray:
        return self.routable(Role.DECODE)

    def prefill_mask(self) -> np.ndarray:
        return self.routable(Role.PREFILL)

    @property
    def n_instances(self) -> int:
        return len(self.instance_ids)

    def counts(self, state: int) -> np.ndarray:
        """Requests per instance index in `state`, recounted from the table (PENDING: bound only)."""
        t = self.table
        inst = t.inst[: t.n]
        sel = (t.state[: t.n] == state) & (inst >= 0)
        return np.bincount(inst[sel], minlength=self.n_instances)

    def running_counts(self) -> np.ndarray:
        return self.running_n

    def pending_counts(self) -> np.ndarray:
        return self.pending_n

    def physical_load(self) -> np.ndarray:
        """KV tokens (prompt + generated so far) of running requests, per instance index."""
        t = self.table
        n = t.n
        run = t.state[:n] == RUNNING
        tokens = t.l_in[:n] + t.generated_at(self.now)
        return np.bincount(t.inst[:n][run], weights=tokens[run], minlength=self.n_instances)
