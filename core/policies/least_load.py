"""Least instantaneous load (ILS, as in Dynamo/llm-d): fewest running requests or tokens right now."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.policies.base import BindPoint, PolicyParams, RoutingPolicyBase
from core.policies.choice import (
    RotatingArgmin,
    decode_candidates,
    least_queued_prefill,
    projected_handoff,
)
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView


class LeastLoadParams(PolicyParams):
    by: Literal["requests", "tokens"] = Field(
        "requests",
        description="requests: fewest running requests; tokens: fewest KV tokens (prompt + generated)",
    )
    bind: Literal["arrival", "prefill_end"] = Field(
        "arrival",
        description=(
            "arrival: choose the decode instance when the request is routed; prefill_end: choose it "
            "at the handoff, on the fresher load of that moment (late binding)"
        ),
    )


@register(
    PolicyKind.ROUTING,
    "least_load",
    LeastLoadParams,
    "least instantaneous load; ignores requests still in prefill that are bound to an instance",
)
class LeastLoad(RoutingPolicyBase):
    params: LeastLoadParams

    def __init__(self, params: LeastLoadParams) -> None:
        super().__init__(params)
        self.needs_progress = params.by == "tokens"
        self.bind_at: BindPoint = "prefill_end" if params.bind == "prefill_end" else "prefill_start"
        self._argmin = RotatingArgmin()

    def load(self, view: ClusterView) -> np.ndarray:
        if self.params.by == "requests":
            return view.running_counts().astype(float)
        return view.physical_load()

    def display_load(self, view: ClusterView) -> np.ndarray:
        return self.load(view)

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        load, mask = self.load(view), decode_candidates(view)
        d = self._argmin(load, mask)
        note(view, "decode", self.name, f"load_{self.params.by}", load, mask, d)
        return d

    def choose_decode_at(self, request: Request, view: ClusterView, tau: float) -> int:
        return self.choose_decode(request, view)

    def decode_loads(self, request: Request, view: ClusterView, tau: float) -> np.ndarray:
        return self.load(view)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p, prefill_end = least_queued_prefill(request, view)
        late = self.params.bind == "prefill_end"
        d = None if late else view.instance_ids[self.choose_decode(request, view)]
        return Assignment(view.instance_ids[p], d, projected_handoff(request, prefill_end, view))
