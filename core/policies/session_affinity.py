"""Session affinity: consistent hashing of the request's session over the prefill instances, with bounded loads;
decode by another policy."""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.errors import NoCapacityError
from core.policies.choice import least_queued_prefill
from core.policies.compose import ComposedParams, ComposedRouting
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request, Role
from core.view import ClusterView


class SessionAffinityParams(ComposedParams):
    """Requests with a session follow the ring; requests without one go to the least queued
    prefill instance (as least_load), which no param changes."""

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
    "prefill instance by consistent hashing of the session, skipping instances above (1+epsilon) × "
    "mean load; without a session the least queued one (as least_load); decode by another routing "
    "policy (default sibyl)",
)
class SessionAffinity(ComposedRouting):
    """The cheap baseline of cache-aware routing: the same session lands on the same prefill
    instance (so its growing prompt finds its prefix there) while that instance is not overloaded.
    The ring is rebuilt when the set of routable prefill instances changes; only the sessions of
    an instance that left or joined move (consistent hashing).

    A request without a session has nothing to be affine to: it goes to the prefill instance
    that frees up first, as least_load places it (hashing its request id would spread such
    requests at random, bounded only by request counts: 20-28% worse P99 TTFT than least_load
    on the session-less Azure trace)."""

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
        """The first instance clockwise from the session's point whose load is within the bound;
        without a session, the least queued prefill instance."""
        if not request.session:
            return least_queued_prefill(request, view)[0]
        if view.routable_count(Role.PREFILL) == 0:
            raise NoCapacityError("no healthy prefill instance")
        self._ring(view)
        mask = view.prefill_mask()
        load = view.prefill_n
        bound = math.ceil((1.0 + self.params.epsilon) * (int(load[mask].sum()) + 1) / int(mask.sum()) - 1e-9)
        start = bisect_right(self._points, _h(request.session))
        owners, n = self._owners, len(self._owners)
        for k in range(n):
            i = owners[(start + k) % n]
            if load[i] + 1 <= bound:
                if view.explain is not None:
                    self._note(view, start, mask, load, bound, i)
                return i
        return owners[start % n]  # unreachable: the least loaded instance is always within the bound

    def _note(self, view: ClusterView, start: int, mask: np.ndarray, load: np.ndarray, bound: int, chosen: int) -> None:
        """Record the ring walk: each instance's place in the walk from the session's point (the
        first within the load bound wins), and whether it was within the bound."""
        order = np.full(view.n_instances, np.inf)
        owners, n = self._owners, len(self._owners)
        for k in range(n):
            i = owners[(start + k) % n]
            if not np.isfinite(order[i]):
                order[i] = float(np.count_nonzero(np.isfinite(order)))
        note(view, "prefill", self.name, "ring_order", order, mask & (load + 1 <= bound), chosen, {"load_bound": bound})

    def route(self, request: Request, view: ClusterView) -> Assignment:
        p = self.prefill_for(request, view)
        cached = view.cached_tokens(request)[p]
        end = view.first_token_at_one(p, max(request.prompt_tokens - int(cached), 1))
        tau = end + view.profile.kv_transfer_time(request.prompt_tokens)
        d = self.decode_at(request, view, tau)
        ids = view.instance_ids
        return Assignment(ids[p], None if d is None else ids[d], tau)
