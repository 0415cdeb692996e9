"""Changes to a running cluster by an operator or the periodic policies: scale out and in, flip a role, and
the policies' decisions carried out (scaling by the scaler, migrations by console.live.migrations)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from adapters.backends import Capability
from console.live.migrations import Migrations, ScaleError
from console.live.scaler import Scaler
from core.errors import ConfigError, SibylError
from core.types import Role, ScaleAction

if TYPE_CHECKING:
    from adapters.backends import Backend
    from adapters.vllm.instances import Instance
    from core.dispatch import Dispatcher
    from core.types import PeriodicDecisions

__all__ = ["Operations", "ScaleError"]


class Operations:
    """Scale and flip on the backend (checked first, refused with why), and the periodic policies' decisions."""

    def __init__(
        self,
        backend: Backend,
        dispatcher: Dispatcher,
        instances: dict[str, Instance],
        scaler: Scaler,
        migrations: Migrations,
    ) -> None:
        self.backend = backend
        self.dispatcher = dispatcher
        """Each instance's phase (only active instances count toward what must remain)."""
        self.instances = instances
        self.scaler = scaler
        """Carries out add, remove and flip (each with its reason, drained first on removal)."""
        self.migrations = migrations

    @property
    def can_scale(self) -> bool:
        """Whether the backend can add and remove instances."""
        return Capability.SCALE in self.backend.capabilities

    async def stop(self) -> None:
        """Cancel the scaling under way."""
        await self.scaler.stop()

    # --- periodic policies -----------------------------------------------------------------------
    def carry_out(self, decisions: PeriodicDecisions, scaling_policy: str, reschedule_policy: str) -> None:
        """The periodic policies' decisions: scaling actions, then migrations (refused with why when the backend
        cannot)."""
        for action in decisions.scale:
            with contextlib.suppress(SibylError):  # a refusal is recorded as an event by the scaler
                self.scaler.execute(action, source=f"policy:{scaling_policy}")
        self.migrations.carry_out(decisions.migrations, f"policy:{reschedule_policy}")

    # --- by an operator --------------------------------------------------------------------------
    async def scale(self, role: str, delta: int, source: str = "api") -> dict[str, Any]:
        """Add `delta` instances of a role (or remove -delta: routing stops at once, the process after draining)."""
        if not self.can_scale:
            raise ScaleError(f"the {self.backend.label} backend cannot add or remove instances")
        if role not in ("prefill", "decode") or not isinstance(delta, int) or isinstance(delta, bool) or delta == 0:
            raise ScaleError('expected {"role": "prefill"|"decode", "delta": a non-zero integer}')
        r = Role(role)
        changed: list[str] = []
        reason = f"operator via {source}"
        if delta > 0:
            for _ in range(delta):
                iid = self.scaler.execute(ScaleAction("add", r, reason=reason), source)
                assert iid is not None
                changed.append(iid)
            return {"role": role, "delta": delta, "instances": changed}
        d = self.dispatcher
        routable = [i for i in self.instances.values() if i.role == r and d.phase_of(i.id) == "active"]
        if len(routable) + delta < 1:
            raise ScaleError(f"at least one {role} instance must remain ({len(routable)} active)")
        for inst in routable[delta:]:
            self.scaler.execute(ScaleAction("remove", r, inst.id, reason=reason), source)
            changed.append(inst.id)
        return {"role": role, "delta": delta, "instances": changed}

    async def flip(self, instance_id: str, role: str, source: str = "api") -> dict[str, Any]:
        """Make an instance serve the other role (routing changes; requests on it finish where they are)."""
        try:
            r = Role(role)
        except ValueError:
            raise ScaleError(f"unknown role {role!r}: prefill or decode") from None
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ScaleError(f"no instance {instance_id!r}; instances: {', '.join(self.instances)}")
        if inst.role == r:
            raise ScaleError(f"{instance_id} already serves {role}")
        others = [
            i
            for i in self.instances.values()
            if i.role == inst.role and i.id != instance_id and self.dispatcher.phase_of(i.id) == "active"
        ]
        if not others:
            raise ScaleError(f"{instance_id} is the last active {inst.role.value} instance")
        try:
            self.scaler.execute(ScaleAction("flip", r, instance_id, reason=f"operator via {source}"), source)
        except ConfigError as e:
            raise ScaleError(str(e)) from None
        return {"instance": instance_id, "role": role}
