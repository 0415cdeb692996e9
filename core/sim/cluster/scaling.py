"""How the simulator carries out scale actions: cold start, drain-then-stop, drain-then-flip.

- add: a new instance (named p<k>/d<k>, k one past the highest in use) joins STARTING and becomes
  ACTIVE (routable) profile.cold_start_s later.
- remove: the instance is DRAINING at once (nothing new is routed to it); it becomes STOPPED when
  nothing routed to it is left (prefill queue empty, not prefilling, nothing pending or running
  as decode). A running request is never killed.
- flip: the instance drains the same way (it takes no new work of either role meanwhile, so its
  old work ends as soon as possible); when idle it takes its new role and becomes ACTIVE again.
Actions naming an unknown instance or one that is not ACTIVE are recorded as "refused".

The executor talks to the dispatcher; what the engine must do (add an instance and schedule its
cold start, give a flipped instance its new role) it returns as effects
(core/sim/cluster/effects.py), which the engine applies in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.perf import PerfProfile
from core.sim.cluster.dispatcher import SimDispatcher
from core.sim.cluster.effects import Effect, ServeRole, StartInstance
from core.types import InstancePhase, Role, ScaleAction


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """One step of a scale action as executed in the simulator."""

    time: float
    action: str
    """add | remove | flip"""
    instance_id: str
    role: Role
    """The role added, the removed instance's role, or the new role of a flip."""
    phase: str
    """The phase reached (starting, active, draining, stopped) or "refused"."""
    reason: str


class ScaleExecutor:
    """Carries out ScaleActions in a cluster simulation and records every step."""

    def __init__(self, dispatcher: SimDispatcher, profile: PerfProfile, idle: Callable[[int], bool]) -> None:
        """`idle(x)`: nothing routed to instance x (dispatcher index) is left in the engine."""
        self.dispatcher = dispatcher
        self.profile = profile
        self.idle = idle
        self.events: list[ScaleEvent] = []
        self.draining: dict[int, ScaleAction] = {}
        """Instance index → the remove or flip action waiting for it to become idle."""

    def _record(self, now: float, a: ScaleAction, iid: str, phase: str, note: str = "") -> None:
        reason = a.reason + (f" [{note}]" if note else "")
        self.events.append(ScaleEvent(now, a.action, iid, a.role, phase, reason))

    def _new_id(self, role: Role) -> str:
        prefix = {Role.PREFILL: "p", Role.DECODE: "d", Role.BOTH: "b"}[role]
        used = [int(i[1:]) for i in self.dispatcher.view.instance_ids if i[:1] == prefix and i[1:].isdigit()]
        return f"{prefix}{max(used, default=-1) + 1}"

    def execute(self, a: ScaleAction, now: float) -> list[Effect]:
        d = self.dispatcher
        if a.action == "add":
            iid = self._new_id(a.role)
            self._record(now, a, iid, InstancePhase.STARTING.value)
            return [StartInstance(iid, a.role, now + self.profile.cold_start_s)]
        iid = a.instance_id or ""
        if iid not in d.view.instance_ids or d.phase_of(iid) != InstancePhase.ACTIVE:
            self._record(now, a, iid, "refused", "instance is not active")
            return []
        x = d.index_of(iid)
        d.begin_drain(iid)
        self.draining[x] = a
        self._record(now, a, iid, InstancePhase.DRAINING.value)
        return self.check(now)

    def ready(self, x: int, now: float) -> None:
        """Cold start over: the instance becomes routable."""
        d = self.dispatcher
        iid = d.view.instance_ids[x]
        d.set_phase(iid, InstancePhase.ACTIVE)
        role = d.role_of(iid)
        self.events.append(ScaleEvent(now, "add", iid, role, InstancePhase.ACTIVE.value, "cold start done"))

    def check(self, now: float) -> list[Effect]:
        """Finish the drains whose instance has nothing left."""
        d = self.dispatcher
        effects: list[Effect] = []
        for x in [x for x in self.draining if self.idle(x)]:
            a = self.draining.pop(x)
            iid = d.view.instance_ids[x]
            if a.action == "remove":
                d.remove_instance(iid)
                self._record(now, a, iid, InstancePhase.STOPPED.value, "drained")
            else:
                d.flip_role(iid, a.role)
                effects.append(ServeRole(x, a.role))
                d.set_phase(iid, InstancePhase.ACTIVE)
                self._record(now, a, iid, InstancePhase.ACTIVE.value, f"drained; now {a.role}")
        return effects
