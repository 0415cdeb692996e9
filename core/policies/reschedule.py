"""Reschedule policies (periodic migrations between decode instances): the `none` baseline."""

from __future__ import annotations

from core.policies.base import PeriodicParams, ReschedulePolicyBase
from core.policies.registry import register
from core.types import Migration, PolicyKind
from core.view import ClusterView


@register(
    PolicyKind.RESCHEDULE,
    "none",
    PeriodicParams,
    "baseline: never migrates; a request decodes where it was bound until it ends",
)
class NoReschedule(ReschedulePolicyBase):
    """The baseline of "no rescheduling": proposes nothing, so it is never scheduled (acts=False).

    Every other reschedule policy is measured against it: same routing, no migrations.
    """

    acts = False

    def propose(self, view: ClusterView, now: float) -> list[Migration]:
        return []
