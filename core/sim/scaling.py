"""How the simulator carries out scale actions: cold start, drain-then-stop, drain-then-flip.

- add: a new instance (named p<k>/d<k>, k one past the highest in use) joins STARTING and becomes
  ACTIVE (routable) profile.cold_start_s later.
- remove: the instance is DRAINING at once (nothing new is routed to it); it becomes STOPPED when
  nothing routed to it is left (prefill queue empty, not prefilling, nothing pending or running
  as decode). A running request is never killed.
- flip: the instance drains the same way (it takes no new work of either role meanwhile, so its
  old work ends as soon as possible); when idle it takes its new role and becomes ACTIVE again.
Actions naming an unknown instance or one that is not ACTIVE are recorded as "refused".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.types import InstancePhase, Role, ScaleAction

if TYPE_CHECKING:
    from core.sim.engine import Simulation


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
    """Carries out ScaleActions on a Simulation and records every step."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.events: list[ScaleEvent] = []
        self.draining: dict[int, ScaleAction] = {}
        """Instance index → the remove or flip action waiting for it to become idle."""

    def _record(self, now: float, a: ScaleAction, iid: str, phase: str, note: str = "") -> None:
        reason = a.reason + (f" [{note}]" if note else "")
        self.events.append(ScaleEvent(now, a.action, iid, a.role, phase, reason))

    def _new_id(self, role: Role) -> str:
        prefix = {Role.PREFILL: "p", Role.DECODE: "d", Role.BOTH: "b"}[role]
        used = [
            int(i[1:])
            for i in self.sim.dispatcher.view.instance_ids
            if i[:1] == prefix and i[1:].isdigit()
        ]
        return f"{prefix}{max(used, default=-1) + 1}"

    def execute(self, a: ScaleAction, now: float) -> None:
        sim, d = self.sim, self.sim.dispatcher
        if a.action == "add":
            iid = self._new_id(a.role)
            x = sim.add_instance(iid, a.role, InstancePhase.STARTING)
            self._record(now, a, iid, InstancePhase.STARTING.value)
            sim.schedule_ready(x, now + sim.profile.cold_start_s)
            return
        iid = a.instance_id or ""
        if iid not in d.view.instance_ids or d.phase_of(iid) != InstancePhase.ACTIVE:
            self._record(now, a, iid, "refused", "instance is not active")
            return
        x = d.index_of(iid)
        d.begin_drain(iid)
        self.draining[x] = a
        self._record(now, a, iid, InstancePhase.DRAINING.value)
        self.check(now)

    def ready(self, x: int, now: float) -> None:
        """Cold start over: the instance becomes routable."""
        d = self.sim.dispatcher
        iid = d.view.instance_ids[x]
        d.set_phase(iid, InstancePhase.ACTIVE)
        role = d.role_of(iid)
        self.events.append(
            ScaleEvent(now, "add", iid, role, InstancePhase.ACTIVE.value, "cold start done")
        )

    def check(self, now: float) -> None:
        """Finish the drains whose instance has nothing left."""
        sim, d = self.sim, self.sim.dispatcher
        for x in [x for x in self.draining if sim.idle(x)]:
            a = self.draining.pop(x)
            iid = d.view.instance_ids[x]
            if a.action == "remove":
                d.remove_instance(iid)
                self._record(now, a, iid, InstancePhase.STOPPED.value, "drained")
            else:
                d.flip_role(iid, a.role)
                sim.serve_role(x, a.role)
                d.set_phase(iid, InstancePhase.ACTIVE)
                self._record(now, a, iid, InstancePhase.ACTIVE.value, f"drained; now {a.role}")
