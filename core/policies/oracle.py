"""Simulator-only reference for prefix-aware routing: the prefill instance with the least true TTFT,
from the exact caches and queues."""

from __future__ import annotations

from collections import deque

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.errors import NoCapacityError
from core.policies.choice import RotatingArgmin
from core.policies.compose import ComposedParams, ComposedRouting
from core.policies.registry import register
from core.prefill import StepTerms
from core.types import Assignment, PolicyKind, Request, Role
from core.view import ClusterView


class OracleParams(ComposedParams):
    decode: str = Field(
        "sibyl",
        description="the routing policy whose decode choice is used (clairvoyant allowed: this is simulator-only)",
    )


@register(
    PolicyKind.ROUTING,
    "oracle",
    OracleParams,
    "simulator only: prefill where the true TTFT is least, from every instance's exact cache and "
    "what its queue will add to it; decode by another routing policy (default sibyl)",
)
class Oracle(ComposedRouting):
    """What it knows that a live router cannot ("knows the future"):

    - every instance's cache exactly, at the moment of the decision (the simulator's pools);
    - what the requests already queued on each prefill instance will have cached there when this
      one's prefill starts (their keys; the queue is FIFO), so a prefix that is being computed
      counts as a hit, as it will be;
    - the profile's true prefill terms for the uncached tokens (not the online estimate), batched
      into the dispatcher's projection of the queued work (core/prefill.py);
    - true output lengths, for its decode policy (e.g. ``decode=clairvoyant``).

    It does not know future arrivals (it never holds a prefix back for a request to come) and it
    does not see evictions that happen between the decision and the prefill. It keeps no load
    guard: its TTFT already counts the queue. Requests routed before it became active are not in
    its queue record.
    """

    reads_prefix = True

    params: OracleParams
    needs_true_lengths = True
    allow_sim_only_decode = True

    def __init__(self, params: OracleParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()
        self._queued: dict[int, deque[tuple[float, tuple[int, ...]]]] = {}
        self._held: dict[int, dict[int, int]] = {}
        self._true: tuple[int, StepTerms] | None = None

    def _terms(self, view: ClusterView) -> StepTerms:
        """The profile's own step terms (the true ones in the simulator)."""
        if self._true is None or self._true[0] != id(view.profile):
            self._true = (id(view.profile), StepTerms.of(view.profile))
        return self._true[1]

    def _expire(self, now: float) -> None:
        for p, q in self._queued.items():
            held = self._held[p]
            while q and q[0][0] <= now:
                for k in q.popleft()[1]:
                    n = held[k] - 1
                    if n:
                        held[k] = n
                    else:
                        del held[k]

    def _will_cache(self, p: int, keys: tuple[int, ...], start: int, cap: int) -> int:
        """Leading blocks (at least `start`) cached on p once its queued requests have run."""
        held = self._held.get(p)
        n = start
        if held:
            while n < cap and keys[n] in held:
                n += 1
        return n

    def route(self, request: Request, view: ClusterView) -> Assignment:
        if view.routable_count(Role.PREFILL) == 0:
            raise NoCapacityError("no healthy prefill instance")
        self._expire(view.now)
        mask = view.prefill_mask()
        keys = request.prefix_keys
        bs = view.block_size
        cap = min(len(keys), max(request.prompt_tokens - 1, 0) // bs)
        cached = view.cached_tokens(request).copy()
        for j in np.flatnonzero(mask).tolist():
            cached[j] = self._will_cache(j, keys, int(cached[j]) // bs, cap) * bs
        first = view.queues.first_token_at(
            np.maximum(request.prompt_tokens - cached, 1.0), view.now, view.prefill_free_at, self._terms(view)
        )
        ttft = np.where(mask, first - view.now, np.inf)
        p = int(self._argmin(ttft, mask))
        note(view, "prefill", self.name, "true_ttft_s", ttft, mask, p, will_cache_tokens=cached)
        tau = view.now + float(ttft[p]) + view.profile.kv_transfer_time(request.prompt_tokens)
        if keys:
            self._queued.setdefault(p, deque()).append((view.now + float(ttft[p]), keys[:cap]))
            held = self._held.setdefault(p, {})
            for k in keys[:cap]:
                held[k] = held.get(k, 0) + 1
        d = self.decode_at(request, view, tau)
        ids = view.instance_ids
        return Assignment(ids[p], None if d is None else ids[d], tau)
