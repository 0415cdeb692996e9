"""Session affinity: consistent hashing of the request's session over the prefill instances, with bounded loads; decode by another policy."""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right

import numpy as np
from pydantic import Field

from core.errors import NoCapacityError
from core.policies.compose import ComposedParams, ComposedRouting
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request, Role
from core.view import ClusterView


class SessionAffinityParams(ComposedParams):
    epsilon: float = Field(
        0.25,
        ge=0,
        description=(
            "load bound (Mirrokni et al., consistent hashing with bounded loads): an instance "
            "holding more than (1 + epsilon) × the mean load (requests routed to it and not yet "
            "through prefill, counting this one) is skipped for the next one on the ring"
        ),
    )
    replicas: int = Field(
        64, ge=1, le=4096, description="virtual nodes per instance on the hash ring (smoother shares)"
    )


def _h(text: str) -> int:
    """A process-independent 64-bit hash (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


@register(
    PolicyKind.ROUTING,
    "session_affinity",
    SessionAffinityParams,
    "prefill instance by consistent hashing of the session (request id without one), skipping "
    "instances above (1+epsilon) × mean load; decode by another routing policy (default sibyl)",
)
class SessionAffinity(ComposedRouting):
    """The cheap baseline of cache-aware routing: the same session lands on the same prefill
    instance (so its growing prompt finds its prefix there) while that instance is not overloaded.
    The ring is rebuilt when the set of routable prefill instances changes; only the sessions of
    an instance that left or joined move (consistent hashing)."""

    params: SessionAffinityParams

    def __init__(self, params: SessionAffinityParams) -> None:
        super().__init__(params)
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[int] = []

    def _ring(self, view: ClusterView) -> None:
        idx = np.flatnonzero(view.prefill_mask())
        members = tuple(view.instance_ids[i] for i in idx)
        if members == self._members:
            return
        ring = sorted(
            (_h(f"{iid}#{r}"), int(i)) for i, iid in zip(idx, members, strict=True) for r in range(self.params.replicas)
        )
        self._members = members
        self._points = [p for p, _ in ring]
        self._owners = [o for _, o in ring]

    def prefill_for(self, request: Request, view: ClusterView) -> int:
        """The first instance clockwise from the session's point whose load is within the bound."""
        if view.routable_count(Role.PREFILL) == 0:
            raise NoCapacityError("no healthy prefill instance")
        self._ring(view)
        mask = view.prefill_mask()
        load = view.prefill_n
        bound = math.ceil((1.0 + self.params.epsilon) * (int(load[mask].sum()) + 1) / int(mask.sum()) - 1e-9)
        key = request.session or f"request:{request.id}"
        start = bisect_right(self._points, _h(key))
        owners, n = self._owners, len(self._owners)
        for k in range(n):
            i = owners[(start + k) % n]
            if load[i] + 1 <= bound:
                return i
        return owners[start % n]  # unreachable: the least loaded instance is always within the bound

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p = self.prefill_for(request, view)
        cached = view.cached_tokens(request)[p]
        begin = max(float(view.prefill_free_at[p]), view.now)
        end = begin + float(view.prefill_time(max(request.prompt_tokens - int(cached), 1)))
        tau = end + view.profile.kv_transfer_time(request.prompt_tokens)
        d = self.decode_at(request, view, tau)
        ids = view.instance_ids
        return Assignment(ids[p], None if d is None else ids[d], tau)
