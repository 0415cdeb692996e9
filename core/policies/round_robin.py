"""Round robin: decode instances in turn (SIBYL's RR baseline); prefill by least queued work."""

from __future__ import annotations

import numpy as np

from core.decision_records import note
from core.policies.base import NoParams, RoutingPolicyBase
from core.policies.choice import decode_candidates, least_queued_prefill, projected_handoff
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView


@register(PolicyKind.ROUTING, "round_robin", NoParams, "decode instances in turn, ignoring load")
class RoundRobin(RoutingPolicyBase):
    def __init__(self, params: NoParams) -> None:
        super().__init__(params)
        self._next = 0

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        mask = decode_candidates(view)
        order = np.flatnonzero(mask)
        # The first routable index at or after the cursor (wrapping), so a down instance is skipped.
        k = int(np.searchsorted(order, self._next % view.n_instances))
        d = int(order[k % len(order)])
        if view.explain is not None:  # the rotation distance from the cursor: the next in turn scores 0
            turn = (np.arange(view.n_instances) - self._next % view.n_instances) % view.n_instances
            note(view, "decode", self.name, "turn", turn, mask, d)
        self._next = d + 1
        return Assignment(
            view.instance_ids[p],
            view.instance_ids[d],
            projected_handoff(request, prefill_end, view),
        )
