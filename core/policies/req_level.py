"""REQLEVEL (SIBYL's ablation): fewest requests per decode instance, counting those still in prefill."""

from __future__ import annotations

from core.decision_records import note
from core.policies.base import NoParams, RoutingPolicyBase
from core.policies.choice import (
    RotatingArgmin,
    decode_candidates,
    least_queued_prefill,
    projected_handoff,
)
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView


@register(
    PolicyKind.ROUTING,
    "req_level",
    NoParams,
    "fewest requests per decode instance including pending (bound, still in prefill)",
)
class ReqLevel(RoutingPolicyBase):
    def __init__(self, params: NoParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        load = (view.running_counts() + view.pending_counts()).astype(float)
        mask = decode_candidates(view)
        d = self._argmin(load, mask)
        note(view, "decode", self.name, "requests_incl_pending", load, mask, d)
        return Assignment(
            view.instance_ids[p],
            view.instance_ids[d],
            projected_handoff(request, prefill_end, view),
        )
